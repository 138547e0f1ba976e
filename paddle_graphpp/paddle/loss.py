"""The loss graphed beside the layers, as in the PyTorch runtime: :func:`graph_loss`.

:func:`graph_loss` wraps a loss function (a function or a ``paddle.nn.Layer`` without trainable
parameters) in a :class:`~paddle_graphpp.paddle.graphed.CUDAGraphedLayer`: its forward and
backward are recorded and captured with the stage's graphs, in their pool. Each call returns its
own loss tensor (copied out of the graph's output), so the losses a schedule keeps over a step
stay each micro-batch's. ``undo()`` releases the graphs and gives the loss function back.
``graph_pipeline(model, graph_loss=True)`` uses it on the last stage's loss. Bad input raises
``TypeError`` when graphed.
"""

from __future__ import annotations

from typing import Callable, Optional

import paddle

from ..core.options import EngineOptions
from .graphed import CUDAGraphedLayer, paddle_engine_options

__all__ = ["GraphedLoss", "graph_loss"]


class _LossLayer(paddle.nn.Layer):
    """A loss function as a layer: ``loss_fn(*args)``."""

    def __init__(self, loss_fn: Callable):
        super().__init__()
        self.__dict__["loss_fn"] = loss_fn  # not a sublayer: nothing to register

    def forward(self, *args):
        return self.loss_fn(*args)


class GraphedLoss:
    """What :func:`graph_loss` returns: call it as the loss function. Deliberately not a
    ``paddle.nn.Layer``: a model that holds it keeps its parameters and ``state_dict()`` keys.

    Attributes:
        graphed: the loss's :class:`~paddle_graphpp.CUDAGraphedLayer`; ``engine`` is its engine.
        loss_fn: the loss function it was given (unchanged).
    """

    def __init__(self, graphed: CUDAGraphedLayer, loss_fn: Callable):
        self.graphed = graphed
        self.loss_fn = loss_fn
        self.__name__ = getattr(loss_fn, "__name__", type(loss_fn).__name__)  # fleet logs it

    @property
    def engine(self):
        return self.graphed.engine

    def __call__(self, *args):
        loss = self.graphed(*args)
        return loss.clone() if isinstance(loss, paddle.Tensor) else loss

    def undo(self) -> Callable:
        """Release the loss's graphs and return the loss function given to :func:`graph_loss`.
        This object refuses calls afterwards.

        Raises:
            GraphScheduleError: a micro-batch's backward has not run yet (undo between steps).
            RuntimeError: undone already.
        """
        self.graphed.undo()
        return self.loss_fn


def graph_loss(loss_fn: Callable, *warmup: int, name: Optional[str] = None, options: Optional[EngineOptions] = None,
               **engine_kwargs: object) -> GraphedLoss:
    """The last stage's loss function, captured as CUDA graphs with the stage's graphs.

    Args:
        loss_fn: ``loss_fn(output, labels) -> loss``, a function or a layer without trainable
            parameters; shapes fixed (a graph replays the shapes it captured).
        name: its name in logs and errors (``"loss"`` by default).
        options, **engine_kwargs: engine options, as for :class:`~paddle_graphpp.CUDAGraphedLayer`.

    Returns:
        A :class:`GraphedLoss`; without CUDA it computes eagerly.

    Raises:
        TypeError: ``loss_fn`` is not callable, is graphed already or has trainable parameters;
            an option that is not one.
    """
    label = name or "loss"
    if isinstance(loss_fn, GraphedLoss):
        raise TypeError(f"graph_loss({label}): the loss is graphed already; pass the loss function itself")
    if not callable(loss_fn):
        raise TypeError(f"graph_loss({label}): loss_fn must be callable, got {type(loss_fn).__name__}")
    if isinstance(loss_fn, paddle.nn.Layer):
        trainable = [n for n, p in loss_fn.named_parameters() if not p.stop_gradient]
        if trainable:
            raise TypeError(f"graph_loss({label}): the loss {type(loss_fn).__name__} has trainable parameters "
                            f"{trainable[:4]}; keep it eager or move them into the last stage")
    chosen = paddle_engine_options(f"graph_loss({label})", graph_loss, warmup, engine_kwargs, options)
    layer = loss_fn if isinstance(loss_fn, paddle.nn.Layer) else _LossLayer(loss_fn)
    return GraphedLoss(CUDAGraphedLayer(layer, name=label, options=chosen), loss_fn)
