"""``CUDAGraphedLayer``: a paddle.nn.Layer whose forward and backward replay CUDA graphs.

A drop-in for ``paddle.device.cuda.cuda_graphed_layer.CUDAGraphedLayer`` (same first two
arguments) that adds: several outputs (more than one differentiable), gradients for every
input that requires one, one shared memory pool captured in execution order, no replay right
after capture, signature checks, and an eager fallback.
"""

from __future__ import annotations

import paddle

from ..core.engine import EngineOptions, GraphedCallable
from .runtime import RUNTIME

__all__ = ["CUDAGraphedLayer"]


class CUDAGraphedLayer(paddle.nn.Layer):
    """Wrap ``layer`` so that, after warmup, its forward and backward replay CUDA graphs.

    Calls ``1..num_warmup_steps`` run eagerly; capture starts at the next moment no
    micro-batch is in flight and runs during a real step (the eager run gives that step's
    results; nothing is replayed right after capture). Each micro-batch position of the
    schedule gets its own forward/backward graph pair; backwards pair with forwards in FIFO
    order, so 1F1B and interleaved schedules work. All graphs share one memory pool.

    Args:
        layer: the layer to graph. Its parameters must stay on the GPU at fixed addresses.
        num_warmup_steps: eager calls per input signature before capture.
        fallback: ``"error"`` (default) raises :class:`paddle_graphpp.CaptureError` when capture
            fails; ``"eager"`` warns once and keeps running eagerly.
        memory: ``"shared"`` (default), ``"shared_reuse"`` or ``"per_graph"``.
        max_in_flight: forwards that may await their backward before that is an error.
        max_signatures: input signatures captured; later new ones run eagerly with a warning.
        name: the name used in messages (default: the layer's class name).

    Without CUDA (a CPU build, or CPU inputs) the layer runs eagerly and warns once. Under
    ``paddle.no_grad()`` it always runs eagerly.

    .. warning:: Outputs alias graph memory: they are valid until the same micro-batch position
       is replayed again (the next step). Clone an output you keep across steps.
    .. warning:: Do not modify outputs in place or replace parameters; graphs read fixed addresses.
    .. warning:: Code inside must not synchronise with the host (``.item()``, ``.numpy()``,
       data-dependent shapes); capture fails with a :class:`paddle_graphpp.CaptureError`.
    .. warning:: The schedule must repeat every step (graphs replay in capture order).
    """

    def __init__(self, layer: paddle.nn.Layer, num_warmup_steps: int = 3, *, fallback: str = "error",
                 memory: str = "shared", max_in_flight: int = 64, max_signatures: int = 4,
                 name: str | None = None):
        super().__init__()
        if not isinstance(layer, paddle.nn.Layer):
            raise TypeError(f"CUDAGraphedLayer wraps a paddle.nn.Layer, got {type(layer).__name__}")
        self.layer = layer
        options = EngineOptions(num_warmup_steps=num_warmup_steps, fallback=fallback, memory=memory,
                                max_in_flight=max_in_flight, max_signatures=max_signatures)
        self._engine = GraphedCallable(
            layer, RUNTIME, lambda: [p for p in layer.parameters() if not p.stop_gradient],
            name=name or f"CUDAGraphedLayer({type(layer).__name__})", options=options)

    def forward(self, *args, **kwargs):
        return self._engine(args, kwargs)

    @property
    def engine(self) -> GraphedCallable:
        """The engine: ``replays``, ``captures``, ``in_flight`` and ``graph_count()`` for inspection."""
        return self._engine
