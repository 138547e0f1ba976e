"""Capture-aware all-reduce: which path a call takes, and the buffers graphs keep registered.

:class:`AllReduceDispatcher` routes each call: a tensor the custom kernel can take goes to one of
three paths (:func:`choose_path`: a buffer registered for the graph being captured inside
:func:`capture_custom_allreduce`, the warmup's allocation mimic, or copy-in to a staging buffer),
anything else (size, dtype, alignment, world size, no peer access; :class:`CustomAllReducePolicy`)
to ``FALLBACK``, the framework's own all-reduce, which NCCL can capture. The engine attributes
registered buffers to the graph being captured (:func:`capturing_graph`) and checks a graph before
replaying it (:func:`check_replay`: :class:`ReleasedBufferError` once its buffers are gone). The
framework parts live behind :class:`AllReduceBackend`; this module imports neither framework.
Paths and rules: docs/collectives.md. Its registry is the process's (:class:`CollectiveRegistry`,
a part of :class:`~paddle_graphpp.core.process.GraphProcess`).
"""

from __future__ import annotations

import abc
import contextlib
import enum
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from .errors import CaptureError, CollectiveTimeoutError, GraphedLayerError
from .process import current_process
from .warn import warn

__all__ = [
    "AllReducePath", "choose_path", "CustomAllReducePolicy", "AllReduceBackend",
    "AllReduceDispatcher", "capture_custom_allreduce", "in_capture_phase", "capturing_graph",
    "check_replay", "release_graph_buffers", "ReleasedBufferError", "TensorFacts", "note_collective",
    "collectives_in", "collective_fault",
]


class ReleasedBufferError(GraphedLayerError):
    """A graph was about to replay a custom all-reduce whose registered buffer is gone."""


class AllReducePath(enum.Enum):
    """How one all-reduce call runs."""

    REGISTERED = "registered"
    ALLOCATION_MIMIC = "allocation_mimic"
    COPY_IN = "copy_in"
    FALLBACK = "fallback"


def choose_path(capture_phase: bool, stream_capturing: bool) -> AllReducePath:
    """The custom kernel's path for a call, from the two facts that decide it: inside
    :func:`capture_custom_allreduce` a capturing stream gets ``REGISTERED`` (a buffer reserved for
    this graph, checked with all ranks when the phase ends) and a stream that does not capture
    ``ALLOCATION_MIMIC`` (the warmup: an empty tensor like the input, as the captured run will
    return); outside it, ``COPY_IN`` (copied into the communicator's staging buffer and reduced
    there). Outside the phase a capturing stream still gets ``COPY_IN``: the staging buffer lives
    as long as the communicator, and closing the communicator marks such graphs released.
    """
    if capture_phase:
        return AllReducePath.REGISTERED if stream_capturing else AllReducePath.ALLOCATION_MIMIC
    return AllReducePath.COPY_IN


@dataclass(frozen=True, slots=True)
class TensorFacts:
    """What the policy needs to know of a tensor, in framework-neutral terms."""

    nbytes: int
    dtype: str
    contiguous: bool
    #: address modulo 16 (0 when 16-byte aligned); -1 when unknown (CPU tensors)
    address_mod16: int


@dataclass(frozen=True, kw_only=True, slots=True)
class CustomAllReducePolicy:
    """When the custom all-reduce is used instead of the framework's."""

    max_bytes: int = 8 << 20
    """Largest message for the custom kernel; also the staging buffer's size."""
    dtypes: frozenset = frozenset({"float32", "bfloat16"})
    """Element types the peer-memory kernel reduces (torch symmetric memory: fp32, bf16)."""
    alignment: int = 16
    """Required byte alignment of the message size and of the address."""
    world_sizes: frozenset = frozenset({2, 4, 8})
    """Group sizes the kernel supports."""
    two_shot_min_bytes: int = 4 << 20
    """Messages at least this large use the two-shot kernel, smaller ones the one-shot."""

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.alignment <= 0 or self.two_shot_min_bytes <= 0:
            raise ValueError("CustomAllReducePolicy: max_bytes, alignment and two_shot_min_bytes must be positive")

    def reject_reason(self, facts: TensorFacts, world_size: int) -> Optional[str]:
        """``None`` when the custom kernel takes this tensor, else why not."""
        if world_size not in self.world_sizes:
            return f"world size {world_size} not in {sorted(self.world_sizes)}"
        if facts.dtype not in self.dtypes:
            return f"dtype {facts.dtype} not in {sorted(self.dtypes)}"
        if not facts.contiguous:
            return "tensor is not contiguous"
        if facts.nbytes == 0:
            return "empty tensor"
        if facts.nbytes > self.max_bytes:
            return f"{facts.nbytes} bytes > max_bytes {self.max_bytes}"
        if facts.nbytes % self.alignment:
            return f"{facts.nbytes} bytes is not a multiple of {self.alignment}"
        if facts.address_mod16 != 0 and self.alignment >= 16:
            return "address is not 16-byte aligned"
        return None


class AllReduceBackend(abc.ABC):
    """The framework half of a custom all-reduce: kernels, buffers and the group.

    Buffers are identified by ``(offset, nbytes)`` inside one symmetric arena per backend,
    so every rank that captures the same calls reserves the same offsets.
    """

    name: str = "abstract"

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """Ranks in the group."""

    @abc.abstractmethod
    def custom_unavailable_reason(self) -> Optional[str]:
        """``None`` when the peer-memory kernel can run, else why not (e.g. no peer access)."""

    @abc.abstractmethod
    def facts(self, tensor: Any) -> TensorFacts:
        """Size, dtype, layout and alignment of ``tensor``."""

    @abc.abstractmethod
    def is_capturing(self) -> bool:
        """True when the current stream is capturing a graph."""

    @abc.abstractmethod
    def empty_like(self, tensor: Any) -> Any:
        """An uninitialised tensor like ``tensor``."""

    @abc.abstractmethod
    def fallback(self, tensor: Any) -> Any:
        """The framework's all-reduce (sum) over the group; returns the result."""

    @abc.abstractmethod
    def reduce_staged(self, tensor: Any) -> Any:
        """Copy ``tensor`` into the staging buffer and reduce it there; returns a new tensor."""

    @abc.abstractmethod
    def reduce_registered(self, tensor: Any, offset: int) -> Any:
        """Reduce ``tensor`` through the arena buffer at ``offset``; returns a new tensor."""

    @abc.abstractmethod
    def arena_bytes(self) -> int:
        """Bytes of the arena available for registered buffers."""

    def buffer_bytes(self, nbytes: int) -> int:
        """Arena bytes one registered call of an ``nbytes`` message reserves (default: ``nbytes``).

        A kernel that receives its peers' data into double-buffered slots reserves more.
        """
        return nbytes

    def fault(self) -> Optional[str]:
        """Why the group's custom kernel cannot be used again (a call gave up waiting for a
        peer: the text names it), else ``None`` (the default: a backend without a timeout).
        Cheap and without device calls: it is asked before every call and from the replay
        watchdog's thread."""
        return None

    @abc.abstractmethod
    def exchange(self, obj: Any) -> list:
        """All-gather a small picklable object over the group (outside any capture)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free the arena and staging buffer. The dispatcher has marked their graphs released."""


class _Arena:
    """First-fit allocator of ``[offset, offset + nbytes)`` ranges; deterministic across ranks."""

    GRANULE = 256

    def __init__(self, size: int) -> None:
        self.size = size
        self.used: dict[int, int] = {}

    def reserve(self, nbytes: int) -> Optional[int]:
        need = -(-nbytes // self.GRANULE) * self.GRANULE
        cursor = 0
        for off in sorted(self.used):
            if off - cursor >= need:
                break
            cursor = max(cursor, off + self.used[off])
        if cursor + need > self.size:
            return None
        self.used[cursor] = need
        return cursor

    def free(self, offset: int) -> None:
        self.used.pop(offset, None)

    @property
    def in_use(self) -> int:
        return sum(self.used.values())


class _State(enum.Enum):
    PENDING = "pending"
    REGISTERED = "registered"
    RELEASED = "released"


@dataclass(eq=False, slots=True)
class _Registration:
    dispatcher: "AllReduceDispatcher"
    offset: Optional[int]   # None: the staging buffer (captured copy-in)
    nbytes: int
    dtype: str
    state: _State = _State.PENDING


@dataclass(eq=False)
class _GraphRecord:
    label: str
    registrations: list = field(default_factory=list)
    released_reason: Optional[str] = None
    collectives: list = field(default_factory=list)  # what ran inside the capture, for error messages


# --------------------------------------------------------------------------- registry
class _Tls(threading.local):
    def __init__(self) -> None:
        self.graphs: list[tuple[int, _GraphRecord]] = []


class CollectiveRegistry:
    """The process's custom all-reduce bookkeeping (a part of the process)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.phase_depth = 0  # capture_custom_allreduce blocks open, in any thread
        self.phase_pending: list[tuple[_Registration, _GraphRecord]] = []
        self.records: dict[int, _GraphRecord] = {}  # id(graph) -> record, removed when the graph dies
        # Buffers captured with no graph declared: they live until their dispatcher is closed.
        self.undeclared = _GraphRecord("a graph not declared with capturing_graph()")
        self.dispatchers: "weakref.WeakSet[AllReduceDispatcher]" = weakref.WeakSet()  # those that can fail alone
        self.thread = _Tls()  # per thread: the graphs being captured (capturing_graph), innermost last


def _registry() -> CollectiveRegistry:
    return current_process().part(CollectiveRegistry)


def in_capture_phase() -> bool:
    """True inside :func:`capture_custom_allreduce` (process-wide, any thread)."""
    return _registry().phase_depth > 0


@contextlib.contextmanager
def capture_custom_allreduce() -> Iterator[None]:
    """Mark the capture phase for every custom all-reduce in the process.

    Inside, all-reduces on a capturing stream reserve a buffer for the graph being captured
    (``REGISTERED``); those on a stream that is not capturing are warmup runs and return an
    empty tensor (``ALLOCATION_MIMIC``). On leaving the outermost phase the reserved buffers
    are checked with all ranks (same offsets, sizes and dtypes, in the same order) and kept
    until their graph is freed or :func:`release_graph_buffers` is called.

    Ways to break it:
        * Every rank must enter and leave the phase together and capture the same all-reduces:
          leaving runs a collective exchange; different captures raise ``CaptureError``.
        * Warmup outputs inside the phase are uninitialised: do not read them.
        * Leaving the phase by an exception releases the buffers reserved in it without the
          exchange, and graphs captured in it refuse to replay.
    """
    registry = _registry()
    with registry.lock:
        registry.phase_depth += 1
    ok = False
    try:
        yield
        ok = True
    finally:
        with registry.lock:
            registry.phase_depth -= 1
            done = registry.phase_depth == 0
            pending = list(registry.phase_pending) if done else []
            if done:
                registry.phase_pending.clear()
        if done and pending:
            if ok:
                _register(pending)
            else:
                for reg, record in pending:
                    _release(reg, record, "its capture phase ended with an error")


def _register(pending: list) -> None:
    by_dispatcher: dict[int, list] = {}
    for reg, record in pending:
        by_dispatcher.setdefault(id(reg.dispatcher), []).append((reg, record))
    for items in by_dispatcher.values():
        dispatcher = items[0][0].dispatcher
        mine = [(reg.offset, reg.nbytes, reg.dtype) for reg, _ in items]
        everyone = dispatcher.backend.exchange(mine)
        for rank, theirs in enumerate(everyone):
            if list(map(tuple, theirs)) != mine:
                for reg, record in items:
                    _release(reg, record, "ranks captured different custom all-reduces")
                raise CaptureError(
                    f"custom all-reduce ({dispatcher.backend.name}): rank {rank} captured "
                    f"{len(theirs)} all-reduces {list(theirs)[:4]}..., this rank {len(mine)} "
                    f"{mine[:4]}...; every rank must capture the same layers with the same shapes")
        for reg, _ in items:
            if reg.state is _State.PENDING:
                reg.state = _State.REGISTERED


def _release(reg: _Registration, record: Optional[_GraphRecord], reason: str) -> None:
    if reg.state is _State.RELEASED:
        return
    reg.state = _State.RELEASED
    if reg.offset is not None:
        reg.dispatcher._arena.free(reg.offset)
    if record is not None and record.released_reason is None:
        record.released_reason = reason


@contextlib.contextmanager
def capturing_graph(graph: Any, label: Optional[str] = None) -> Iterator[None]:
    """Attribute the buffers reserved inside to ``graph`` (the engine wraps each capture).

    When ``graph`` is garbage-collected its buffers are unregistered and returned to the
    arena. Buffers reserved with no graph declared belong to an anonymous record that lives
    until the communicator is closed.
    """
    record = _GraphRecord(label or f"{type(graph).__name__}@{id(graph):#x}")
    key = id(graph)
    registry = _registry()
    with registry.lock:
        registry.records[key] = record
    try:
        weakref.finalize(graph, _forget, registry, key, record)
    except TypeError:
        pass   # not weak-referenceable: buffers stay until release_graph_buffers / close
    registry.thread.graphs.append((key, record))
    try:
        yield
    finally:
        registry.thread.graphs.pop()


def _forget(registry: CollectiveRegistry, key: int, record: _GraphRecord) -> None:
    with registry.lock:
        for reg in record.registrations:
            _release(reg, None, "graph freed")
        if registry.records.get(key) is record:
            del registry.records[key]


def _current_record(registry: CollectiveRegistry) -> _GraphRecord:
    graphs = registry.thread.graphs
    return graphs[-1][1] if graphs else registry.undeclared


def note_collective(name: str) -> None:
    """A collective ran inside the capture under way (named in the replay watchdog's errors)."""
    graphs = _registry().thread.graphs
    if graphs:
        collectives = graphs[-1][1].collectives
        if name not in collectives:
            collectives.append(name)


def collectives_in(graph: Any) -> list:
    """The collectives noted while ``graph`` was captured (see :func:`note_collective`)."""
    record = _registry().records.get(id(graph))
    return list(record.collectives) if record is not None else []


def collective_fault() -> Optional[str]:
    """The first fault of a live dispatcher's backend (a custom kernel that gave up waiting for
    a peer), or ``None``. Cheap: every graphed call and the replay watchdog's thread ask it."""
    registry = _registry()
    if not registry.dispatchers:
        return None
    with registry.lock:
        dispatchers = list(registry.dispatchers)
    for dispatcher in dispatchers:
        if not dispatcher._closed:
            fault = dispatcher.backend.fault()
            if fault is not None:
                return fault
    return None


def check_replay(graph: Any) -> None:
    """Raise :class:`ReleasedBufferError` if ``graph`` uses a custom all-reduce buffer that is gone.

    Call it before every replay of a graph that may contain a custom all-reduce; it costs a
    dictionary lookup. Graphs that never registered a buffer pass.
    """
    record = _registry().records.get(id(graph))
    if record is not None and record.released_reason is not None:
        raise ReleasedBufferError(
            f"custom all-reduce: graph {record.label} cannot replay: its registered buffers were "
            f"released ({record.released_reason}); replaying would read freed memory. "
            f"Capture the graph again inside capture_custom_allreduce().")


def release_graph_buffers(graph: Any) -> None:
    """Unregister ``graph``'s buffers now; later replays of it raise ``ReleasedBufferError``."""
    registry = _registry()
    with registry.lock:
        record = registry.records.get(id(graph))
        if record is None:
            return
        for reg in record.registrations:
            _release(reg, record, "release_graph_buffers() was called")


class AllReduceDispatcher:
    """Route each all-reduce to the custom kernel's path or to the framework's all-reduce.

    Args:
        backend: the framework half (:class:`AllReduceBackend`).
        policy: which tensors the custom kernel takes; defaults to :class:`CustomAllReducePolicy`.

    ``counts`` records how many calls took each path (for tests and benchmarks).

    Ways to break it:
        * Use the return value of :meth:`all_reduce`: the custom paths return a new tensor,
          the fallback reduces in place.
        * Every rank must call it with the same shapes in the same order (it is a collective).
        * After :meth:`close`, graphs that captured it refuse to replay (see :func:`check_replay`).
        * After a custom kernel gave up waiting for a peer (:meth:`AllReduceBackend.fault`),
          every call raises :class:`~paddle_graphpp.core.errors.CollectiveTimeoutError`, and so
          does the next graphed call (:func:`collective_fault`).
    """

    def __init__(self, backend: AllReduceBackend, policy: Optional[CustomAllReducePolicy] = None) -> None:
        self.backend = backend
        self.policy = policy or CustomAllReducePolicy()
        self._arena = _Arena(backend.arena_bytes())
        self._registrations: list[_Registration] = []
        self._closed = False
        self._warned_full = False
        self.counts = {path: 0 for path in AllReducePath}
        if type(backend).fault is not AllReduceBackend.fault:  # it can fail on its own: watched
            registry = _registry()
            with registry.lock:
                registry.dispatchers.add(self)

    # ------------------------------------------------------------------ policy
    def why_not_custom(self, tensor: Any) -> Optional[str]:
        """``None`` when the custom kernel takes ``tensor``, else the reason it falls back."""
        if self._closed:
            return "the dispatcher is closed"
        reason = self.backend.custom_unavailable_reason()
        if reason is not None:
            return reason
        return self.policy.reject_reason(self.backend.facts(tensor), self.backend.world_size)

    def should_use_custom(self, tensor: Any) -> bool:
        """True when the custom kernel takes ``tensor`` (size, dtype, alignment, world size)."""
        return self.why_not_custom(tensor) is None

    def path_for(self, tensor: Any) -> AllReducePath:
        """The path :meth:`all_reduce` would take for ``tensor`` right now."""
        if not self.should_use_custom(tensor):
            return AllReducePath.FALLBACK
        return choose_path(in_capture_phase(), self.backend.is_capturing())

    # -------------------------------------------------------------------- call
    def all_reduce(self, tensor: Any) -> Any:
        """Sum ``tensor`` over the group; returns the result (see the class notes)."""
        fault = self.backend.fault()
        if fault is not None:
            raise CollectiveTimeoutError(fault)
        path = self.path_for(tensor)
        if self.backend.is_capturing():
            kind = "the framework's all-reduce" if path is AllReducePath.FALLBACK else "the custom all-reduce"
            note_collective(f"{kind} of a {self.backend.world_size}-rank group")
        if path is AllReducePath.REGISTERED:
            facts = self.backend.facts(tensor)
            with _registry().lock:
                offset = self._arena.reserve(self.backend.buffer_bytes(facts.nbytes))
            if offset is None:
                if not self._warned_full:
                    warn(
                        f"custom all-reduce ({self.backend.name}): the registered-buffer arena "
                        f"({self._arena.size} bytes) is full; further captured all-reduces use "
                        f"the framework's all-reduce. Give the backend a larger arena.", UserWarning)
                    self._warned_full = True
                path = AllReducePath.FALLBACK
            else:
                self._note(offset, facts)
                self.counts[path] += 1
                return self.backend.reduce_registered(tensor, offset)
        self.counts[path] += 1
        if path is AllReducePath.FALLBACK:
            return self.backend.fallback(tensor)
        if path is AllReducePath.ALLOCATION_MIMIC:
            return self.backend.empty_like(tensor)
        if self.backend.is_capturing():
            self._note(None, self.backend.facts(tensor))
        return self.backend.reduce_staged(tensor)

    def _note(self, offset: Optional[int], facts: TensorFacts) -> None:
        reg = _Registration(self, offset, facts.nbytes, facts.dtype)
        registry = _registry()
        record = _current_record(registry)
        with registry.lock:
            record.registrations.append(reg)
            self._registrations.append(reg)
            if offset is not None and registry.phase_depth > 0:
                registry.phase_pending.append((reg, record))
            else:
                reg.state = _State.REGISTERED   # staging buffer: registered for life

    # ------------------------------------------------------------- bookkeeping
    @property
    def registered_bytes(self) -> int:
        """Arena bytes held by live graphs (and by captures not yet registered)."""
        return self._arena.in_use

    def close(self) -> None:
        """Release every buffer; graphs that captured this dispatcher refuse to replay."""
        if self._closed:
            return
        registry = _registry()
        with registry.lock:
            self._closed = True
            records = [*registry.records.values(), registry.undeclared]
            for record in records:
                for reg in record.registrations:
                    if reg.dispatcher is self:
                        _release(reg, record, f"its {self.backend.name} custom all-reduce was closed")
            for reg in self._registrations:
                _release(reg, None, "closed")
            self._registrations.clear()
        self.backend.close()

