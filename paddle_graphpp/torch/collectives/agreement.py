"""Ranks agree on whether their CUDA graph captures succeeded (PyTorch, ``torch.distributed``).

In pipeline and tensor parallel training every rank captures its graphs in the same step. If one
rank's capture raises and that rank stops, its peers go on into the next send, receive or
all-reduce and wait for it until the collective's timeout. :func:`agree_on_captures` makes
every batch of captures in this process end with a small all-reduce over a CPU (gloo) group,
so that when any rank's captures raise, every rank raises a ``CaptureError`` at the same point;
a peer that never reaches the agreement makes the others raise after ``timeout`` seconds
instead of hanging. With ``fallback="eager"`` a failed capture does not raise (the layer goes
on eagerly), and the ranks keep training.

:class:`StoreTally` is the same idea for a few numbers each rank brings, round after round, through
the default group's store (the capacity mode's drop counts, :mod:`paddle_graphpp.torch.moe`).
"""

from __future__ import annotations

import datetime
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from ...core.errors import CaptureError
from ...core.capture import capture_for
from ..runtime import active_runtime

__all__ = ["agree_on_captures", "StoreTally"]


class _Agreement:
    """The all-reduce run at the end of each batch of captures (see ``core.capture.EpisodeCapture.agreement``)."""

    def __init__(self, group, ranks: list, timeout: float):
        self.group = group
        self.ranks = ranks
        self.timeout = timeout
        self.index = ranks.index(dist.get_rank())

    def __call__(self, failed: bool) -> list:
        flags = torch.zeros(len(self.ranks), dtype=torch.int32)
        flags[self.index] = int(failed)
        try:
            work = dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            work.wait(datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise CaptureError(
                f"rank {self.ranks[self.index]}: the capture agreement with ranks {self.ranks} did not complete "
                f"within {self.timeout:g} s: a peer did not reach its capture step (it stopped, or captures in "
                f"another step). Graphs of this rank may be captured; it raises rather than wait in a "
                f"collective its peers may never join.") from exc
        return [rank for rank, flag in zip(self.ranks, flags.tolist()) if flag]


def agree_on_captures(group: Optional[dist.ProcessGroup] = None, *, timeout: float = 60.0) -> None:
    """Make every rank of ``group`` raise when any rank's CUDA graph captures raise.

    Call it once on every rank of the default group, after ``init_process_group`` and before
    the first capture: it creates a gloo group over ``group``'s ranks (``dist.new_group``, a
    collective call of all ranks). From then on each batch of captures (the start of the step
    after a recorded one) ends with an all-reduce of a flag over that group.

    Args:
        group: the ranks that must take the same path (a pipeline's stages, a tensor-parallel
            group); ``None``: all ranks.
        timeout: seconds a rank waits for its peers at the agreement before it raises.

    Warnings:
        * Every rank of the group must capture in the same steps (the usual case: the same
          warmup on every stage and the same input shapes). A rank that captures a step later
          makes its peers raise after ``timeout``.
        * The stream-ordered allocator captures each position in its own step, outside these
          batches: no agreement is made there.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("agree_on_captures: torch.distributed is not initialised; call "
                           "dist.init_process_group(...) first.")
    if not timeout > 0:
        raise ValueError(f"agree_on_captures: timeout must be > 0 seconds, got {timeout!r}")
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    gloo = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    capture_for(active_runtime()).agreement = _Agreement(gloo, ranks, timeout) if dist.get_rank() in ranks else None


class StoreTally:
    """The ranks of a group tell each other a few numbers per round, through the default process
    group's store: each rank sets its own key of the round and waits for its peers' keys, up to
    ``timeout`` seconds. No collective of any backend is involved (so it runs beside NCCL or
    gloo groups alike, and a peer that never comes makes the others raise rather than hang).
    Every rank of the group must take the same rounds; a round's keys are deleted by their
    owners one round later, when every peer has read them. Each rank reads every peer's key
    from the store's host: meant for a few numbers per training step, not for many ranks at a
    high rate."""

    def __init__(self, ranks: list, timeout: float, what: str):
        self.ranks, self.timeout, self.what = list(ranks), timeout, what
        self.rank = dist.get_rank()
        self.prefix = f"paddle_graphpp/tally/{zlib.crc32(','.join(map(str, self.ranks)).encode()):08x}"
        self.round = 0

    def _key(self, rank: int, round_: int) -> str:
        return f"{self.prefix}/{round_}/{rank}"

    def __call__(self, values: tuple) -> dict:
        """``{rank: its numbers}`` of this round (tuples of ints), for every rank of the group."""
        store = dist.distributed_c10d._get_default_store()
        round_, self.round = self.round, self.round + 1
        keys = [self._key(rank, round_) for rank in self.ranks]
        store.set(self._key(self.rank, round_), ",".join(str(int(v)) for v in values))
        try:
            store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            missing = [rank for rank, key in zip(self.ranks, keys) if not _has(store, key)]
            raise RuntimeError(
                f"rank {self.rank}: {self.what}: rank(s) {missing} of {self.ranks} did not come within "
                f"{self.timeout:g} s (they stopped, or take a different number of such steps). This rank "
                f"raises rather than wait for them.") from exc
        told = store.multi_get(keys)
        if round_:
            try:
                store.delete_key(self._key(self.rank, round_ - 1))  # every peer has read it: they are here
            except RuntimeError:
                pass  # a store without deletion keeps it
        return {rank: tuple(int(v) for v in bytes(t).decode().split(",")) for rank, t in zip(self.ranks, told)}


def _has(store, key: str) -> bool:
    try:
        return store.check([key])
    except RuntimeError:
        return False
