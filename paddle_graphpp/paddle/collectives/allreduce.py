"""Paddle all-reduce behind the capture-aware dispatcher, and routing of fleet's TP layers.

Paddle gets the same dispatcher as PyTorch, but no peer-memory kernel: paddle_graphpp builds
no Paddle custom op, and the Paddle GPU wheels that can be installed (2.6.2, sm_61..sm_86,
no PTX) cannot run on the Hopper GPUs this project is measured on. So
:meth:`PaddleAllReduceBackend.custom_unavailable_reason` always answers, and every call takes
the ``FALLBACK`` path: ``paddle.distributed.all_reduce``, which NCCL can capture. The
dispatcher, path choice and buffer bookkeeping are the shared core, proven on GPUs through
the PyTorch backend.

:func:`route_fleet_tensor_parallel` makes the reductions of fleet's ``ColumnParallelLinear``
(input gradient) and ``RowParallelLinear`` (output) go through a dispatcher while graphed,
i.e. inside ``capture_custom_allreduce()`` or on a capturing stream.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import numpy as np
import paddle
import paddle.distributed as dist

from ...core.collectives import (AllReduceBackend, AllReduceDispatcher, CustomAllReducePolicy,
                                TensorFacts, in_capture_phase)
from ..runtime import active_runtime

__all__ = ["PaddleAllReduceBackend", "create_allreduce", "route_fleet_tensor_parallel"]

NO_KERNEL = ("no Paddle peer-memory all-reduce kernel exists in paddle_graphpp (no custom op is "
             "built, and Paddle's GPU wheels cannot run on the lent Hopper GPUs); "
             "paddle.distributed.all_reduce is used")


class PaddleAllReduceBackend(AllReduceBackend):
    """All-reduce of one Paddle group: the framework collective on every path.

    Args:
        group: a ``paddle.distributed`` group (default: the global group).
    """

    name = "paddle"

    def __init__(self, group: Any = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("PaddleAllReduceBackend: call paddle.distributed.init_parallel_env() first")
        self.group = group
        self._world = group.nranks if group is not None else dist.get_world_size()

    @property
    def world_size(self) -> int:
        return self._world

    def custom_unavailable_reason(self) -> Optional[str]:
        return NO_KERNEL

    def facts(self, tensor: Any) -> TensorFacts:
        nbytes = int(np.prod(tensor.shape, dtype=np.int64)) * tensor.element_size()
        return TensorFacts(nbytes=nbytes, dtype=str(tensor.dtype).removeprefix("paddle."),
                           contiguous=tensor.is_contiguous(), address_mod16=-1)

    def is_capturing(self) -> bool:
        return active_runtime().is_capturing()

    def empty_like(self, tensor: Any) -> Any:
        return paddle.empty_like(tensor)

    def fallback(self, tensor: Any) -> Any:
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def _no_kernel(self, *_: Any) -> Any:
        raise RuntimeError(f"PaddleAllReduceBackend: {NO_KERNEL}")

    reduce_staged = _no_kernel
    reduce_registered = _no_kernel

    def arena_bytes(self) -> int:
        return 0

    def exchange(self, obj: Any) -> list:
        out: list = []
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def close(self) -> None:
        pass


def create_allreduce(group: Any = None, *, policy: Optional[CustomAllReducePolicy] = None) -> AllReduceDispatcher:
    """A capture-aware all-reduce for a Paddle group (every call falls back; see the module doc)."""
    return AllReduceDispatcher(PaddleAllReduceBackend(group), policy)


def _same_group(dispatcher: AllReduceDispatcher, group: Any) -> bool:
    mine = dispatcher.backend.group
    if mine is None or group is None:
        return mine is group
    return mine.id == group.id


class _RoutedAllReduce(paddle.autograd.PyLayer):
    @staticmethod
    def forward(ctx, x, dispatcher):
        return dispatcher.all_reduce(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


class _RoutedIdentity(paddle.autograd.PyLayer):
    @staticmethod
    def forward(ctx, x, dispatcher):
        ctx.dispatcher = dispatcher
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        return ctx.dispatcher.all_reduce(dy)


@contextlib.contextmanager
def route_fleet_tensor_parallel(dispatcher: AllReduceDispatcher) -> Iterator[None]:
    """While active, fleet's TP reductions on ``dispatcher``'s group go through it when graphed.

    Replaces ``mp_ops._mp_allreduce`` (``RowParallelLinear`` forward) and ``mp_ops._c_identity``
    (``ColumnParallelLinear``: identity forward, all-reduced input gradient) for the duration.
    Calls outside the capture phase and off a capturing stream, or on another group, keep
    fleet's own implementation.

    Ways to break it:
        * Not re-entrant across dispatchers: nesting two routes restores in LIFO order only.
        * ``mp_async_allreduce=True`` layers reduce inside their own PyLayer and are not routed.
    """
    from paddle.distributed.fleet.layers.mpu import mp_ops

    original_allreduce, original_identity = mp_ops._mp_allreduce, mp_ops._c_identity

    def graphed() -> bool:
        return in_capture_phase() or dispatcher.backend.is_capturing()

    def routed_allreduce(tensor, op=None, group=None, use_calc_stream=True, use_model_parallel=True,
                         skip_c_identity_dynamic=False):
        if paddle.in_dynamic_mode() and graphed() and _same_group(dispatcher, group):
            return _RoutedAllReduce.apply(tensor, dispatcher)
        kwargs = {} if op is None else {"op": op}
        return original_allreduce(tensor, group=group, use_calc_stream=use_calc_stream,
                                  use_model_parallel=use_model_parallel,
                                  skip_c_identity_dynamic=skip_c_identity_dynamic, **kwargs)

    def routed_identity(tensor, group=None, skip_c_identity_dynamic=False):
        if paddle.in_dynamic_mode() and graphed() and _same_group(dispatcher, group):
            return _RoutedIdentity.apply(tensor, dispatcher)
        return original_identity(tensor, group=group, skip_c_identity_dynamic=skip_c_identity_dynamic)

    mp_ops._mp_allreduce, mp_ops._c_identity = routed_allreduce, routed_identity
    try:
        yield
    finally:
        mp_ops._mp_allreduce, mp_ops._c_identity = original_allreduce, original_identity
