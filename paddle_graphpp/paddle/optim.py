"""Paddle side of :mod:`paddle_graphpp.optim`: graph-safe clipping and zeroing, and
:class:`PaddleGraphedOptimizer`.

Clipping follows ``paddle.nn.ClipGradByGlobalNorm`` op for op, so it is bit-identical to it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional, Sequence

import paddle

from ..graph_api import graph_process
from .runtime import active_runtime
from ..optim import GraphedOptimizer

__all__ = ["global_grad_norm", "clip_by_global_norm", "zero_grads_", "PaddleGraphedOptimizer"]

logger = logging.getLogger(__name__)

#: ClipGradByGlobalNorm divides by max(norm, max_norm), i.e. no eps; 0.0 reproduces it exactly.
PADDLE_CLIP_EPS = 0.0


def _present(tensors) -> list:
    return [t for t in tensors if t is not None]


def global_grad_norm(grads: Sequence[Any], norm_type: float = 2.0) -> paddle.Tensor:
    """Global 2-norm of ``grads`` as a device tensor, summed as ``ClipGradByGlobalNorm`` sums it.

    Raises:
        ValueError: ``norm_type`` is not 2 (Paddle's global-norm clipping is the 2-norm only).
    """
    if float(norm_type) != 2.0:
        raise ValueError(f"paddle_graphpp (paddle): only the global 2-norm is supported, got norm_type={norm_type}")
    from paddle.nn.clip import _squared_l2_norm  # the op ClipGradByGlobalNorm uses, with its fp32 cast rule

    low, fp32, fp64 = [], [], []
    for g in _present(grads):
        if g.is_selected_rows():
            raise RuntimeError("paddle_graphpp (paddle): a gradient is SelectedRows (sparse); sparse gradients "
                               "cannot be graphed. Use dense gradients (e.g. Embedding(sparse=False)).")
        square = _squared_l2_norm(g)
        if square.dtype in (paddle.float16, paddle.bfloat16):
            low.append(square)
        elif square.dtype == paddle.float32:
            fp32.append(square)
        else:
            fp64.append(square)
    if not (low or fp32 or fp64):
        return paddle.zeros([], dtype="float32")
    sum_dtype = "float64" if fp64 else "float32"
    parts = []
    if low:
        parts.append(paddle.stack(low).sum().astype(sum_dtype))
    if fp32:
        total = paddle.stack(fp32).sum()
        parts.append(total if sum_dtype == "float32" else total.astype(sum_dtype))
    if fp64:
        parts.append(paddle.stack(fp64).sum())
    return paddle.sqrt(paddle.stack(parts).sum())


def clip_by_global_norm(grads: Sequence[Any], max_norm: float, *, eps: Optional[float] = None,
                        norm_type: float = 2.0) -> paddle.Tensor:
    """Scale ``grads`` in place by ``min(1, max_norm / (norm + eps))``; return the norm.

    With the default ``eps`` (``0.0``) the coefficient equals ``ClipGradByGlobalNorm``'s
    ``max_norm / max(norm, max_norm)`` bit for bit. No host branch: the coefficient is always
    multiplied in.
    """
    grads = _present(grads)
    eps = PADDLE_CLIP_EPS if eps is None else float(eps)
    with paddle.no_grad():
        norm = global_grad_norm(grads, norm_type)
        limit = paddle.full([1], float(max_norm), dtype=norm.dtype)
        coef = paddle.minimum(limit / (norm + eps), paddle.ones_like(limit))
        for g in grads:
            g.multiply_(coef if coef.dtype == g.dtype else coef.astype(g.dtype))
    return norm


def zero_grads_(grads: Sequence[Any]) -> None:
    """Zero ``grads`` in place; their addresses stay fixed."""
    with paddle.no_grad():
        for g in _present(grads):
            g.zero_()


class PaddleGraphedOptimizer(GraphedOptimizer):
    """Clip + ``optimizer.step()`` + in-place ``clear_grad``, captured once and replayed.

    Args:
        optimizer: ``paddle.optimizer.Adam`` or ``AdamW`` (``multi_precision=True`` gives
            fp32 master weights for bf16/fp16 parameters).
        clip_grad_norm: clip the gradients (of parameters whose ``need_clip`` is not False)
            to this global 2-norm before the step; ``None`` does not clip.
        eps: added to the norm when clipping (default ``0.0``, as ``ClipGradByGlobalNorm``).
        compile: accepted for a common signature with the PyTorch class, and only as
            ``False``: ``compile=True`` (``torch.compile`` of the step) has no Paddle
            counterpart here and is refused.

    Without CUDA each step runs eagerly and is bit-identical to the same optimizer built with
    ``grad_clip=paddle.nn.ClipGradByGlobalNorm(clip_grad_norm)`` followed by ``clear_grad()``.

    On a GPU build, the first ``step()`` runs eagerly (creating the optimizer's
    accumulators), then Adam's ``beta1_pow``/``beta2_pow`` accumulators — kept on the CPU by
    Paddle, which would freeze them into the graph — are moved to the parameters' device; the
    second step warms up and captures, later steps replay. The learning-rate tensor is
    refreshed from the ``LRScheduler`` (or ``set_lr``) before every replay, outside the graph.

    Usage::

        sched = paddle.optimizer.lr.CosineAnnealingDecay(3e-4, T_max=1000)
        opt = GraphedOptimizer(paddle.optimizer.AdamW(sched, parameters=model.parameters()),
                               clip_grad_norm=1.0)
        for batch in data:
            loss(model, batch).backward()
            opt.step()          # clip + AdamW + zero grads
            sched.step()
            opt.clear_grad()    # zeroes in place

    Raises:
        TypeError: not Adam/AdamW (other optimizers are not known to be capturable).
        ValueError: the optimizer already clips (``grad_clip=...``) and ``clip_grad_norm`` is
            given, or its clip skips on a host comparison (``auto_skip_clip=True``), or
            ``compile=True``.
        RuntimeError: a sparse (SelectedRows) gradient at step time.

    Warnings:
        * The GPU capture path is written against Paddle's CUDA graph API but could not be run
          here: no Paddle GPU wheel runs on the Hopper machines this project tests on.
        * ``clear_grad(set_to_zero=False)`` is refused: gradients must keep their addresses.
    """

    def __init__(self, optimizer, clip_grad_norm: Optional[float] = None, *, eps: float = PADDLE_CLIP_EPS,
                 compile: bool = False):
        if compile:
            raise ValueError("GraphedOptimizer(compile=True) is PyTorch-only (it runs the step through "
                             "torch.compile); a Paddle optimizer's step is captured as it is. Drop compile=True "
                             "for paddle.optimizer optimizers.")
        if not isinstance(optimizer, (paddle.optimizer.Adam, paddle.optimizer.AdamW)):
            raise TypeError(f"GraphedOptimizer: paddle.optimizer.{type(optimizer).__name__} is not known to be "
                            "capturable (its step may read values on the host); use paddle.optimizer.Adam or "
                            "AdamW, or step it eagerly.")
        own_clip = getattr(optimizer, "_grad_clip", None)
        if own_clip is not None and clip_grad_norm is not None:
            raise ValueError("GraphedOptimizer: the optimizer already clips (grad_clip=...); pass either its "
                             "grad_clip or clip_grad_norm, not both.")
        if getattr(own_clip, "auto_skip_clip", False):
            raise ValueError("GraphedOptimizer: ClipGradByGlobalNorm(auto_skip_clip=True) compares the norm on the "
                             "host every step; use clip_grad_norm= here (or auto_skip_clip=False) instead.")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"GraphedOptimizer: clip_grad_norm must be > 0 or None, got {clip_grad_norm!r}")
        self.optimizer = optimizer
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.eps = float(eps)
        groups = optimizer._param_groups
        if groups and isinstance(groups[0], dict):
            self._params = [p for group in groups for p in group["params"]]
        else:
            self._params = list(optimizer._parameter_list)
        self._runtime = active_runtime()
        self.unavailable_reason = self._runtime.graphs_unavailable_reason(self._params)
        self.graphed = self.unavailable_reason is None
        self._steps = 0
        self._moved: list = []  # (accumulator name, key) of the beta powers moved to the device
        if not self.graphed:
            logger.info("GraphedOptimizer(%s): running eagerly (%s)", type(optimizer).__name__,
                        self.unavailable_reason)

    def step(self) -> Optional[paddle.Tensor]:
        """Clip, step and clear the gradients; returns the pre-clip norm tensor or ``None``."""
        self._refuse_undone()
        grads = [p.grad for p in self._params]
        self._steps += 1
        if not self.graphed or self._steps == 1:
            norm = self._sequence(self._params, grads)
            if self.graphed:
                self._beta_pows_to_device()
            return norm
        self.optimizer._create_global_learning_rate()  # refresh the lr tensor in place, outside the graph
        return graph_process(self._sequence, self._params, grads)

    def clear_grad(self, set_to_zero: bool = True) -> None:
        """Zero the gradients in place.

        Raises:
            ValueError: ``set_to_zero=False`` (it would free the gradients and move them).
        """
        if not set_to_zero:
            raise ValueError("GraphedOptimizer.clear_grad(set_to_zero=False): gradients must keep their addresses "
                             "for the captured step; they are zeroed in place.")
        zero_grads_([p.grad for p in self._params])

    zero_grad = clear_grad

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict (with its ``LRScheduler``'s state)."""
        return self.optimizer.state_dict()

    # paddle.amp.GradScaler unscales the gradients of the optimizer it is given by reading these.
    @property
    def _parameter_list(self):
        return self.optimizer._parameter_list

    @property
    def _param_groups(self):
        return self.optimizer._param_groups

    def set_state_dict(self, state_dict: dict) -> None:
        """Load into the wrapped optimizer. Paddle writes accumulators that exist into their
        tensors in place (``set_value``; the captured step keeps reading them) and keeps the
        others for their lazy creation on the first step."""
        self.optimizer.set_state_dict(state_dict)

    load_state_dict = set_state_dict

    def _sequence(self, params, grads):
        norm = None
        if self.clip_grad_norm is not None:
            clipped = [g for p, g in zip(params, grads) if g is not None and getattr(p, "need_clip", True)]
            norm = clip_by_global_norm(clipped, self.clip_grad_norm, eps=self.eps)
        freeze = _frozen_lr(self.optimizer) if self._runtime.is_capturing() else contextlib.nullcontext()
        with freeze:
            self.optimizer.step()
        zero_grads_(grads)
        return norm

    def _beta_pows_to_device(self) -> None:
        opt = self.optimizer
        for name in (opt._beta1_pow_acc_str, opt._beta2_pow_acc_str):
            accumulators = opt._accumulators.get(name, {})
            place = self._params[0].place
            for key, acc in list(accumulators.items()):
                if acc.place.is_cpu_place() and not place.is_cpu_place():
                    accumulators[key] = acc._copy_to(place, True)
                    self._moved.append((name, key))

    def _give_back(self) -> None:
        # GraphedOptimizer.undo: the beta-power accumulators on the CPU again, where Paddle keeps them.
        opt = self.optimizer
        for name, key in self._moved:
            accumulators = opt._accumulators.get(name, {})
            if key in accumulators:
                accumulators[key] = accumulators[key]._copy_to(paddle.CPUPlace(), True)
        self._moved = []


@contextlib.contextmanager
def _frozen_lr(optimizer):
    """Keep ``optimizer.step()`` from re-filling its lr tensor (a fill inside a graph would freeze the value)."""
    saved = optimizer._learning_rate
    if not isinstance(saved, float):
        optimizer._learning_rate = float(optimizer.get_lr())
    try:
        yield
    finally:
        optimizer._learning_rate = saved


GRAPHED_OPTIMIZER = PaddleGraphedOptimizer
