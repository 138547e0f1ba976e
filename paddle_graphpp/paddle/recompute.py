"""Activation checkpointing in graphed layers (``recompute=True``), the Paddle side.

:func:`checkpointed` runs a recomputing layer's eager calls (warmup, the recorded step, fallbacks,
a build without CUDA) under fleet's non-reentrant recompute. :class:`Mirrors` gives its backward
graph generator states of its own, set before each backward replay to where the forward replay
drew, so the recomputation draws the forward's numbers; :func:`keeping_state_index` puts back the
generator state that was current before a replay.

Not verified on a GPU (no Paddle GPU build runs here; on CPU the bookkeeping is tested with the CPU
generator). A random kernel that takes its seed on the host and registers nothing with the graph
(``dropout(axis=...)`` as shipped) would draw other numbers in the recomputation, and the gradients
would be wrong without an error: keep such kernels out of recomputing graphed layers. How Paddle
3.3.1's generators and dropout behave in graphs: docs/paddle.md#recompute.
"""

from __future__ import annotations

import contextlib
import paddle
from paddle.base import core

from ..core.runtime import RngMirror

__all__ = ["Mirrors", "checkpointed", "current_generator", "keeping_state_index"]


def current_generator() -> tuple:
    """``(generator, device index)``: the generator Paddle's kernels on the current place draw
    from (the current GPU's default CUDA generator, else the CPU generator, index 0)."""
    place = paddle.framework._current_expected_place_()
    if isinstance(place, paddle.CUDAPlace):
        device = place.get_device_id()
        return core.default_cuda_generator(device), device
    return core.default_cpu_generator(), 0


@contextlib.contextmanager
def keeping_state_index():
    """The current generator's current state index as it was before the block, after it (a
    replay's parameter setters leave the state they drew from current)."""
    generator, _ = current_generator()
    before = generator.get_state_index()
    try:
        yield
    finally:
        generator.set_state_index(before)


def _tracker_states() -> dict:
    """Fleet's RNG tracker's named states: ``{name: [state index per device]}`` (empty unless
    tensor parallelism seeded it, or fleet is not importable)."""
    try:
        from paddle.distributed.fleet.meta_parallel.parallel_layers.random import get_rng_state_tracker
    except ImportError:
        return {}
    return get_rng_state_tracker().states_


class Mirrors(RngMirror):
    """The mirrors of the states one recomputing layer draws from: the generator's current state
    when it is made, and each named state of fleet's RNG tracker (docs/paddle.md#recompute)."""

    def __init__(self):
        generator, self.device = current_generator()
        self.generator = generator
        tracker = _tracker_states()
        self.names = list(tracker)
        current = generator.get_state_index()
        self.sources = [current] + [tracker[name][self.device] for name in self.names]
        self.mirrors = []
        for source in self.sources:  # a copy of each source; registering makes the copy current
            generator.set_state_index(source)
            self.mirrors.append(generator.register_state_index(generator.get_state()))
        generator.set_state_index(current)

    @contextlib.contextmanager
    def swapped(self):
        generator, tracker = self.generator, _tracker_states()
        missing = sorted(set(tracker) - set(self.names))
        if missing:
            raise RuntimeError(
                f"fleet's RNG tracker has states {missing} that were added after this recomputing layer made its "
                f"random-number mirrors; call paddle_graphpp.reset_graphs(model) after seeding the tracker")
        before = generator.get_state_index()
        saved = {name: tracker[name] for name in self.names}
        for name, mirror in zip(self.names, self.mirrors[1:]):
            indices = list(saved[name])
            indices[self.device] = mirror
            tracker[name] = indices
        generator.set_state_index(self.mirrors[0])
        try:
            yield
        finally:
            generator.set_state_index(before)
            tracker.update(saved)

    def note(self) -> tuple:
        generator = self.generator
        before = generator.get_state_index()
        noted = []
        for source in self.sources:
            generator.set_state_index(source)
            noted.append(generator.get_state())  # a copy: seed, offset and CPU engine
        generator.set_state_index(before)
        return tuple(noted)

    def restore(self, noted: tuple) -> None:
        generator = self.generator
        before = generator.get_state_index()
        for mirror, state in zip(self.mirrors, noted):
            generator.set_state_index(mirror)
            generator.set_state(state)
        generator.set_state_index(before)


def checkpointed(fn, args: tuple, kwargs: dict):
    """``fn(*args, **kwargs)`` under fleet's non-reentrant recompute, the RNG state preserved:
    the autograd graph keeps the inputs, and the backward runs ``fn`` again when it first needs
    what ``fn`` saved."""
    from paddle.distributed.fleet.recompute.recompute import recompute

    return recompute(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
