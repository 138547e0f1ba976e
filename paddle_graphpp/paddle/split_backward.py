"""A graphed layer's backward in an input half and a weight half, for fleet's DualPipeV.

While a schedule runs a zero-bubble backward (:func:`split_requested`: fleet's
``WeightGradStore.enabled``), a graphed layer's node runs :func:`input_half` (input gradients, and
the gradients of parameters no ``SplitBWLinear`` defers, to autograd at once) and puts one closure
of its own into fleet's store (:func:`queue_weight_pass`), which runs :func:`weight_half` and adds
the deferred ``input^T @ grad`` products into ``.grad`` (or ``main_grad``: :func:`accumulate`).
Inside a graphed layer's own backward the ``SplitBWLinear`` closures never reach fleet's store or
``.grad`` (:func:`own_weight_closures`), so a capture never rebinds ``.grad``; a ``SplitBWLinear``
whose weight belongs to another layer is refused (:class:`ForeignWeightError`). How fleet defers
weight gradients: docs/paddle.md#dualpipev.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Sequence

import paddle

from ..core.process import current_process

__all__ = ["split_requested", "own_weight_closures", "SplitState", "input_half", "weight_half",
           "add_foreign", "queue_weight_pass", "accumulate", "ForeignWeightError"]

_STORE_MODULE = "paddle.distributed.fleet.meta_parallel.zero_bubble_utils"


class StoreOwner:
    """Whether this package has fleet's weight-gradient store enabled (a part of the process's
    paddle section)."""

    def __init__(self) -> None:
        self.depth = 0  # own_weight_closures blocks open: the store is enabled by us, not by a schedule


def _owner() -> StoreOwner:
    return current_process().section("paddle").part(StoreOwner)


def _store_module():
    """Fleet's zero-bubble module if something imported it (no store is enabled otherwise)."""
    return sys.modules.get(_STORE_MODULE)


def split_requested() -> bool:
    """True while a schedule runs a zero-bubble backward (``WeightGradStore.enabled``)."""
    zb = _store_module()
    return zb is not None and _owner().depth == 0 and bool(zb.WeightGradStore.enabled)


@contextlib.contextmanager
def own_weight_closures():
    """Inside the block, ``SplitBWLinear`` backwards queue their weight closures into the list
    this yields, whatever the store's state outside; the store is as it was afterwards."""
    zb = _store_module()
    if zb is None:
        yield []
        return
    store = zb.WeightGradStore
    saved = store.enabled, store.cache
    mine: list = []
    store.enabled, store.cache = True, mine
    owner = _owner()
    owner.depth += 1
    try:
        yield mine
    finally:
        owner.depth -= 1
        store.enabled, store.cache = saved


def _matched(closures: Sequence[Any], params: Sequence[Any]) -> tuple[dict, list]:
    """``({param index: [(input, out_grad), ...]}, foreign)``: the closures that compute the
    gradient of one of ``params``, and the others (kept as they are)."""
    zb = _store_module()
    index = {id(p): i for i, p in enumerate(params)}
    mine: dict = {}
    foreign = []
    for closure in closures:
        if (isinstance(closure, functools.partial) and closure.func is getattr(zb, "grad_weight_fn", None)
                and len(closure.args) == 3 and id(closure.args[1]) in index):
            x, weight, out_grad = closure.args
            if not weight.stop_gradient:  # fleet's closure does nothing for a frozen weight
                mine.setdefault(index[id(weight)], []).append((x, out_grad))
        else:
            foreign.append(closure)
    return mine, foreign


def _product(param, pairs) -> Any:
    """The weight gradient ``sum(input^T @ out_grad)`` of ``pairs``, each product in ``param``'s
    dtype (fleet adds each into ``.grad`` in turn; a weight a run uses twice may round differently)."""
    zb = _store_module()
    total = None
    with paddle.no_grad():
        for x, out_grad in pairs:
            g = paddle.matmul(zb.fold_init_dims(x), zb.fold_init_dims(out_grad), transpose_x=True)
            if g.dtype != param.dtype:
                g = g.astype(param.dtype)
            total = g if total is None else total + g
    return total


class ForeignWeightError(ValueError):
    """A ``SplitBWLinear`` inside a graphed run computes the gradient of a weight the run does
    not own: inside a capture its closure would rebind that weight's ``.grad``."""


def add_foreign(closures: Sequence[Any], wrt: Sequence[Any], got: list, capturing: bool) -> None:
    """After a full backward run under :func:`own_weight_closures`: add the deferred products of
    the parameters in ``wrt`` to their entries of ``got``; run the other closures now (as they
    would have run with the store off). During a capture those cannot run (they rebind ``.grad``)."""
    mine, foreign = _matched(closures, wrt)
    for i, pairs in mine.items():
        g = _product(wrt[i], pairs)
        got[i] = g if got[i] is None else got[i] + g
    if foreign:
        if capturing:
            raise ForeignWeightError(_foreign_message(len(foreign)))
        for closure in foreign:
            closure()


def _foreign_message(count: int) -> str:
    return (f"{count} weight-gradient closure(s) of fleet's WeightGradStore were queued during a capture "
            f"for weights that are not parameters of this graphed run (they would rebind .grad inside the "
            f"graph). Keep the layers whose SplitBWLinear weights live elsewhere out of the graphed run "
            f"(paddle_graphpp.mark_not_capturable), or use plain paddle.nn.Linear there")


class SplitState:
    """What the weight half needs: the deferred ``(input, out_grad)`` pairs per parameter."""

    __slots__ = ("deferred",)

    def __init__(self, deferred: dict):
        self.deferred = deferred


def input_half(outputs, grad_outputs, inputs, params, *, capturing: bool) -> tuple:
    """The input half: ``(input gradients, parameter gradients, SplitState)``. The parameter
    gradients are those nothing defers (norms, biases, plain ``Linear`` weights): they go to
    autograd now, as eagerly, so hooks on those parameters see them during this backward."""
    wrt = list(inputs) + list(params)
    with own_weight_closures() as closures:
        got = list(paddle.grad(outputs, wrt, grad_outputs, allow_unused=True)) if wrt else []
    n = len(inputs)
    deferred, foreign = _matched(closures, params)
    if foreign:
        if capturing:
            raise ForeignWeightError(_foreign_message(len(foreign)))
        zb = _store_module()
        for closure in foreign:  # the schedule's own weight pass runs them, as eagerly
            zb.WeightGradStore.put(closure)
    return got[:n], got[n:], SplitState(deferred)


def weight_half(state: SplitState, params: Sequence[Any]):
    """Yield ``([index], [gradient])`` for each parameter with deferred products, one at a
    time; parameters without any get no gradient from this half."""
    for i, pairs in state.deferred.items():
        yield [i], [_product(params[i], pairs)]
    state.deferred = {}


def queue_weight_pass(closure) -> None:
    """Put ``closure`` into fleet's store, with the closures of the backward running now."""
    _store_module().WeightGradStore.put(closure)


def accumulate(params: Sequence[Any], grads: Sequence[Any]) -> None:
    """Add each gradient into its parameter's ``main_grad`` (where fleet's mixed precision gave
    it one) or ``.grad``, in place where one exists, as fleet's own weight closures do."""
    with paddle.no_grad():
        for p, g in zip(params, grads):
            if g is None or p.stop_gradient:
                continue
            if hasattr(p, "main_grad"):
                if p.main_grad is None:
                    p.main_grad = g.astype(paddle.float32)
                else:
                    p.main_grad.add_(g.astype(p.main_grad.dtype))
            elif p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g.astype(p.grad.dtype) if g.dtype != p.grad.dtype else g)

