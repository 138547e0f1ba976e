"""``CUDAGraphedModule``: a torch.nn.Module whose forward and backward replay CUDA graphs."""

from __future__ import annotations

import torch

from ..core.engine import GraphedCallable, graphed_engine, graphed_layer_doc
from .runtime import RUNTIME

__all__ = ["CUDAGraphedModule"]


class CUDAGraphedModule(torch.nn.Module):
    __doc__ = graphed_layer_doc(arg="module", base="torch.nn.Module", no_grad="torch.no_grad()",
                                accumulate_grads=True)

    def __init__(self, module: torch.nn.Module, num_warmup_steps: int = 3, *, fallback: str = "error",
                 memory: str = "shared", max_in_flight: int = 64, max_signatures: int = 4,
                 accumulate_grads: bool | str = "auto", name: str | None = None):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"CUDAGraphedModule wraps a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self._engine = graphed_engine(
            module, RUNTIME, lambda: [p for p in module.parameters() if p.requires_grad],
            kind="CUDAGraphedModule", name=name, num_warmup_steps=num_warmup_steps, fallback=fallback,
            memory=memory, max_in_flight=max_in_flight, max_signatures=max_signatures,
            accumulate_grads=accumulate_grads)

    def forward(self, *args, **kwargs):
        return self._engine(args, kwargs)

    @property
    def engine(self) -> GraphedCallable:
        """The engine: ``replays``, ``captures``, ``in_flight`` and ``graph_count()`` for inspection."""
        return self._engine
