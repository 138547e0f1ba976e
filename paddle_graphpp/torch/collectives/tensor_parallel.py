"""A minimal column/row parallel linear pair whose all-reduces go through the dispatcher.

``ColumnParallelLinear`` splits the output features over the group (no communication in
forward; its input gradient is all-reduced in backward). ``RowParallelLinear`` splits the
input features and all-reduces its output in forward (identity in backward). A transformer
MLP is ``Row(act(Column(x)))``: one all-reduce per forward, as in Megatron-LM.

Every all-reduce goes through an :class:`~paddle_graphpp.core.collectives.AllReduceDispatcher`,
so inside graphs it is the captured custom kernel and elsewhere the copy-in or NCCL path.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...core.collectives import AllReduceDispatcher

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


class _ReduceFromRegion(torch.autograd.Function):
    """Forward: all-reduce. Backward: identity (every rank holds the full gradient)."""

    @staticmethod
    def forward(ctx, x, dispatcher):
        out = dispatcher.all_reduce(x)
        if out is x:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce of the input gradient."""

    @staticmethod
    def forward(ctx, x, dispatcher):
        ctx.dispatcher = dispatcher
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.dispatcher.all_reduce(grad.contiguous()), None


def _shard_info(dispatcher: AllReduceDispatcher, features: int, what: str, layer: str) -> tuple:
    world = dispatcher.backend.world_size
    if features % world:
        raise ValueError(f"{layer}: {what}={features} is not divisible by the group size {world}")
    group = getattr(dispatcher.backend, "group", None)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    return world, rank


class ColumnParallelLinear(nn.Module):
    """``y_local = x @ W[rank-th block of rows].T + b_local``: output features split over ranks.

    Args:
        in_features: input features (full, replicated on every rank).
        out_features: output features of the whole layer; each rank holds ``out/world``.
        dispatcher: the all-reduce used for the input gradient in backward.
        bias: add a (sharded) bias.
        device, dtype: of the parameters.

    Ways to break it:
        * ``out_features`` must divide by the group size (``ValueError`` says so).
        * The output is the rank's shard; feed it to a :class:`RowParallelLinear`.
    """

    def __init__(self, in_features: int, out_features: int, *, dispatcher: AllReduceDispatcher,
                 bias: bool = True, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        world, self.rank = _shard_info(dispatcher, out_features, "out_features", "ColumnParallelLinear")
        self.dispatcher = dispatcher
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features // world, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features // world, device=device, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    @torch.no_grad()
    def load_dense(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "ColumnParallelLinear":
        """Copy this rank's shard of a full ``[out, in]`` weight (and ``[out]`` bias)."""
        rows = self.weight.shape[0]
        self.weight.copy_(weight[self.rank * rows:(self.rank + 1) * rows])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias[self.rank * rows:(self.rank + 1) * rows])
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            x = _CopyToRegion.apply(x, self.dispatcher)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum over ranks of x_local @ W[:, rank-th block].T``, plus a replicated bias.

    Args:
        in_features: input features of the whole layer; each rank takes ``in/world``.
        out_features: output features (full on every rank after the all-reduce).
        dispatcher: the all-reduce of the partial outputs.
        bias: add a bias after the reduction.
        device, dtype: of the parameters.

    Ways to break it:
        * The input must be the rank's shard (e.g. a :class:`ColumnParallelLinear` output).
        * Every rank must call forward with the same shapes (the all-reduce is collective).
    """

    def __init__(self, in_features: int, out_features: int, *, dispatcher: AllReduceDispatcher,
                 bias: bool = True, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        world, self.rank = _shard_info(dispatcher, in_features, "in_features", "RowParallelLinear")
        self.dispatcher = dispatcher
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features // world, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    @torch.no_grad()
    def load_dense(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "RowParallelLinear":
        """Copy this rank's shard of a full ``[out, in]`` weight (and the full bias)."""
        cols = self.weight.shape[1]
        self.weight.copy_(weight[:, self.rank * cols:(self.rank + 1) * cols])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        out = _ReduceFromRegion.apply(partial.contiguous(), self.dispatcher)
        return out + self.bias if self.bias is not None else out
