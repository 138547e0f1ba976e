"""Activation checkpointing in graphed layers (``recompute=True``), the Paddle side.

A recomputing layer's forward graph runs without autograd and keeps no activations; its backward
graph runs the forward again over the static inputs, then the backward (``core.layer_capture``).

Eager calls (warmup, the recorded step, fallbacks, and every call on a build without CUDA) run
under fleet's non-reentrant recompute, ``paddle.distributed.fleet.recompute.recompute(...,
use_reentrant=False)`` (:func:`checkpointed`): its saved-tensor hooks keep the inputs and run the
layer again, with the forward's RNG state, when the backward first needs what it saved. The
engine then differentiates against the parameters with ``paddle.grad``, which this form supports;
fleet's reentrant form (a ``PyLayer``) would add the parameters' gradients into ``.grad`` inside
its own backward, behind the engine.

Random numbers in the graphs. What Paddle 3.3.1 does, read from the headers its wheel ships
(``paddle/include/paddle/phi/core/generator.h``, ``phi/kernels/funcs/dropout_impl.cu.h``,
``phi/backends/gpu/cuda/cuda_graph.h``): a generator holds several states, one of them current
(``Generator.register_state_index`` / ``set_state_index`` / ``get_state_index``; fleet's RNG
tracker keeps its named states that way). Dropout's kernel, launched while a stream captures,
records the index of the current state and registers a parameter setter with the graph
(``CUDAGraphNodeLauncher``); at every replay, before the launch, the setter makes that state
current, takes its seed and offset and advances the offset. So the recomputation in the backward
graph cannot draw from the state the forward graph draws from: it draws from a *mirror*, a state
of its own registered on the same generator, current while the backward is captured
(:meth:`Mirrors.swapped`). Before a forward replay :meth:`Mirrors.note` copies the state the
forward graph is about to draw from; before the matching backward replay :meth:`Mirrors.restore`
copies it into the mirror, so the recomputation draws what the forward drew, and the source
state advances by the forward's draws only, as eagerly. Named states of fleet's RNG tracker
(``get_rng_state_tracker()``, tensor-parallel dropout) get mirrors too: while the backward is
captured the tracker hands out the mirrors' indices. The setter leaves the state it used
current; :func:`keeping_state_index` (around every replay of the Paddle runtime) puts the one
before the replay back.

Not verified on a GPU: no Paddle build with GPU kernels runs on the machines this project is
tested on. On CPU the mirrors' bookkeeping is tested with the CPU generator (the same state API;
dropout draws from its current state there too). What the headers do not settle: in the shipped
headers only dropout without ``axis`` goes through the setter; a random kernel that takes its seed
and offset on the host when launched and registers nothing (``dropout(axis=...)``'s
``VectorizedGeneratorMask`` launch as shipped; others live in sources the wheel does not ship)
would keep the numbers of its capture in each graph, so the forward graph and the recomputation
would draw different ones and the gradients would be wrong without an error. Keep such kernels
out of recomputing graphed layers.
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
    when it is made, and each named state of fleet's RNG tracker (see the module docstring)."""

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
