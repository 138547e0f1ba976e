"""Megatron-Core's CUDA RNG tracker, registered with every capture, and its gradient accumulation.

:data:`TRACKER` is what the PyTorch runtime registers with every capture and names in the hint of
a capture that fails on the tracker (:data:`paddle_graphpp.torch.runtime.RNG_TRACKERS`): its states
register only when seeded with ``model_parallel_cuda_manual_seed(seed,
use_cudagraphable_rng=True)``. :func:`accumulation_hooked` tells the runtime where Megatron-Core's
``DistributedDataParallel`` hooks a parameter's gradient accumulation (``accumulate_grads="auto"``
then leaves it to autograd). Megatron is read from ``sys.modules``, never imported here. Why:
docs/pytorch.md#cudagraphedmodule.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["RngTracker", "TRACKER", "tracker_states", "accumulation_hooked"]


@dataclass(frozen=True)
class RngTracker:
    """A library's RNG tracker as a capture sees it.

    Attributes:
        name: the library and tracker, for messages.
        states: ``() -> ({name: generator} of graph-safe states, [names of states that are not])``;
            both empty when the library is not loaded or its tracker not set up.
        fix: what to call so that every state is graph-safe.
    """

    name: str
    states: Callable[[], tuple]
    fix: str


def tracker_states() -> tuple:
    """The states of Megatron-Core's CUDA RNG tracker when Megatron is imported and the tracker
    set up: ``({name: generator} of graph-safe states, [names of states that are not])``."""
    random = sys.modules.get("megatron.core.tensor_parallel.random")
    tracker = getattr(random, "_CUDA_RNG_STATE_TRACKER", None) if random is not None else None
    states = getattr(tracker, "states_", None)
    if not isinstance(states, dict):
        return {}, []
    safe = {name: s for name, s in states.items() if isinstance(s, torch.Generator)}
    return safe, [name for name in states if name not in safe]


TRACKER = RngTracker("Megatron-Core's RNG tracker", tracker_states,
                     "model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True)")


def accumulation_hooked(param: torch.Tensor) -> bool:
    """Whether Megatron-Core's ``DistributedDataParallel`` hooks ``param``'s gradient accumulation:
    it registers the hook on the accumulator node (``grad_fn.next_functions[0][0].register_hook``),
    which no attribute of the parameter shows, and gives the parameter a ``main_grad`` buffer,
    which does."""
    return hasattr(param, "main_grad")
