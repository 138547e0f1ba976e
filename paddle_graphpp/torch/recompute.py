"""Activation checkpointing in graphed layers (``recompute=True``), the PyTorch side.

:func:`checkpointed` runs a recomputing layer's eager calls (warmup, the recorded step, fallbacks)
under ``torch.utils.checkpoint`` (non-reentrant, the RNG state preserved). :class:`Mirrors` gives
its backward graph clones of the generator's state, set before each backward replay to where the
forward replay drew, so the recomputation draws the forward's dropout masks and the generator
advances by the forward's draws only. Layers that draw from other generators (``generators=``,
Megatron-Core's tracker) are refused: eager checkpointing would not repeat their draws. How:
docs/pytorch.md#activation-checkpointing-and-fsdp2.
"""

from __future__ import annotations

import contextlib
import torch
import torch.utils.checkpoint

from ..core.runtime import RngMirror

__all__ = ["Mirrors", "checkpointed"]


class Mirrors(RngMirror):
    """The mirror of the current device's default CUDA generator (the one generator a recomputing
    layer may draw from: the runtime refuses others, see ``TorchRuntime.rng_mirror``)."""

    def __init__(self):
        self.generators = [torch.cuda.default_generators[torch.cuda.current_device()]]
        self.mirrors = [g.clone_state() for g in self.generators]

    @contextlib.contextmanager
    def swapped(self):
        before = [g.graphsafe_get_state() for g in self.generators]
        for g, m in zip(self.generators, self.mirrors):
            g.graphsafe_set_state(m)
        try:
            yield
        finally:
            for g, state in zip(self.generators, before):
                g.graphsafe_set_state(state)

    def note(self) -> tuple:
        return tuple((g.initial_seed(), g.get_offset()) for g in self.generators)

    def restore(self, noted: tuple) -> None:
        for m, (seed, offset) in zip(self.mirrors, noted):
            if m.initial_seed() != seed:  # reseeded since (manual_seed): the mirror follows
                m.manual_seed(seed)
            m.set_offset(offset)


def _cuda_rng_contexts():
    """``torch.utils.checkpoint``'s ``context_fn``: the recomputation starts from the current CUDA
    device's RNG state as the forward found it, and leaves the state as it was. Checkpoint's own
    ``preserve_rng_state`` covers only the devices of positional tensor arguments; a block may
    be given its tensors by keyword."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return contextlib.nullcontext(), contextlib.nullcontext()
    device = torch.cuda.current_device()
    state = torch.cuda.get_rng_state(device)

    @contextlib.contextmanager
    def recompute():
        with torch.random.fork_rng(devices=[device]):
            torch.cuda.set_rng_state(state, device)
            yield

    return contextlib.nullcontext(), recompute()


def checkpointed(fn, mapping: dict, args: tuple, kwargs: dict):
    """``fn(*args, **kwargs)`` with its parameters replaced by ``mapping`` (name -> tensor, as
    :func:`torch.func.functional_call` takes it) under non-reentrant ``torch.utils.checkpoint``:
    the recomputation in the backward uses the same replacements and the forward's random state."""
    def run(*a, **k):
        return torch.func.functional_call(fn, mapping, a, k, strict=False, tie_weights=False)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True,
                                             context_fn=_cuda_rng_contexts, **kwargs)
