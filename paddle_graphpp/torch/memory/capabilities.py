"""The PyTorch runtime's memory capabilities: graph pools (made, anchored, released), outputs
that give their memory back to the pool, outputs handed out and watched per storage
(:mod:`.handout`), optimizer steps that borrow the pool, the stream-ordered allocator, and
memory figures."""

from __future__ import annotations

import gc
import logging
import os
import sys
import weakref
from typing import Optional

import torch

from ...allocator import env_flag_value
from ...core.runtime import MemoryTelemetry, OutputRelease, PoolLending, StreamOrderedAllocator
from ...core.flags import env_flag
from ..graphs import anchor_graph, free_blas_workspaces
from . import handout as _handout
from .allocator import async_allocator_active as _async_allocator_active

logger = logging.getLogger(__name__)

__all__ = ["TorchMemory", "storage_watches"]


class TorchMemory(OutputRelease, PoolLending, StreamOrderedAllocator, MemoryTelemetry):
    """Mixed into :class:`~paddle_graphpp.torch.runtime.TorchRuntime`; needs its
    ``capture_stream()`` and ``copy_many``."""

    def __init__(self):
        super().__init__()
        self._lender = None  # pool_lending.PoolLender, once a pool is lent
        self._pools: list = []  # every MemPool handed out (see new_pool)
        self._held: list = []  # pools given back, until a release finds nothing else holds them (release_pool)
        self._held_passes: dict = {}  # id(held pool) -> releases that found it still held
        self._anchors: dict = {}  # id(pool) -> its empty anchor graph (see new_pool)
        self._shared_pools: "weakref.WeakSet" = weakref.WeakSet()  # new_pool(shared=True)'s
        self._frees_blas: Optional[bool] = None  # see blas_workspace_frees
        from .pool_lending import watch_optimizers

        watch_optimizers()  # prepare_pool sizes a pool by the parameters of the optimizers that step

    def end_borrowed_work(self) -> None:
        """An optimizer step that raised may have left the borrowed pool active: leave it."""
        if self._lender is not None:
            self._lender.abandon_step()

    def release_to_pool(self, tensor) -> None:
        # The tensor object is re-pointed at a storage over the same address that owns nothing
        # (as PyTorch's CUDA graph trees alias graph outputs); when the last owning storage goes,
        # the block returns to the graphs' pool. Only graph memory: a CPU tensor (a test's fake
        # capture) would be freed to the host allocator under the alias.
        if not tensor.is_cuda:
            return
        with torch.no_grad():
            tensor.set_(_unowned_storage(tensor), tensor.storage_offset(), tensor.shape, tensor.stride())

    def memory_watches(self, tensors, others):
        if not tensors or not all(t.is_cuda for t in tensors):
            return None  # graph memory only (see release_to_pool)
        return storage_watches(tensors, others)

    def weak_alias(self, tensor):
        if not tensor.is_cuda:
            return None
        out = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        with torch.no_grad():
            out.set_(_unowned_storage(tensor), tensor.storage_offset(), tensor.shape, tensor.stride())
        return out

    def hand_out(self, tensors):
        return _handout.hand_out(tensors)

    def move_to_copies(self, held, overwritten) -> None:
        _handout.move_to_copies(self, held, overwritten)

    def new_pool(self, shared: bool = False):
        # A MemPool (not a bare handle): eager work can then be routed into it (lend_pool). Its
        # destructor empties its cache, which the allocator refuses (aborting the process) while
        # any capture is underway: the runtime keeps each pool until it is released between
        # captures (release_pool) or the process ends. Each pool gets an empty anchor graph
        # captured into it: the host (pinned-memory) allocator counts a pool's users only by its
        # graphs, and refuses a capture into a pool whose graphs are all gone (torch 2.11:
        # "use_count > 0" asserted in capture_begin), as they are after reset_graphs() or a
        # failed capture.
        # A shared pool's captures free torch's cuBLAS workspaces around them (blas_workspace_frees).
        pool = torch.cuda.MemPool()
        self._pools.append(pool)
        self._anchors[id(pool)] = anchor_graph(pool, self.capture_stream())
        if shared:
            self._shared_pools.add(pool)
        return pool

    def blas_workspace_frees(self, pool) -> tuple:
        """``(before, after)``: whether a capture into ``pool`` frees torch's cuBLAS workspaces
        before it begins and after it ends (``graphs.free_blas_workspaces``).

        A capture into a shared pool frees both: the pool keeps no workspace between replays.
        A capture into a pool of one graph (``memory="per_graph"``, ``graph_step``'s, one made
        for the call) frees before, so that its workspace is made in its own pool, and keeps it:
        freed after, every such pool would hold one. From then on nothing in the process frees
        them (the later captures use that one, as torch has them do), since a workspace kept for
        some graph may be in use by others. ``FLAGS_graphpp_free_blas_workspaces=0`` keeps
        torch's workspaces as they are from the start: the map is the process's, and a program
        that captures graphs of its own, outside this library, on a stream it also ran matmuls
        on eagerly, or into a pool it shares across captures made before and after one of ours,
        would have a workspace those graphs use freed under them."""
        if not self._frees_on():
            return False, False
        if pool in self._shared_pools:  # new_pool(shared=True)'s; None or a bare pool id is not
            return True, True
        self._frees_blas = False
        return True, False

    def free_blas_workspaces_if_on(self) -> None:
        """Free torch's cuBLAS workspaces where captures still do (:meth:`blas_workspace_frees`)."""
        if self._frees_on():
            free_blas_workspaces()

    def _frees_on(self) -> bool:
        # The flag, read once by whichever asks first: a capture or a borrowed optimizer step.
        if self._frees_blas is None:
            self._frees_blas = env_flag("FLAGS_graphpp_free_blas_workspaces", True)
        return self._frees_blas

    def release_pool(self, pool) -> None:
        # The pool leaves the runtime's pools for the held ones; the next release_cached_memory
        # (between captures; the core calls it right after giving a pool back) drops the last
        # reference once nothing else holds the pool: its destructor then gives its reference on
        # the allocator's pool back and frees its cached segments. A pool someone else still
        # holds (a failed capture's error on its way up, say) would be destroyed whenever that
        # holder lets go, maybe inside a later capture, where the destructor trips the allocator's
        # assertion: it waits for a later release. (Asked inside this method, the reference count
        # would count more than the caller's reference once torch.compile has run in the process:
        # dynamo's frame evaluation holds the arguments of each running call.)
        if pool not in self._pools:
            return
        self._pools.remove(pool)
        self._held.append(pool)

    def _release_held(self) -> None:
        """Give back the held pools (:meth:`release_pool`) that nothing else holds any more. The
        first two releases after a failed capture gave one back come while the failure is still
        being handled (its error may hold the pool); a pool still held at a third is named in a
        warning, once."""
        i = 0
        while i < len(self._held):
            if sys.getrefcount(self._held[i]) > _ALONE_IN_LIST:
                key = id(self._held[i])
                self._held_passes[key] = self._held_passes.get(key, 0) + 1
                if self._held_passes[key] == 3:
                    logger.warning("paddle_graphpp: a graph pool given back is still referenced (by %s): its "
                                   "memory stays reserved until that lets go",
                                   referrers(self._held[i], skip=(self._held,)))
                i += 1
                continue
            self._held_passes.pop(id(self._held[i]), None)
            anchor = self._anchors.pop(id(self._held[i]), None)
            if anchor is not None:
                anchor.reset()
            del self._held[i]  # the last reference: the pool's destructor frees its segments

    # memory
    def memory_stats(self, pools=None) -> dict:
        if not torch.cuda.is_available():
            return {"reserved_bytes": 0, "allocated_bytes": 0}
        if pools is None:
            return {"reserved_bytes": torch.cuda.memory_reserved(),
                    "allocated_bytes": torch.cuda.memory_allocated()}
        if torch.cuda.get_allocator_backend() == "cudaMallocAsync":
            # No snapshot and no private pools under cudaMallocAsync: all graph memory is the
            # driver's, reported as a whole whatever the pools.
            from ...core.driver_memory import GraphMemory

            gm = GraphMemory(torch.cuda.current_device())
            return {"reserved_bytes": gm.get(GraphMemory.RESERVED_CURRENT) or 0,
                    "allocated_bytes": gm.get(GraphMemory.USED_CURRENT) or 0}
        wanted = {tuple(_pool_id(p)) for p in pools if p is not None}
        reserved = allocated = 0
        for seg in torch.cuda.memory_snapshot():
            if tuple(seg.get("segment_pool_id", ())) in wanted:
                reserved += seg["total_size"]
                allocated += seg["allocated_size"]
        return {"reserved_bytes": reserved, "allocated_bytes": allocated}

    def async_allocator_active(self) -> bool:
        return _async_allocator_active()

    def lending_report(self) -> Optional[dict]:
        """What optimizer steps borrowing graph pools did in this process
        (:meth:`PoolLender.report`); ``None`` before any pool was lent or reserved."""
        return None if self._lender is None else self._lender.report()

    def _pool_lender(self):
        if self._lender is None:
            from .pool_lending import PoolLender

            self._lender = PoolLender(self.capture_stream, self.free_blas_workspaces_if_on)
        return self._lender

    def defer_capture(self) -> Optional[str]:
        # An optimizer that has not stepped creates its state in its first step, beside a pool
        # captured before it (the last stage of a 1F1B pipeline, whose episodes are single
        # micro-batches, would otherwise capture within the first training step), with or
        # without a reserved block (docs/memory.md has the measurement).
        if not torch.cuda.is_available():
            return None
        from .pool_lending import optimizer_pending

        return optimizer_pending()

    def prepare_pool(self, pool) -> int:
        layout = _reserve_pool()
        return self._pool_lender().reserve(pool, layout) if layout else 0

    def lend_pool(self, pool, is_idle, on_leak) -> None:
        self._pool_lender().lend(pool, is_idle, on_leak)

    def release_cached_memory(self) -> None:
        self._release_held()  # between captures (the callers'), where a pool may be destroyed
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _unowned_storage(tensor):
    """A storage over ``tensor``'s whole storage that does not own the memory."""
    storage = tensor.untyped_storage()
    return torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())


def storage_watches(tensors, others) -> Optional[list]:
    """Per tensor, whether its storage is still alive (a weak reference to the storage: a tensor
    object may die while autograd keeps its storage saved); ``None`` when two of ``tensors`` share
    a storage, or one shares a storage with ``others``."""
    from torch.multiprocessing.reductions import StorageWeakRef

    try:
        storages = [t.untyped_storage() for t in tensors]
        keys = [(s.device, s.data_ptr()) for s in storages]
        taken = {(o.untyped_storage().device, o.untyped_storage().data_ptr()) for o in others
                 if isinstance(o, torch.Tensor) and o.layout is torch.strided}
    except (NotImplementedError, RuntimeError):  # no plain storage to watch (sparse, DTensor, nested)
        return None
    if len(set(keys)) != len(keys) or taken.intersection(keys) or any(p == 0 for _, p in keys):
        return None
    refs = [StorageWeakRef(s) for s in storages]
    return [lambda ref=ref: not ref.expired() for ref in refs]


_RESERVE_FLAG = "FLAGS_graphpp_reserve_pool"


def _reserve_pool() -> Optional[str]:
    """``FLAGS_graphpp_reserve_pool``: the memory a shared pool gets before its first capture,
    for the stepping optimizers' temporaries between episodes (see pool_lending,
    ``step_temporaries``): unset or true, one block of their bytes (``"block"``); ``segments``,
    the segments one list of temporaries makes; false, none. Captures wait for an optimizer's first step either way
    (``defer_capture``). In a pool of expandable segments (the default, see pool_segments) the
    two layouts come to the same free range."""
    from .pool_lending import BLOCK, SEGMENTS

    raw = os.environ.get(_RESERVE_FLAG)
    if raw is None:
        return BLOCK
    if (layout := raw.strip().lower()) in (BLOCK, SEGMENTS):
        return layout
    try:
        return BLOCK if env_flag_value(raw, _RESERVE_FLAG) else None
    except ValueError:
        raise ValueError(f"{_RESERVE_FLAG}={raw!r}: use 1 or 'block' (one block of the optimizer's parameter "
                         f"bytes, the default), 'segments' (the segments its temporaries make) or 0 (none)") from None


class _Probe:
    pass


def _alone_in_list() -> int:
    """What ``sys.getrefcount(held[i])`` reads for an object only the list ``held`` holds (CPython
    versions may differ: 3.14 borrows more references)."""
    held = [_Probe()]
    return sys.getrefcount(held[0])


_ALONE_IN_LIST = _alone_in_list()


def _pool_id(pool):
    return pool.id if isinstance(pool, torch.cuda.MemPool) else pool


def referrers(obj, skip: tuple = ()) -> str:
    """What refers to ``obj``, for a log line or a test's message: each holder the collector
    knows, named (a frame not running, by function and line, e.g. one a traceback or a suspended
    generator keeps; a closure cell by the functions that close over it; a container by what
    holds it), on Python 3.13 and later the frames of this thread's stack that hold it in a local,
    and how many references none of these account for (running frames' locals before 3.13, C++
    holders, untracked containers); ``skip``: objects not to name (the asker's own). Reading a
    running frame's locals before 3.13 would store a snapshot in the frame that holds ``obj`` for
    as long as the frame runs: those are counted, not read."""
    here, frame = sys._getframe(), None
    mine = [here, *skip]
    try:
        found = [r for r in gc.get_referrers(obj) if not _among(r, mine)]
        # getrefcount's argument and this frame's ``obj`` aside
        unexplained = sys.getrefcount(obj) - 2 - len(found)
        for s in skip:  # a loop, not a generator: one would close over ``obj`` (a cell referring to it)
            unexplained -= _holds(s, obj)
        names = [_holder(r, mine + [found]) for r in found]
        frame = here.f_back if sys.version_info >= (3, 13) else None  # 3.13: f_locals is a view
        while frame is not None:
            if _holds(frame, obj):
                names.append(f"running frame {_frame_name(frame)}")
                unexplained -= 1
            frame = frame.f_back
        if unexplained > 0:
            names.append(f"{unexplained} reference(s) not accounted for (running frames' locals, C++ holders)")
        return ", ".join(names) or "nothing found"
    finally:
        # no cycle through this frame (it refers to itself and, by f_back, to its callers): left
        # to the collector, it would hold ``obj`` on
        mine.clear()
        del here, mine, frame


def _among(obj, objs) -> bool:
    return any(obj is o for o in objs)


def _holds(container, obj) -> bool:
    """Whether ``container`` (a sequence, a mapping, or on 3.13 and later a frame) refers to ``obj``."""
    import types

    if isinstance(container, types.FrameType):
        if sys.version_info < (3, 13):
            return False  # reading it would snapshot its locals into the frame (see referrers)
        container = container.f_locals
    try:
        values = container.values() if hasattr(container, "values") else container
        return any(v is obj for v in values)
    except TypeError:
        return False


def _frame_name(frame) -> str:
    return f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})"


def _holder(ref, mine: list) -> str:
    """``ref`` (a holder of something) named for a person: frames by function and line, cells
    by the functions closing over them, containers by the types of what holds them."""
    import types

    if isinstance(ref, types.FrameType):
        return f"frame {_frame_name(ref)} (not running: a traceback's or a suspended generator's)"
    up = [r for r in gc.get_referrers(ref) if not _among(r, mine)]
    if isinstance(ref, types.CellType):
        users = [f.__qualname__ for t in up if isinstance(t, tuple)
                 for f in gc.get_referrers(t) if isinstance(f, types.FunctionType) and f.__closure__ is t]
        users += [f"frame {_frame_name(r)}" for r in up if isinstance(r, types.FrameType)]
        return f"cell of {', '.join(users) or 'a running frame, or of a closure no longer reachable'}"
    if isinstance(ref, (list, dict, tuple, set)):
        owners = [type(r).__qualname__ if not isinstance(r, types.FrameType) else f"frame {_frame_name(r)}"
                  for r in up][:4]
        return f"{type(ref).__qualname__} in {', '.join(owners) or 'a running frame, or nothing the collector sees'}"
    return type(ref).__qualname__
