"""Paddle API of paddle_graphpp (the top-level package re-exports these names, Paddle first).

Importing this package does not import paddle (:mod:`paddle_graphpp.paddle.memory.allocator`
must work before ``import paddle``); its public names import paddle on first use.
"""

from .._lazy import lazy_attributes

_LAZY = {
    "CUDAGraphedLayer": "paddle_graphpp.paddle.graphed",
    "PipelineLayer": "paddle_graphpp.paddle.pipeline",
    "graph_pipeline": "paddle_graphpp.paddle.pipeline",
    "GraphedPipeline": "paddle_graphpp.paddle.pipeline",
    "graph_loss": "paddle_graphpp.paddle.loss",
    "GraphedLoss": "paddle_graphpp.paddle.loss",
    "install": "paddle_graphpp.paddle.upstream",
    "uninstall": "paddle_graphpp.paddle.upstream",
    "PaddleGraphedOptimizer": "paddle_graphpp.paddle.optim",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
