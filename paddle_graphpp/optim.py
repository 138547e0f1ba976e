"""Graph-safe optimizer steps: one captured sequence of clip + step + zero-grad.

The public names dispatch on the framework of their argument (a ``torch.optim.Optimizer``
or ``torch.Tensor``; a ``paddle.optimizer.Optimizer`` or ``paddle.Tensor``), decided by
:func:`paddle_graphpp.core.runtime.framework_of`. The maths lives in the ``optim`` module of
each framework's package (:mod:`paddle_graphpp.torch.optim`, :mod:`paddle_graphpp.paddle.optim`);
importing this module imports neither framework.

Everything here keeps its values on the device: the global norm is a 0-d device tensor,
the clipping coefficient ``min(1, max_norm / (norm + eps))`` is multiplied in without a host
branch, and gradients are zeroed in place so their addresses stay fixed for the graph.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .core.runtime import framework_module, framework_of

__all__ = ["GraphedOptimizer", "global_grad_norm", "clip_by_global_norm"]


def _framework_module(obj: Any, what: str):
    name = framework_of(obj)
    if name is None:
        raise TypeError(f"paddle_graphpp.{what}: expected a torch or paddle object, got "
                        f"{type(obj).__module__}.{type(obj).__qualname__}")
    return framework_module(name, "optim")


def _first_tensor(tensors: Sequence[Any], what: str):
    tensors = list(tensors)
    first = next((t for t in tensors if t is not None), None)
    if first is None:
        raise ValueError(f"paddle_graphpp.{what}: no tensors given (all entries are None or the list is empty)")
    return tensors, first


def global_grad_norm(grads: Sequence[Any], norm_type: float = 2.0) -> Any:
    """The norm of all ``grads`` together, as a 0-d tensor on the device (no host sync).

    Args:
        grads: gradient tensors (``None`` entries are skipped), all of one framework.
        norm_type: the p of the p-norm; ``inf`` for the max norm (torch only).

    The result is computed as the framework's own clipping computes it (torch:
    ``torch.nn.utils.get_total_norm``; paddle: the sum of squared L2 norms of
    ``ClipGradByGlobalNorm``), so it matches those bit for bit.
    """
    grads, first = _first_tensor(grads, "global_grad_norm")
    return _framework_module(first, "global_grad_norm").global_grad_norm(grads, norm_type=norm_type)


def clip_by_global_norm(grads: Sequence[Any], max_norm: float, *, eps: Optional[float] = None,
                        norm_type: float = 2.0) -> Any:
    """Scale ``grads`` in place by ``min(1, max_norm / (norm + eps))``; return the norm before.

    The coefficient stays on the device and is always multiplied in (by 1 when the norm is
    within bounds), so the call never waits for the device and can be captured in a graph.

    Args:
        grads: gradient tensors, scaled in place (``None`` entries are skipped).
        max_norm: the largest global norm let through; must be positive.
        eps: added to the norm. ``None`` uses the framework's convention, which makes the
            result bit-identical to its own clipping: torch ``1e-6``
            (``torch.nn.utils.clip_grad_norm_``), paddle ``0.0``
            (``paddle.nn.ClipGradByGlobalNorm``).
        norm_type: the p of the p-norm (torch only; paddle clips by the 2-norm).

    Raises:
        ValueError: ``max_norm`` is not positive, or no gradient is given.
    """
    if not max_norm > 0:
        raise ValueError(f"paddle_graphpp.clip_by_global_norm: max_norm must be > 0, got {max_norm!r}")
    grads, first = _first_tensor(grads, "clip_by_global_norm")
    module = _framework_module(first, "clip_by_global_norm")
    return module.clip_by_global_norm(grads, max_norm, eps=eps, norm_type=norm_type)


class GraphedOptimizer:
    """Wrap an optimizer so that clip + ``step()`` + zero-grad run as one CUDA graph.

    ``GraphedOptimizer(optimizer, clip_grad_norm=None, **options)`` returns the framework's
    implementation: :class:`paddle_graphpp.torch.optim.TorchGraphedOptimizer` for a
    ``torch.optim.Optimizer``, :class:`paddle_graphpp.paddle.optim.PaddleGraphedOptimizer`
    for a ``paddle.optimizer.Optimizer``. See those classes for the options and the contract;
    in short:

    * ``step()`` clips the gradients (when ``clip_grad_norm`` is set), runs the optimizer's
      step and zeroes the gradients in place, as one captured graph replayed on every call
      after the first. It returns the pre-clip global norm as a device tensor (or ``None``).
    * ``zero_grad()`` / ``clear_grad()`` zero in place; never set gradients to ``None``.
    * The learning rate lives in a device tensor that LR schedules update, so schedules
      keep working on replays.
    * Optimizers that cannot be captured (host reads such as ``.item()``, no capturable
      mode) and sparse gradients are refused with an error.
    * Without CUDA, the same sequence runs eagerly and matches the plain optimizer bit
      for bit.
    * ``compile=True`` (PyTorch only) runs the captured sequence through ``torch.compile``
      first, fusing a ``foreach`` optimizer's passes; the Paddle class refuses it with a
      ``ValueError``.
    * ``undo()`` releases the graph and returns the wrapped optimizer, with what wrapping changed
      in it (capturable mode, lr tensor, where step counts live) put back.
    """

    _undone = False

    def __new__(cls, optimizer, *args, **kwargs):
        if cls is GraphedOptimizer:
            module = _framework_module(optimizer, "GraphedOptimizer")
            cls = module.GRAPHED_OPTIMIZER
        return super().__new__(cls)

    def undo(self) -> Any:
        """Release the captured step's graph and return the wrapped optimizer, with what wrapping
        changed in it put back (the framework class says what); its state (moments, step
        counts) is what the steps so far made. This object refuses :meth:`step` afterwards.

        Raises:
            RuntimeError: undone already.
        """
        if self._undone:
            raise RuntimeError(f"GraphedOptimizer({type(self.optimizer).__name__}): undo() was called twice; use the "
                               f"optimizer the first undo() returned")
        from .graph_api import forget_graph

        forget_graph(self._sequence)  # the graph graph_process keeps the step in
        self._give_back()
        self._undone = True
        return self.optimizer

    def _give_back(self) -> None:
        """Put back what construction and the first steps changed in the wrapped optimizer."""

    def _refuse_undone(self) -> None:
        if self._undone:
            raise RuntimeError(f"GraphedOptimizer({type(self.optimizer).__name__}) was undone and its graph released; "
                               f"step the optimizer undo() returned, or wrap it again")
