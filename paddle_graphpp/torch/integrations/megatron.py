"""Megatron-Core's adapter (:data:`ADAPTER`): its CUDA RNG tracker, registered with every capture,
and its gradient accumulation.

:data:`TRACKER` is what every capture registers and what the hint of a capture that fails on the
tracker names (through :func:`paddle_graphpp.torch.integrations.rng_trackers`): its states
register only when seeded with ``model_parallel_cuda_manual_seed(seed,
use_cudagraphable_rng=True)``. :func:`accumulation_hooked` tells the runtime where Megatron-Core's
``DistributedDataParallel`` hooks a parameter's gradient accumulation, and :func:`hooked_buffer`
the ``main_grad`` its hook adds into (``accumulate_grads="auto"`` graphs add there themselves and
hand the hook zeros, as Megatron-Core's own graphs add into ``main_grad``). Megatron is read from
``sys.modules``, never imported here. Private: the tracker object ``_CUDA_RNG_STATE_TRACKER`` and
its ``states_``, read defensively (checked on Megatron-Core 0.19.2). Why:
docs/pytorch.md#cudagraphedmodule.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from . import Adapter, RngTracker

__all__ = ["TRACKER", "tracker_states", "accumulation_hooked", "hooked_buffer", "check_block", "ADAPTER"]


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


def hooked_buffer(param: torch.Tensor):
    """``param.main_grad``, which the ``DistributedDataParallel`` hook adds ``.grad`` into
    (``main_grad.add_(grad)``, then ``grad = None``), when it is a tensor of ``param``'s shape on
    its device and the wrapper marked the parameter (``grad_added_to_main_grad``, which it sets on
    every parameter it hooks); else ``None``. Graphs may add there themselves: the hook then adds
    the zeros it is handed, which changes no value (the buffer, zeroed at each step's start, never
    holds -0.0)."""
    buffer = getattr(param, "main_grad", None)
    if (isinstance(buffer, torch.Tensor) and buffer.shape == param.shape and buffer.device == param.device
            and hasattr(param, "grad_added_to_main_grad")):
        return buffer
    return None


def check_block(name: str, module: torch.nn.Module) -> None:
    """Refuse to graph a module whose linear layers fuse their weight-gradient accumulation
    (Megatron-Core's ``gradient_accumulation_fusion``, TransformerEngine's
    ``fuse_wgrad_accumulation``): their kernels add into ``main_grad`` themselves and hand autograd
    a placeholder, marking the parameter (``grad_added_to_main_grad``) from Python, which a replay
    does not repeat, so the hook would add the placeholder.

    Raises:
        TypeError: naming the submodule and what to turn off.
    """
    for sub_name, sub in module.named_modules():
        for flag in ("gradient_accumulation_fusion", "fuse_wgrad_accumulation"):
            if getattr(sub, flag, False) is True:
                raise TypeError(
                    f"{name}: its submodule {sub_name or type(sub).__name__} has {flag}=True: its kernels add the "
                    f"weight gradient into main_grad and mark it from Python, which graph replays do not repeat. "
                    f"Turn {flag} off for graphed layers (the graphs add into main_grad themselves).")


@dataclass(frozen=True)
class MegatronAdapter(Adapter):
    """Megatron-Core as the front doors see it: its RNG tracker and its gradient hooks."""

    name = "megatron-core"

    def rng_trackers(self) -> tuple:
        return (TRACKER,)

    def accumulation_hooked(self, param) -> bool:
        return accumulation_hooked(param)

    def hooked_buffer(self, param):
        return hooked_buffer(param)

    def check_block(self, name, layer, *, check_config) -> None:
        check_block(name, layer)

    def check_wrapped(self, name, module) -> None:
        check_block(name, module)


ADAPTER = MegatronAdapter()
