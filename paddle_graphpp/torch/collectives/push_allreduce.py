"""Our one-shot all-reduce for small messages (Triton): each rank pushes its input into a receive
slot in every peer's memory, raises one flag per peer, waits for its peers' flags and sums locally.

:class:`PushAllReduce` launches it over one rendezvoused symmetric buffer (its layout:
:func:`flags_bytes`, :func:`region_bytes`). Every rank must issue the same calls in the same order
on one stream per communicator; every rank gets bit-identical sums, in graphs and eagerly alike. A
call that waited ``timeout`` for a peer gives up with a meaningless output and marks that peer,
which :meth:`PushAllReduce.peer_waited_for` reads without a device call: the step is then invalid
on every rank, and the kernel must not be called again. Launching needs Triton; the layout helpers
import without it. The protocol (slots, epochs, the give-up): docs/collectives.md.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: layout helpers only
    triton = None

__all__ = ["PushAllReduce", "MAX_WORLD", "MAX_BLOCKS", "region_bytes", "flags_bytes"]

MAX_WORLD = 8
MAX_BLOCKS = 128
EPOCH_MASK = (1 << 30) - 1   # epochs count modulo 2**30: no signed overflow, parity keeps alternating
SUB = 2048          # elements per block per inner step
NUM_WARPS = 4
STATUS_AFTER_NS = 100_000  # how often a long wait looks at whether a call gave up


def flags_bytes(world: int) -> int:
    """Bytes of the flag area at the start of the buffer, rounded up to 4 KiB."""
    return -(-(world * MAX_BLOCKS * 4) // 4096) * 4096


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def region_bytes(nbytes: int, world: int) -> int:
    """Bytes of the receive region for one ``nbytes`` message."""
    return 2 * world * nbytes


if triton is not None:
    @triton.jit
    def _pick(r: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
        p = p0
        if r == 1:
            p = p1
        if r == 2:
            p = p2
        if r == 3:
            p = p3
        if r == 4:
            p = p4
        if r == 5:
            p = p5
        if r == 6:
            p = p6
        if r == 7:
            p = p7
        return p


    @triton.jit
    def _block_now_ns(THREADS: tl.constexpr):
        # The device's global timer (ns), one value for the block: every thread reads it and the
        # block takes the largest (through shared memory), so that a loop whose exit depends on
        # it ends in the same iteration for every warp.
        ticks = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.arange(0, THREADS)],
                                          dtype=tl.int64, is_pure=False, pack=1)
        return tl.max(ticks, axis=0)


    @triton.jit
    def _wait_for(flag, epoch, ahead, begin, limit, gave_up, status, PEER: tl.constexpr,
                  STATUS_AFTER_NS: tl.constexpr, THREADS: tl.constexpr):
        # Wait until `flag` (PEER's) reads `epoch` or `ahead`, the device word says a call gave
        # up, or `limit` ns (0: no limit) passed since `begin` (0: from now); returns `begin`.
        seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        if (seen != epoch) & (seen != ahead):
            now = _block_now_ns(THREADS)
            if begin == 0:
                begin = now
            look = now + STATUS_AFTER_NS
            stop = tl.zeros([], dtype=tl.int32)  # the device word: a call gave up
            while (seen != epoch) & (seen != ahead) & (stop == 0) & ((limit == 0) | (now - begin < limit)):
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                now = _block_now_ns(THREADS)
                if (limit != 0) & (now >= look):
                    stop = tl.atomic_add(gave_up, 0, sem="relaxed", scope="gpu")
                    look = now + STATUS_AFTER_NS
            if (seen != epoch) & (seen != ahead) & (stop == 0):
                tl.atomic_cas(gave_up, 0, PEER + 1, sem="relaxed", scope="gpu")
                tl.store(status, PEER + 1)  # for the host (pinned memory)
        return begin


    @triton.jit(do_not_specialize=["timeout_ms"])
    def _push_all_reduce(inp, out, counters,
                         r0, r1, r2, r3, r4, r5, r6, r7,
                         f0, f1, f2, f3, f4, f5, f6, f7,
                         n, chunk, gave_up, status, timeout_ms,
                         RANK: tl.constexpr, WORLD: tl.constexpr, NBLK: tl.constexpr, SUB: tl.constexpr,
                         MASK: tl.constexpr, STATUS_AFTER_NS: tl.constexpr, THREADS: tl.constexpr):
        pid = tl.program_id(0)
        epoch = (tl.load(counters + pid) + 1) & MASK
        ahead = (epoch + 1) & MASK
        slot = (epoch & 1).to(tl.int64)
        start = pid * chunk
        stop = tl.minimum(start + chunk, n)
        n64 = n.to(tl.int64)
        # 1. push this block's part of the input into slot [parity][RANK] of every peer
        for r in tl.static_range(WORLD):
            if r != RANK:
                dst = _pick(r, r0, r1, r2, r3, r4, r5, r6, r7) + (slot * WORLD + RANK) * n64
                for i in range(start, stop, SUB):
                    offs = i + tl.arange(0, SUB)
                    m = offs < stop
                    tl.store(dst + offs, tl.load(inp + offs, mask=m), mask=m)
        tl.debug_barrier()
        # 2. one flag per peer: "block pid's data of epoch `epoch` has landed in your slot"
        for r in tl.static_range(WORLD):
            if r != RANK:
                flag = _pick(r, f0, f1, f2, f3, f4, f5, f6, f7) + RANK * NBLK + pid
                tl.atomic_xchg(flag, epoch, sem="release", scope="sys")
        # 3. wait for every peer's flag. A peer can be at most one call ahead (it cannot pass
        #    its next wait before this rank's next call), so the flag reads `epoch` or `ahead`;
        #    comparing for equality stays right when the epoch wraps. The flag and the device
        #    word are read by one thread and shared with the block (Triton's scalar atomics), the
        #    timer through _block_now_ns: every exit condition is the same in every warp. The
        #    timer is read only once a flag was not there at the first look; timeout_ms 0: wait
        #    for ever (and never look at the device word: nothing sets it).
        mine = _pick(RANK, f0, f1, f2, f3, f4, f5, f6, f7)
        limit = timeout_ms.to(tl.int64) * 1000000
        begin = tl.zeros([], dtype=tl.int64)  # when this call first found a flag missing (0: not yet)
        for r in tl.static_range(WORLD):
            if r != RANK:
                begin = _wait_for(mine + r * NBLK + pid, epoch, ahead, begin, limit, gave_up, status, r,
                                  STATUS_AFTER_NS, THREADS)
        tl.debug_barrier()
        # 4. sum in rank order (identical on every rank) and write the result
        recv = _pick(RANK, r0, r1, r2, r3, r4, r5, r6, r7)
        for i in range(start, stop, SUB):
            offs = i + tl.arange(0, SUB)
            m = offs < stop
            acc = tl.zeros([SUB], dtype=tl.float32)
            for r in tl.static_range(WORLD):
                if r == RANK:
                    v = tl.load(inp + offs, mask=m)
                else:
                    v = tl.load(recv + (slot * WORLD + r) * n64 + offs, mask=m, volatile=True)
                acc += v.to(tl.float32)
            tl.store(out + offs, acc.to(out.dtype.element_ty), mask=m)
        tl.store(counters + pid, epoch)


class PushAllReduce:
    """Launches :func:`_push_all_reduce` over one rendezvoused symmetric ``uint8`` buffer.

    Args:
        handle: the symmetric-memory handle of ``buf`` (from ``rendezvous``).
        buf: the local symmetric buffer; its first :func:`flags_bytes` bytes hold the flags.
        rank, world: this rank and the group size (``world <= MAX_WORLD``).
        timeout: seconds a call waits for a peer before it gives up (docs/collectives.md;
            counted in whole milliseconds, at least one); ``None``, 0 or infinity: it waits for
            ever.

    The caller zeroes nothing: construction zeroes the local flags and counters; the caller
    must then pass a barrier with all ranks before the first call.
    """

    def __init__(self, handle, buf: torch.Tensor, rank: int, world: int, *, timeout: Optional[float] = None) -> None:
        if triton is None:
            raise RuntimeError("PushAllReduce needs Triton (pip install triton, or a CUDA build of PyTorch)")
        if not 2 <= world <= MAX_WORLD:
            raise ValueError(f"PushAllReduce: world size {world} not in 2..{MAX_WORLD}")
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"PushAllReduce: timeout must be >= 0 seconds (0: no timeout), got {timeout!r}")
        self.rank, self.world = rank, world
        # whole milliseconds as a 32-bit argument (up to 24 days): one compiled kernel whatever the
        # timeout; self.timeout is the one in force
        ms = 0 if not timeout or math.isinf(timeout) else min(max(1, round(timeout * 1e3)), 2**31 - 1)
        self._timeout_ms, self.timeout = ms, (ms / 1e3 if ms else None)
        # 1 + the rank a call gave up on: in device memory for the kernels, in pinned host memory
        # for the host (read without a device call)
        self.gave_up = torch.zeros(1, dtype=torch.int32, device=buf.device)
        self.status = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._status = self.status.numpy()
        self.total = buf.numel()
        self.flags_end = flags_bytes(world)
        self.peers = [handle.get_buffer(r, (self.total,), torch.uint8, 0) for r in range(world)]
        flags = [p[:self.flags_end].view(torch.int32) for p in self.peers]
        self._flag_args = flags + [flags[0]] * (MAX_WORLD - world)   # the kernel takes MAX_WORLD
        self.counters = torch.zeros(MAX_BLOCKS, dtype=torch.int32, device=buf.device)
        buf[:self.flags_end].zero_()
        self._views: dict = {}

    def _region_args(self, start: int, tensor: torch.Tensor) -> list:
        key = (start, tensor.dtype, tensor.numel())
        views = self._views.get(key)
        if views is None:
            nbytes = region_bytes(tensor.numel() * tensor.element_size(), self.world)
            if start < self.flags_end or start + nbytes > self.total:
                raise ValueError(f"PushAllReduce: region [{start}, {start + nbytes}) is outside "
                                 f"[{self.flags_end}, {self.total}) of the buffer")
            views = [p[start:start + nbytes].view(tensor.dtype) for p in self.peers]
            views += [views[0]] * (MAX_WORLD - self.world)
            self._views[key] = views
        return views

    def peer_waited_for(self) -> Optional[int]:
        """The rank a call gave up waiting for, or ``None`` (where blocks gave up on different
        peers, one of them). Reads host memory only: cheap, from any thread, without waiting for
        the device."""
        value = int(self._status[0])
        return value - 1 if value else None

    def __call__(self, tensor: torch.Tensor, start: int) -> torch.Tensor:
        """Sum ``tensor`` over the group through the region at byte ``start`` of the buffer
        (past the flags); returns a new tensor."""
        n = tensor.numel()
        out = torch.empty_like(tensor)
        regions = self._region_args(start, tensor)
        blocks = min(MAX_BLOCKS, _cdiv(n, SUB))
        chunk = _cdiv(_cdiv(n, blocks), SUB) * SUB     # whole inner steps per block
        blocks = _cdiv(n, chunk)
        _push_all_reduce[(blocks,)](tensor, out, self.counters, *regions, *self._flag_args, n, chunk,
                                    self.gave_up, self.status, self._timeout_ms,
                                    RANK=self.rank, WORLD=self.world, NBLK=MAX_BLOCKS, SUB=SUB, MASK=EPOCH_MASK,
                                    STATUS_AFTER_NS=STATUS_AFTER_NS, THREADS=32 * NUM_WARPS,
                                    num_warps=NUM_WARPS)
        return out
