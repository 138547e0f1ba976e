"""``CUDAGraphedLayer``: a paddle.nn.Layer whose forward and backward replay CUDA graphs.

A drop-in for ``paddle.device.cuda.cuda_graphed_layer.CUDAGraphedLayer`` (same first two
arguments) that adds: several outputs (more than one differentiable), gradients for every
input that requires one, one shared memory pool captured in execution order, no replay right
after capture, signature checks, an eager fallback, and ``paddle.jit.to_static`` inside the
graphs (:mod:`paddle_graphpp.paddle.compile`). The class is a boundary for Paddle's SOT:
``paddle.jit.to_static`` of a model holding graphed layers calls them as they are.
"""

from __future__ import annotations

from types import MappingProxyType

import paddle

from ..core.engine import EngineHooks, HoldsEngine, graphed_engine, graphed_label, graphed_layer_doc
from ..core.layer import hooks_for
from ..core.options import EngineOptions, engine_options
from .runtime import active_runtime
from .compile import StaticLayer, opaque, to_static_options

__all__ = ["CUDAGraphedLayer", "PADDLE_REFUSED_OPTIONS", "paddle_engine_options"]

#: Engine options the Paddle runtime has no use for, each with the reason (refused, not ignored).
PADDLE_REFUSED_OPTIONS = MappingProxyType({
    "accumulate_grads": "the Paddle runtime cannot add gradients inside backward graphs; autograd accumulates them",
    "generators": "every Paddle generator a kernel draws from while a stream captures registers itself with the graph",
})

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

_PADDLE_NOTES = MappingProxyType({"memory": "``per_graph`` is upstream Paddle's own design."})

_WARNINGS_DOC = """    .. warning:: ``paddle.jit.to_static`` of a model holding graphed layers: SOT (the default,
       ``full_graph=False``) converts the code around them and calls each graphed layer as it
       is (a graph break); the AST converter (``full_graph=True``) cannot, and a graphed layer
       called while it builds its program raises ``RuntimeError``.
"""


def paddle_engine_options(owner: str, door, positional: tuple, keywords: dict,
                          options: EngineOptions | None) -> EngineOptions:
    """:func:`~paddle_graphpp.core.options.engine_options` for a Paddle front door: the options
    of :data:`PADDLE_REFUSED_OPTIONS` refused."""
    return engine_options(owner, door, positional, keywords, options=options, refused=PADDLE_REFUSED_OPTIONS)


@opaque  # paddle.jit.to_static (SOT) around a model calls its graphed layers as they are (see .to_static)
class CUDAGraphedLayer(HoldsEngine, paddle.nn.Layer):
    _wraps = "layer"
    __doc__ = graphed_layer_doc(arg="layer", base="paddle.nn.Layer", no_grad="paddle.no_grad()",
                                outputs="Outputs are then overwritten: clone what you keep.",
                                refused=tuple(PADDLE_REFUSED_OPTIONS), notes=_PADDLE_NOTES,
                                extra_args=_TO_STATIC_DOC, warnings=_WARNINGS_DOC)

    def __init__(self, layer: paddle.nn.Layer, *warmup: int, to_static=False, name: str | None = None,
                 options: EngineOptions | None = None, **engine_kwargs: object):
        super().__init__()
        if not isinstance(layer, paddle.nn.Layer):
            raise TypeError(f"CUDAGraphedLayer wraps a paddle.nn.Layer, got {type(layer).__name__}")
        label = graphed_label("CUDAGraphedLayer", layer, name)
        chosen = paddle_engine_options(label, CUDAGraphedLayer.__init__, warmup, engine_kwargs, options)
        compiled = to_static_options(to_static, label)
        run = layer if compiled is None else StaticLayer(layer, compiled, label)
        self.layer = layer
        self._engine = graphed_engine(run, active_runtime(), lambda: [p for p in layer.parameters() if not p.stop_gradient],
                                      name=label, options=chosen, hooks=hooks_for(layer, label, chosen, EngineHooks()))

    def forward(self, *args, **kwargs):
        return self._engine(args, kwargs)
