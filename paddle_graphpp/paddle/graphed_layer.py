"""``CUDAGraphedLayer``: a paddle.nn.Layer whose forward and backward replay CUDA graphs.

A drop-in for ``paddle.device.cuda.cuda_graphed_layer.CUDAGraphedLayer`` (same first two
arguments) that adds: several outputs (more than one differentiable), gradients for every
input that requires one, one shared memory pool captured in execution order, no replay right
after capture, signature checks, and an eager fallback.
"""

from __future__ import annotations

import paddle

from ..core.engine import GraphedCallable, graphed_engine, graphed_layer_doc
from .runtime import RUNTIME

__all__ = ["CUDAGraphedLayer"]


class CUDAGraphedLayer(paddle.nn.Layer):
    __doc__ = graphed_layer_doc(arg="layer", base="paddle.nn.Layer", no_grad="paddle.no_grad()",
                                accumulate_grads=False, generators=False)

    def __init__(self, layer: paddle.nn.Layer, num_warmup_steps: int = 3, *, fallback: str = "error",
                 memory: str = "shared", max_in_flight: int = 64, max_signatures: int = 4,
                 name: str | None = None):
        super().__init__()
        if not isinstance(layer, paddle.nn.Layer):
            raise TypeError(f"CUDAGraphedLayer wraps a paddle.nn.Layer, got {type(layer).__name__}")
        self.layer = layer
        self._engine = graphed_engine(
            layer, RUNTIME, lambda: [p for p in layer.parameters() if not p.stop_gradient],
            kind="CUDAGraphedLayer", name=name, num_warmup_steps=num_warmup_steps, fallback=fallback,
            memory=memory, max_in_flight=max_in_flight, max_signatures=max_signatures)

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
