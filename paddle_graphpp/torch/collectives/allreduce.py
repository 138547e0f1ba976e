"""PyTorch custom all-reduce over peer memory, behind the capture-aware dispatcher
(:mod:`paddle_graphpp.core.collectives`).

:func:`create_allreduce` (collective: every rank of the group, eagerly) returns the dispatcher. By
message size a call takes our push kernel (:mod:`.push_allreduce`; PyTorch's stock one-shot kernel
without Triton), PyTorch's stock two-shot kernel, or NCCL, at the switches :data:`MEASURED` holds
per group size (:func:`policy_for_world`; a group size without a measurement uses NCCL). Without
CUDA, peer access, NCCL or the symmetric-memory ops, every call falls back to
``torch.distributed.all_reduce``, which NCCL can capture. NVLink multicast must stay off
(``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``). The measurements, the buffers
and the rules: docs/collectives.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from types import MappingProxyType
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...core.collectives import (AllReduceBackend, AllReduceDispatcher, CustomAllReducePolicy,
                                TensorFacts, check_replay)
from ...core.watchdog import parse_timeout
from ..runtime import active_runtime
from .watch import group_timeout

__all__ = ["TorchSymmMemBackend", "create_allreduce", "replay", "peer_access_report", "MEASURED",
           "MeasuredChoice", "policy_for_world", "allreduce_timeout"]


@dataclasses.dataclass(frozen=True)
class MeasuredChoice:
    """The kernel switch for one group size, as measured (bf16, messages in graphs)."""

    custom_max_bytes: int
    """Largest message a custom kernel takes; larger ones go to NCCL."""
    two_shot_min_bytes: int
    """From this size up the stock two-shot kernel (above ``custom_max_bytes``: never)."""


MEASURED = MappingProxyType({
    # 2 ranks: the push kernel beats NCCL and the stock two-shot kernel at every size up to 8 MiB.
    2: MeasuredChoice(custom_max_bytes=8 << 20, two_shot_min_bytes=16 << 20),
    # 4 ranks: push beats NCCL up to 512 KiB, the stock two-shot kernel at 1 MiB; above that NCCL
    # (not measured against the custom kernels).
    4: MeasuredChoice(custom_max_bytes=1 << 20, two_shot_min_bytes=1 << 20),
})
"""Group size -> where the custom kernels beat NCCL; docs/collectives.md names the runs and how to
measure new hardware."""


def policy_for_world(world_size: int) -> CustomAllReducePolicy:
    """The dispatcher's policy for a group of ``world_size`` ranks, from :data:`MEASURED`.

    A size without a measurement gets a policy that admits no custom call (every all-reduce
    goes to NCCL, and ``why_not_custom`` says the size was not measured)."""
    choice = MEASURED.get(world_size)
    if choice is None:
        return CustomAllReducePolicy(world_sizes=frozenset(MEASURED))
    return CustomAllReducePolicy(max_bytes=choice.custom_max_bytes, two_shot_min_bytes=choice.two_shot_min_bytes,
                                 world_sizes=frozenset(MEASURED))


def peer_access_report() -> dict:
    """``{"devices": n, "pairs": {"0->1": bool, ...}}`` for the visible CUDA devices."""
    if not torch.cuda.is_available():
        return {"devices": 0, "pairs": {}}
    n = torch.cuda.device_count()
    pairs = {f"{i}->{j}": bool(torch.cuda.can_device_access_peer(i, j))
             for i in range(n) for j in range(n) if i != j}
    return {"devices": n, "pairs": pairs}


def _local_reason(group: Any, device: Optional[torch.device]) -> Optional[str]:
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if dist.get_backend(group) != "nccl":
        return f"process group backend is {dist.get_backend(group)!r}, not 'nccl'"
    if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_out"
    if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
        return ("TORCH_SYMM_MEM_DISABLE_MULTICAST is not '1'; set it (and NCCL_NVLS_ENABLE=0) "
                "before creating the all-reduce")
    report = peer_access_report()
    if report["devices"] >= 2 and not all(report["pairs"].values()):
        return f"GPUs lack peer access: {report['pairs']}"
    return None


class TorchSymmMemBackend(AllReduceBackend):
    """Custom all-reduce kernels of one process group over ``torch.distributed._symmetric_memory``.

    Creating it is collective: every rank of ``group`` must construct it, outside any capture.
    All ranks agree on whether the custom kernel is usable (any rank's failure makes every
    rank fall back), so paths never diverge.

    Args:
        group: the process group (default: the world group).
        max_bytes: the largest custom message (the staging region is sized for it).
        arena_bytes: bytes for regions registered by captured graphs. A registered call of
            ``n`` bytes takes ``2 x world x n`` bytes (the push kernel's double-buffered
            receive slots): see :meth:`buffer_bytes`.
        two_shot_min_bytes: messages this large or larger use the two-shot kernel.
        timeout: seconds the push kernel waits for a peer before it gives up and every later
            call (and the next graphed call) raises
            :class:`~paddle_graphpp.core.errors.CollectiveTimeoutError` naming that peer.
            Default (``None``): ``FLAGS_graphpp_allreduce_timeout``, else half the group's
            timeout, so that it gives up before the replay watchdog (the group's timeout) stops
            the process without knowing which peer was missing. ``0``: wait for ever. The stock
            kernels (one-shot without Triton, two-shot) have no timeout of their own: the replay
            watchdog bounds their waits.

    ``force_kernel`` (attribute, default ``None``) pins the kernel for benchmarks:
    ``"push"``, ``"one_shot"`` (stock) or ``"two_shot"`` (stock).

    Ways to break it:
        * Creating it inside a graph capture fails (allocation and rendezvous are collective
          host work).
        * Setting ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` after it was created has no effect.
    """

    name = "torch symm_mem"

    def __init__(self, group: Any = None, *, max_bytes: int = 8 << 20, arena_bytes: int = 64 << 20,
                 two_shot_min_bytes: int = 4 << 20, timeout: Optional[float] = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TorchSymmMemBackend: call torch.distributed.init_process_group() first")
        self.group = group if group is not None else dist.group.WORLD
        self.timeout = allreduce_timeout(self.group, timeout)
        self._fault: Optional[str] = None
        self._world = dist.get_world_size(self.group)
        self._max_bytes = max_bytes
        self._arena_bytes = arena_bytes
        self.two_shot_min_bytes = two_shot_min_bytes
        self._buf: Optional[torch.Tensor] = None
        self._push = None
        self.push_unavailable_reason: Optional[str] = None
        self.force_kernel: Optional[str] = None
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        reason = _local_reason(self.group, self.device)
        if reason is None:
            try:
                self._allocate()
            except Exception as exc:  # noqa: BLE001 - any failure means: fall back on every rank
                reason = f"symmetric memory setup failed: {type(exc).__name__}: {exc}"
                self._buf = None
        reasons = self.exchange(reason)
        bad = [(r, why) for r, why in enumerate(reasons) if why is not None]
        self._reason = None if not bad else "; ".join(f"rank {r}: {why}" for r, why in bad)
        if self._reason is not None:
            self._buf = None

    def _push_reason(self) -> Optional[str]:
        if self._world > 8:
            return f"world size {self._world} > 8"
        from . import push_allreduce as _push_allreduce

        return None if _push_allreduce.triton is not None else "Triton is not importable"

    def _staging_bytes(self) -> int:
        small = min(self._max_bytes, self.two_shot_min_bytes)
        return max(self._max_bytes, self.buffer_bytes(small))

    def _allocate(self) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = self.group.group_name
        self.push_unavailable_reason = self._push_reason()
        from .push_allreduce import flags_bytes

        self._data_offset = flags_bytes(max(2, self._world))
        self._staging = self._staging_bytes()
        total = self._data_offset + self._staging + self._arena_bytes
        self._buf = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
        handle = symm_mem.rendezvous(self._buf, self.group_name)
        if self.push_unavailable_reason is None:
            from .push_allreduce import PushAllReduce

            self._push = PushAllReduce(handle, self._buf, dist.get_rank(self.group), self._world,
                                       timeout=self.timeout)
            torch.cuda.synchronize(self.device)   # flags zeroed before the exchange that follows
        ops = torch.ops.symm_mem
        self._has_fused_copy = hasattr(ops, "one_shot_all_reduce_copy_out")
        self._has_two_shot = hasattr(ops, "two_shot_all_reduce_out")

    # ----------------------------------------------------------- AllReduceBackend
    @property
    def world_size(self) -> int:
        return self._world

    def custom_unavailable_reason(self) -> Optional[str]:
        if self._buf is None and self._reason is None:
            return "closed"
        return self._reason

    def fault(self) -> Optional[str]:
        push = self._push  # read once: close() may run in the main thread meanwhile
        if self._fault is None and push is not None:
            peer = push.peer_waited_for()
            if peer is not None:
                self._fault = _gave_up_text(self.group, self._world, peer, push.timeout)
        return self._fault

    def facts(self, tensor: torch.Tensor) -> TensorFacts:
        mod = tensor.data_ptr() % 16 if tensor.is_cuda else -1
        return TensorFacts(nbytes=tensor.numel() * tensor.element_size(),
                           dtype=str(tensor.dtype).removeprefix("torch."),
                           contiguous=tensor.is_contiguous(), address_mod16=mod)

    def is_capturing(self) -> bool:
        return active_runtime().is_capturing()

    def empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(tensor)

    def fallback(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def reduce_staged(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._reduce(tensor, 0)

    def reduce_registered(self, tensor: torch.Tensor, offset: int) -> torch.Tensor:
        return self._reduce(tensor, self._staging + offset)

    def arena_bytes(self) -> int:
        return self._arena_bytes

    def buffer_bytes(self, nbytes: int) -> int:
        if self.push_unavailable_reason is None:
            from .push_allreduce import region_bytes

            return max(nbytes, region_bytes(nbytes, self._world))
        return nbytes

    def exchange(self, obj: Any) -> list:
        out: list = [None] * self._world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def close(self) -> None:
        self._buf = None
        self._push = None

    # ------------------------------------------------------------------ kernels
    def symmetric_view(self, start: int, like: torch.Tensor) -> torch.Tensor:
        """The symmetric buffer at byte ``start`` viewed with ``like``'s dtype and shape."""
        nbytes = like.numel() * like.element_size()
        return self._buf[start:start + nbytes].view(like.dtype).view(like.shape)

    def kernel_for(self, nbytes: int) -> str:
        """``"push"``, ``"one_shot"`` or ``"two_shot"``: the kernel a message of ``nbytes`` uses."""
        if self.force_kernel is not None:
            return self.force_kernel
        if nbytes >= self.two_shot_min_bytes and self._has_two_shot:
            return "two_shot"
        return "push" if self._push is not None else "one_shot"

    def _reduce(self, tensor: torch.Tensor, byte_offset: int) -> torch.Tensor:
        kernel = self.kernel_for(tensor.numel() * tensor.element_size())
        start = self._data_offset + byte_offset    # data offsets count past the push kernel's flags
        if kernel == "push":
            return self._push(tensor, start)       # the policy admits contiguous tensors only
        symm = self.symmetric_view(start, tensor)
        out = torch.empty_like(tensor)
        ops = torch.ops.symm_mem
        if kernel == "two_shot":
            symm.copy_(tensor)
            ops.two_shot_all_reduce_out(symm, "sum", self.group_name, out)
        elif self._has_fused_copy:
            ops.one_shot_all_reduce_copy_out(symm, tensor, "sum", self.group_name, out)
        else:
            symm.copy_(tensor)
            ops.one_shot_all_reduce_out(symm, "sum", self.group_name, out)
        return out


def allreduce_timeout(group: Any, timeout: Optional[float]) -> Optional[float]:
    """The push kernel's timeout in seconds (``None``: it waits for ever) from the argument, or by
    default from ``FLAGS_graphpp_allreduce_timeout``, else half the shorter of ``group``'s
    timeout and the default group's (which the replay watchdog uses): the kernel gives up, naming
    the peer, before the watchdog stops the process without knowing which peer was missing.

    Raises:
        ValueError: a negative or non-numeric argument or flag.
    """
    what = ("the all-reduce timeout", "for no timeout")
    if timeout is not None:
        value = parse_timeout(timeout, "create_allreduce(timeout)", *what)
    elif (flag := os.environ.get("FLAGS_graphpp_allreduce_timeout")) is not None:
        value = parse_timeout(flag, "FLAGS_graphpp_allreduce_timeout", *what)
    else:
        value = min(group_timeout(group), group_timeout(dist.distributed_c10d._get_default_group())) / 2
    return None if value is None or math.isinf(value) else value


def _gave_up_text(group: Any, world: int, peer: int, timeout: Optional[float]) -> str:
    me = dist.get_rank()
    with contextlib.suppress(Exception):
        peer = dist.get_global_rank(group, peer)
    return (f"paddle_graphpp: the custom all-reduce of a {world}-rank group on rank {me} waited {timeout:g} s "
            f"for rank {peer} and gave up: that rank died, stalled, or called the all-reduces in another "
            f"order. The step's results are not valid and the group's custom all-reduce cannot be used "
            f"again. Look in rank {peer}'s log for the first error and restart the job from its last "
            f"checkpoint; if that rank is only slow, raise the timeout (create_allreduce(timeout=...) or "
            f"FLAGS_graphpp_allreduce_timeout, seconds; 0 waits for ever).")


def create_allreduce(group: Any = None, *, policy: Optional[CustomAllReducePolicy] = None,
                     arena_bytes: int = 64 << 20, timeout: Optional[float] = None) -> AllReduceDispatcher:
    """A capture-aware all-reduce for ``group`` (collective: call it on every rank, eagerly).

    Args:
        group: the process group (default: world).
        policy: which tensors use the custom kernel (size, dtype, alignment, world size);
            default: :func:`policy_for_world` of the group's size.
        arena_bytes: room for buffers registered by graphs captured in
            ``capture_custom_allreduce()``; when full, further captured calls use NCCL.
        timeout: seconds the custom kernel waits for a peer before it gives up, naming it
            (default: ``FLAGS_graphpp_allreduce_timeout``, else half the group's timeout; 0: no
            timeout). See :class:`TorchSymmMemBackend`.

    Returns:
        an :class:`~paddle_graphpp.core.collectives.AllReduceDispatcher`; call its
        ``all_reduce(tensor)`` and use the returned tensor.
    """
    policy = policy or policy_for_world(dist.get_world_size(group if group is not None else dist.group.WORLD))
    backend = TorchSymmMemBackend(group, max_bytes=policy.max_bytes, arena_bytes=arena_bytes,
                                  two_shot_min_bytes=policy.two_shot_min_bytes, timeout=timeout)
    return AllReduceDispatcher(backend, policy)


def replay(graph: "torch.cuda.CUDAGraph") -> None:
    """Replay ``graph`` after checking that its registered all-reduce buffers still exist.

    Raises:
        ReleasedBufferError: the buffers were released (communicator closed,
            ``release_graph_buffers``); nothing was launched.
    """
    check_replay(graph)
    graph.replay()
