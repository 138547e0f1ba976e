"""``CUDAGraphedModule``: a torch.nn.Module whose forward and backward replay CUDA graphs."""

from __future__ import annotations

import torch

from ..core.engine import EngineOptions, GraphedCallable
from .runtime import RUNTIME

__all__ = ["CUDAGraphedModule"]


class CUDAGraphedModule(torch.nn.Module):
    """Wrap ``module`` so that, after warmup, its forward and backward replay CUDA graphs.

    Calls ``1..num_warmup_steps`` run eagerly; capture starts at the next moment no
    micro-batch is in flight and runs during a real step (the eager run gives that step's
    results; nothing is replayed right after capture). Each micro-batch position of the
    schedule gets its own forward/backward graph pair; backwards pair with forwards in FIFO
    order, so 1F1B and interleaved schedules work. All graphs share one memory pool.

    Args:
        module: the module to graph. Its parameters must stay on the GPU at fixed addresses.
        num_warmup_steps: eager calls per input signature before capture.
        fallback: ``"error"`` (default) raises :class:`paddle_graphpp.CaptureError` when capture
            fails; ``"eager"`` warns once and keeps running eagerly.
        memory: ``"shared"`` (default), ``"shared_reuse"`` or ``"per_graph"``.
        max_in_flight: forwards that may await their backward before that is an error.
        max_signatures: input signatures captured; later new ones run eagerly with a warning.
        name: the name used in messages (default: the module's class name).

    Without CUDA (or with CPU inputs) the module runs eagerly and warns once. Under
    ``torch.no_grad()`` it always runs eagerly.

    .. warning:: Outputs alias graph memory: they are valid until the same micro-batch position
       is replayed again (the next step). Clone an output you keep across steps (a logged loss).
    .. warning:: Do not modify outputs in place, and do not replace parameters
       (``param.data = ...``): graphs read fixed addresses. In-place updates by optimizers are fine.
    .. warning:: Code inside must not synchronise with the host (``.item()``, printing tensors,
       data-dependent shapes); capture fails with a :class:`paddle_graphpp.CaptureError`.
    .. warning:: Gradient hooks on the wrapped module's internal tensors run at capture only.
       Hooks on parameters and on the module's inputs and outputs work as usual.
    .. warning:: The schedule must repeat every step: graphs are replayed in capture order, and a
       different order raises :class:`paddle_graphpp.GraphScheduleError` (use ``memory="per_graph"``).
    """

    def __init__(self, module: torch.nn.Module, num_warmup_steps: int = 3, *, fallback: str = "error",
                 memory: str = "shared", max_in_flight: int = 64, max_signatures: int = 4,
                 name: str | None = None):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"CUDAGraphedModule wraps a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        options = EngineOptions(num_warmup_steps=num_warmup_steps, fallback=fallback, memory=memory,
                                max_in_flight=max_in_flight, max_signatures=max_signatures)
        self._engine = GraphedCallable(
            module, RUNTIME, lambda: [p for p in module.parameters() if p.requires_grad],
            name=name or f"CUDAGraphedModule({type(module).__name__})", options=options)

    def forward(self, *args, **kwargs):
        return self._engine(args, kwargs)

    @property
    def engine(self) -> GraphedCallable:
        """The engine: ``replays``, ``captures``, ``in_flight`` and ``graph_count()`` for inspection."""
        return self._engine
