"""Optimizer steps borrow the graph pool's free memory between episodes (PyTorch).

:class:`PoolLender` gives a new pool, before its first capture, free memory as large as the
temporaries a step of the optimizers seen stepping makes (:func:`watch_optimizers`,
:func:`step_temporaries`; laid out as :data:`BLOCK` or :data:`SEGMENTS`), and lends the pool to an optimizer step run between episodes when that costs
less memory than not (decided once per pool and optimizer); a borrowed step runs on the capture
stream. A borrowed step that leaves memory allocated in the pool (state created lazily, a tensor
kept) would be overwritten by the next replays: the pool's graphs are then dropped, to be recorded
and captured anew into a new pool, and lending stops for the process, with a warning. The model
behind the decision and its measurements: docs/memory.md.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import logging
import weakref
from typing import Any, Callable, Iterable, Optional

import torch

from ...core.process import current_process
from ...core.warn import warn
from . import pool_segments
from ..graphs import gc_paused

__all__ = ["BLOCK", "SEGMENTS", "PoolLender", "watch_optimizers", "register_optimizer", "optimizer_pending",
           "step_temporaries"]

logger = logging.getLogger("paddle_graphpp")

_SMALL = 1 << 20  # the caching allocator serves requests up to 1 MiB from its small blocks
_ROUND = 512  # ... and rounds every request up to a multiple of this
_SMALL_SEGMENT = 2 << 20  # the size of each segment of small blocks
SEGMENTS, BLOCK = "segments", "block"  # layouts of the memory reserved before a pool's captures

class OptimizerWatch:
    """The optimizers pool lending knows of (a part of the process's torch section)."""

    def __init__(self) -> None:
        self.stepped: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # seen stepping
        self.registered: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # register_optimizer
        self.any_stepped = False  # an optimizer has stepped in this process
        self.hook: Any = None  # the handle of the step hook (watch_optimizers)


def _watch() -> OptimizerWatch:
    return current_process().section("torch").part(OptimizerWatch)


def watch_optimizers() -> None:
    """From now on, remember every optimizer that steps (a weak reference; once per process)."""
    watch = _watch()
    if watch.hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        watch.hook = register_optimizer_step_post_hook(_stepped)


def register_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer`` will step the graphed layers' parameters: captures wait for a first
    optimizer step while it is alive (:func:`optimizer_pending`). Called where graphing meets an
    optimizer (``GraphedOptimizer``)."""
    _watch().registered.add(optimizer)


def _stepped(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    watch = _watch()
    watch.stepped.add(optimizer)
    watch.any_stepped = True


def optimizer_pending() -> Optional[str]:
    """Why captures should wait for a first optimizer step (``None``: they need not). Before its
    first step an optimizer has no state; that step creates the state and its temporaries side
    by side and cannot borrow a graph pool (the state must not live there), so a pool captured
    before it costs that memory on top.

    They wait until an optimizer of this process has stepped, while one registered with
    :func:`register_optimizer` is alive or once any ``torch.optim.Optimizer`` has been
    constructed (:func:`_optimizer_constructed`)."""
    watch = _watch()
    if watch.any_stepped:
        return None
    if len(watch.registered) or _optimizer_constructed():
        return "an optimizer has not stepped yet"
    return None


def _optimizer_constructed() -> bool:
    """Whether a ``torch.optim.Optimizer`` has been constructed in this process. torch has no
    hook at an optimizer's creation; its constructor wraps the class's ``step`` for the profiler
    once per class and marks it ``hooked`` (``Optimizer._patch_step_function``, private; checked
    on torch 2.11 and 2.13), which this reads over the subclasses rather than searching the process's
    objects."""
    todo = [torch.optim.Optimizer]
    while todo:
        cls = todo.pop()
        if getattr(cls.__dict__.get("step"), "hooked", False):
            return True
        todo.extend(cls.__subclasses__())
    return False


def stepped_param_sizes() -> list:
    """Rounded byte sizes of the temporaries one step of the largest optimizer seen stepping
    makes (:func:`step_temporaries`; ``[]``: none stepped, or its steps make none)."""
    return max((step_temporaries(opt, lambda p: p.requires_grad) for opt in list(_watch().stepped)),
               key=sum, default=[])


def step_temporaries(optimizer: torch.optim.Optimizer, stepped: Callable[[torch.Tensor], bool]) -> list:
    """Rounded byte sizes of the parameter-sized temporaries one step of ``optimizer`` makes
    over the parameters that ``stepped`` picks, in its parameter order: a group of torch's
    multi-tensor implementation (``foreach``, torch's default on the GPU, and any optimizer that
    does not say) makes one per parameter, alive together; a single-tensor group
    (``foreach=False``) a few per parameter, one parameter at a time, so three of its largest
    (Adam's and AdamW's, measured with torch's profiler); a ``fused`` group none."""
    sizes: list = []
    for group in optimizer.param_groups:
        if group.get("fused"):
            continue
        mine = [_rounded(p) for p in group["params"] if stepped(p)]
        if group.get("foreach") is False and mine:
            mine = [max(mine)] * 3
        sizes += mine
    return sizes


class PoolLender:
    """Lends one graph pool at a time to optimizer steps (installed once per process)."""

    def __init__(self, capture_stream: Callable[[], Any], free_workspaces: Callable[[], None] = lambda: None):
        self._capture_stream = capture_stream
        self._free_workspaces = free_workspaces  # torch's cuBLAS workspaces, where captures free them
        self._pool: Optional[torch.cuda.MemPool] = None
        self._is_idle: Callable[[], bool] = lambda: False
        self._on_leak: Callable[[], None] = lambda: None
        self._handles: list = []
        self._active: Optional[tuple] = None  # (exit stack, stream, caller stream, bytes before)
        self._fresh = False  # the default cache has yet to be emptied for the pool lent last
        self.disabled = False
        self.steps = 0
        self.declined = 0  # steps that did not borrow: borrowing would have cost more memory
        self.reserved = 0  # bytes reserved in pools before their captures
        self._reserved_once = False  # reserve() ran for a pool (the first one)
        self._fits: dict = {}  # (id(pool), id(optimizer)) -> does borrowing cost less than not

    def reserve(self, pool: Any, layout: str = BLOCK) -> int:
        """Before the first capture into ``pool``: give it free memory (on the capture stream,
        where captures and borrowed steps allocate) for the temporaries of the largest
        optimizer seen stepping, so that activations and, between episodes, those temporaries
        share it. ``layout``: :data:`SEGMENTS` allocates one tensor per parameter, the
        parameter's size, all alive together, and frees them, so the pool holds the segments
        the caching allocator makes for one list of temporaries (one per parameter over 10 MiB,
        20 MiB segments shared by the smaller ones); :data:`BLOCK` one free block of all the
        parameters' bytes. Parameters of 1 MiB or less are left out: their temporaries come from
        the allocator's small blocks, which no large block serves. Once per process (the first
        pool, also when the device had room for part of it only); nothing when no optimizer has
        stepped (nothing will borrow). Returns the bytes allocated for it (the segments made
        round them up)."""
        if layout not in (SEGMENTS, BLOCK):
            raise ValueError(f"reserve: layout must be {SEGMENTS!r} or {BLOCK!r}, got {layout!r}")
        if self.disabled or self._reserved_once or not isinstance(pool, torch.cuda.MemPool):
            return 0  # once per process: a later generation's pool is lent, but holds only its own graphs
        sizes = [n for n in stepped_param_sizes() if n > _SMALL]  # small requests use small blocks
        if layout == BLOCK and sizes:
            sizes = [sum(sizes)]
        if not sizes:
            return 0
        blocks: list = []
        try:
            with (gc_paused(), pool_segments.pool_allocations(), torch.cuda.stream(self._capture_stream()),
                  torch.cuda.use_mem_pool(pool)):
                device = torch.cuda.current_device()
                for n in sizes:
                    blocks.append(torch.empty(n, dtype=torch.uint8, device=device))
        except torch.OutOfMemoryError:
            logger.info("paddle_graphpp: room for %d of the %d MiB to reserve in the graph pool; captured with that",
                        sum(b.numel() for b in blocks) >> 20, sum(sizes) >> 20)
        finally:
            got = sum(b.numel() for b in blocks)
            blocks.clear()  # freed into the pool's cache: the segments stay the pool's, free for the captures
        self.reserved += got
        self._reserved_once = True
        return got

    def report(self) -> dict:
        """What lending did in this process: optimizer steps run in a graph pool, steps that
        did not borrow (it would have cost more memory), MiB reserved in pools before their captures."""
        return {"optimizer_steps_in_pool": self.steps, "optimizer_steps_declined": self.declined,
                "pool_reserved_before_capture_mib": self.reserved / 2**20}

    def lend(self, pool: Any, is_idle: Callable[[], bool], on_leak: Callable[[], None]) -> None:
        """From now on, optimizer steps run while ``is_idle()`` borrow ``pool``."""
        if self.disabled or not isinstance(pool, torch.cuda.MemPool):
            return
        self._pool, self._is_idle, self._on_leak = pool, is_idle, on_leak
        self._fresh = True
        if not self._handles:
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            self._handles = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]
            # A step that raised and was never followed by another graphed call or step would
            # leave the allocator routed into the pool; the allocator refuses to shut down so.
            atexit.register(self.abandon_step)

    def _pre(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():
            return  # traced by torch.compile: the hooks' effects would not be balanced at run time
        self.abandon_step()  # a previous step that raised never reached _post
        pool = self._pool
        if _has_closure(args, kwargs):
            # step(closure) runs the closure (a forward and backward, as Lightning's last
            # micro-batch of a window) between these hooks: its eager work would land in pool
            # memory that the graphs it replays overwrite. The temporaries stay in the default cache.
            return
        if (pool is None or self.disabled or not self._is_idle()
                or torch.cuda.is_current_stream_capturing() or not _state_complete(optimizer)):
            return
        room = self._fits.get((id(pool), id(optimizer)))
        if room is None:
            room = self._fits[(id(pool), id(optimizer))] = _borrow_pays(
                *_growths(pool, step_temporaries(optimizer, lambda p: p.grad is not None)))
        if not room:
            self.declined += 1
            return
        if self._fresh:
            # Steps before this one kept their temporaries in the default cache; from now on
            # they come from the pool, so that cache would only add to the peak. (Once per
            # pool: here or after the first step that could not borrow.)
            self._fresh = False
            torch.cuda.empty_cache()
        stream, caller = self._capture_stream(), torch.cuda.current_stream()
        before = _allocated(pool)
        stream.wait_stream(caller)
        with contextlib.ExitStack() as stack:  # what was entered is left again if an entry raises
            stack.enter_context(gc_paused())
            stack.enter_context(pool_segments.pool_allocations())
            stack.enter_context(torch.cuda.stream(stream))
            stack.enter_context(torch.cuda.use_mem_pool(pool))
            self._active = (stack.pop_all(), stream, caller, before)

    def _post(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():
            return
        if self._active is None:
            if self._fresh and self._pool is not None:
                # A step that could not borrow (its optimizer state was being created): its
                # temporaries are cached by now; later ones come from the pool.
                self._fresh = False
                torch.cuda.empty_cache()
            return
        stack, stream, caller, before = self._active
        self._active = None
        stack.close()
        caller.wait_stream(stream)
        self.steps += 1
        after = _allocated(self._pool)
        if after != before:  # a matmul in the step may have made the capture stream's cuBLAS workspace there
            self._free_workspaces()
            after = _allocated(self._pool)
        if after != before:
            self.disabled = True
            self._pool = None
            warn(
                f"paddle_graphpp: an optimizer step ({type(optimizer).__name__}) run between episodes left "
                f"{after - before} bytes allocated in the graph pool; its graphs are captured anew and optimizer "
                f"steps no longer borrow graph memory in this process (memory above eager's by their "
                f"temporaries).")
            self._on_leak()

    def abandon_step(self) -> None:
        """A step raised between the hooks: leave the pool and the capture stream."""
        if self._active is not None:
            stack, stream, caller, _ = self._active
            self._active = None
            stack.close()
            caller.wait_stream(stream)


def _has_closure(args: tuple, kwargs: dict) -> bool:
    """Whether ``optimizer.step`` was called with a closure, positionally or by name (the step
    hooks get the step's arguments with the optimizer itself first)."""
    return (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None


def _state_complete(optimizer: torch.optim.Optimizer) -> bool:
    """Every parameter with a gradient has its state: the step creates nothing lasting."""
    state = optimizer.state
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and not state.get(p):
                return False
    return True


def _allocated(pool: torch.cuda.MemPool) -> int:
    return sum(seg["allocated_size"] for seg in pool.snapshot())


def _rounded(t: torch.Tensor) -> int:
    n = t.numel() * t.element_size()
    return -(-n // _ROUND) * _ROUND


def _free_blocks(pool: torch.cuda.MemPool, kind: str = "large") -> list:
    """Sizes of the free blocks of ``pool``'s ``kind`` (``"large"`` or ``"small"``) segments."""
    return [b["size"] for seg in pool.snapshot() if seg.get("segment_type", "large") == kind
            for b in seg["blocks"] if b["state"] == "inactive"]


def _default_free(pool_free: int, kind: str = "large") -> int:
    """Bytes free in the ``kind`` blocks of the device's caches outside the lent pool, whose
    free blocks of that kind hold ``pool_free`` bytes (the default cache, and any other private
    pool: counting those too errs toward not borrowing)."""
    stats = torch.cuda.memory_stats()
    device_free = stats.get(f"reserved_bytes.{kind}_pool.current", 0) - stats.get(f"allocated_bytes.{kind}_pool.current", 0)
    return max(0, device_free - pool_free)


def _growths(pool: torch.cuda.MemPool, sizes: list) -> tuple:
    """How much memory a step whose temporaries are ``sizes`` (alive together) would add: to
    ``pool`` if it borrows it, to the caches outside it if not. Requests of 1 MiB and less come
    from small blocks on either side (2 MiB segments, which no large block serves); the rest
    from large ones."""
    free_large, free_small = _free_blocks(pool), _free_blocks(pool, "small")
    in_pool = _left_over(free_large, sizes) + _small_left_over(free_small, sizes)
    large, small = sum(n for n in sizes if n > _SMALL), sum(n for n in sizes if n <= _SMALL)
    outside = (_short(large, _default_free(sum(free_large)))
               + _segments_for(_short(small, _default_free(sum(free_small), "small"))))
    return in_pool, outside


def _short(needed: int, free: int) -> int:
    return needed - min(needed, free)


def _segments_for(n: int) -> int:
    """The bytes of the small segments that ``n`` bytes of small requests need."""
    return -(-n // _SMALL_SEGMENT) * _SMALL_SEGMENT


def _borrow_pays(in_pool: int, outside: int) -> bool:
    """Borrow the pool when that costs less memory than not: the pool would grow by ``in_pool``
    bytes (and keep them: a pool with live graphs is never trimmed), the caches outside it by
    ``outside`` (:func:`_growths`). Nothing to add to the pool: always (free)."""
    return in_pool == 0 or in_pool < outside


def _left_over(free: Iterable[int], sizes: Iterable[int]) -> int:
    """Bytes of the ``sizes`` (allocated in this order, all alive together) that would not fit
    ``free`` large blocks placed best-fit with splitting, as the caching allocator does. Requests
    up to 1 MiB come from small blocks and are not counted (:func:`_small_left_over`)."""
    return _place(free, [n for n in sizes if n > _SMALL], new_segment=None)


def _small_left_over(free: Iterable[int], sizes: Iterable[int]) -> int:
    """Bytes of the new small segments (2 MiB each) that the ``sizes`` of 1 MiB and less (all
    alive together) would add to small blocks already ``free``, placed best-fit with splitting."""
    return _place(free, [n for n in sizes if n <= _SMALL], new_segment=_SMALL_SEGMENT)


def _place(free: Iterable[int], sizes: list, new_segment: Optional[int]) -> int:
    """Place ``sizes`` in this order best-fit into the ``free`` blocks, splitting them; returns
    the bytes that did not fit (``new_segment`` None), or the bytes of the segments of
    ``new_segment`` bytes added for them, whose rest serves the requests after."""
    blocks = sorted(free)
    added = 0
    for size in sizes:
        i = bisect.bisect_left(blocks, size)
        if i == len(blocks):
            if new_segment is None:
                added += size
                continue
            added += new_segment
            bisect.insort(blocks, new_segment)
            i = bisect.bisect_left(blocks, size)
        rest = blocks.pop(i) - size
        if rest > (_SMALL if new_segment is None else 0):
            bisect.insort(blocks, rest)
    return added
