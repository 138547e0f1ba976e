"""``CUDAGraphedLayer``: a paddle.nn.Layer whose forward and backward replay CUDA graphs.

A drop-in for ``paddle.device.cuda.cuda_graphed_layer.CUDAGraphedLayer`` (same first two
arguments) that adds: several outputs (more than one differentiable), gradients for every
input that requires one, one shared memory pool captured in execution order, no replay right
after capture, signature checks, an eager fallback, and ``paddle.jit.to_static`` inside the
graphs (:mod:`paddle_graphpp.paddle.compile`). The class is a boundary for Paddle's SOT:
``paddle.jit.to_static`` of a model holding graphed layers calls them as they are.
"""

from __future__ import annotations

import paddle

from ..core.engine import HoldsEngine, graphed_engine, graphed_label, graphed_layer_doc
from .runtime import active_runtime
from .compile import StaticLayer, opaque, to_static_options

__all__ = ["CUDAGraphedLayer"]

_TO_STATIC_DOC = """        to_static: ``True`` or a dict of ``paddle.jit.to_static`` keyword arguments
            (``full_graph``, ``backend``, ``build_strategy``, ``input_spec``): the layer runs
            converted inside the graphs. It converts in the warmup calls (SOT by default) and the
            capture records the converted program's kernels; a call that would convert anew
            inside a capture raises :class:`paddle_graphpp.CaptureError`. ``layer`` itself is not
            changed. Raises ``TypeError`` / ``ValueError`` here, naming the layer, for a value
            that is not a bool or dict, an unknown key or backend, ``input_spec`` without
            ``full_graph=True``, SOT without the PIR API, a ``layer`` converted already
            (``paddle.jit.to_static(layer)``: pass it without this option, it runs converted),
            or, with SOT, a ``layer`` holding converted sublayers (Paddle 3.3.1's SOT fails on
            code that calls one). Without CUDA the layer runs converted and eagerly. Identical
            layers convert each on their own (Paddle 3.3.1 shares no conversion between layer
            instances).
"""


@opaque  # paddle.jit.to_static (SOT) around a model calls its graphed layers as they are (see .to_static)
class CUDAGraphedLayer(HoldsEngine, paddle.nn.Layer):
    __doc__ = graphed_layer_doc(arg="layer", base="paddle.nn.Layer", no_grad="paddle.no_grad()",
                                accumulate_grads=False, generators=False, extra_args=_TO_STATIC_DOC).rstrip() + """
    .. warning:: ``paddle.jit.to_static`` of a model holding graphed layers: SOT (the default,
       ``full_graph=False``) converts the code around them and calls each graphed layer as it
       is (a graph break); the AST converter (``full_graph=True``) cannot, and a graphed layer
       called while it builds its program raises ``RuntimeError``.
    """

    def __init__(self, layer: paddle.nn.Layer, num_warmup_steps: int = 3, *, fallback: str = "error",
                 memory: str = "shared", max_in_flight: int = 64, max_signatures: int = 4, to_static=False,
                 name: str | None = None):
        super().__init__()
        if not isinstance(layer, paddle.nn.Layer):
            raise TypeError(f"CUDAGraphedLayer wraps a paddle.nn.Layer, got {type(layer).__name__}")
        label = graphed_label("CUDAGraphedLayer", layer, name)
        options = to_static_options(to_static, label)
        run = layer if options is None else StaticLayer(layer, options, label)
        self.layer = layer
        self._engine = graphed_engine(
            run, active_runtime(), lambda: [p for p in layer.parameters() if not p.stop_gradient],
            name=label, num_warmup_steps=num_warmup_steps, fallback=fallback,
            memory=memory, max_in_flight=max_in_flight, max_signatures=max_signatures)

    def forward(self, *args, **kwargs):
        return self._engine(args, kwargs)
