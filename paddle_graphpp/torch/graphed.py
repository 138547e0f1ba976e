"""``CUDAGraphedModule``: a torch.nn.Module whose forward and backward replay CUDA graphs."""

from __future__ import annotations

import torch

from ..core.engine import GraphedCallable, graphed_engine, graphed_layer_doc
from .runtime import RUNTIME, _registered_generators

__all__ = ["CUDAGraphedModule"]


class CUDAGraphedModule(torch.nn.Module):
    __doc__ = graphed_layer_doc(arg="module", base="torch.nn.Module", no_grad="torch.no_grad()",
                                accumulate_grads=True, generators=True)

    def __init__(self, module: torch.nn.Module, num_warmup_steps: int = 3, *, fallback: str = "error",
                 memory: str = "shared", max_in_flight: int = 64, max_signatures: int = 4,
                 accumulate_grads: bool | str = "auto", generators=None, name: str | None = None):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"CUDAGraphedModule wraps a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        if isinstance(generators, (list, tuple)):
            try:
                _registered_generators(generators)  # check now, not at the first capture
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{name or f'CUDAGraphedModule({type(module).__name__})'}: {exc}") from None
        self._engine = graphed_engine(
            module, RUNTIME, lambda: [p for p in module.parameters() if p.requires_grad],
            kind="CUDAGraphedModule", name=name, num_warmup_steps=num_warmup_steps, fallback=fallback,
            memory=memory, max_in_flight=max_in_flight, max_signatures=max_signatures,
            accumulate_grads=accumulate_grads, generators=generators)

    def forward(self, *args, **kwargs):
        return self._engine(args, kwargs)

    def reset_graphs(self) -> None:
        """Forget this layer's graphs; they are captured anew after warmup, against the
        parameters and buffers it has now (see :func:`paddle_graphpp.reset_graphs`, which resets
        every graphed layer of a model at once)."""
        self._engine.reset()

    @property
    def engine(self) -> GraphedCallable:
        """The engine: ``replays``, ``captures``, ``in_flight`` and ``graph_count()`` for inspection."""
        return self._engine
