"""Record, then capture: the process-wide side of the graph engine.

Every graphed layer of a process reports to one :class:`Process` per runtime. It owns

* the :class:`~paddle_graphpp.core.schedule.EpisodeClock`: micro-batches in flight in any
  graphed layer, and the episode number (an episode runs from one moment with nothing in
  flight to the next);
* the :class:`~paddle_graphpp.core.memory.MemoryPlan`: pools, generations, capture order;
* the *recording*: during one eager episode, each graphed layer whose signature is armed
  appends ``(layer, signature, position, forward|backward)`` here, in the order the
  schedule ran them (a split backward of a zero-bubble schedule appends its input half and
  its weight half, each where it ran), and the *slots* of the static buffers each position will copy its
  inputs and incoming gradients into (a slot is reused by later positions once the
  position's backward has run; the buffers themselves are allocated at capture). An input
  that was another recorded layer's output (layer ``i + 1`` reading layer ``i``'s result), or
  an incoming gradient that was another recorded layer's input gradient, is a :class:`Link`
  instead of a slot: at capture it is that graph's static output itself, so at replay the
  producer's graph writes what the consumer's graph reads and nothing is copied.

At the start of the next episode (the first graphed forward that finds nothing in flight
calls :meth:`Process.capture_if_due`), :meth:`Process.capture_recorded` captures the recording, unless the runtime asks to wait
(:meth:`~paddle_graphpp.core.runtime.PoolLending.defer_capture`, with its reason; for
example, a runtime may wait for an optimizer's first step, which creates the optimizer state
beside a pool captured before it). Then the recording is dropped and the episode starting now is recorded in its place,
at most :data:`MAX_DEFERRED_EPISODES` times in a row. A capture gives the eager episode's cached
memory back to the driver, allocates the static buffers in one block, lets the runtime size a new shared pool
for the eager work that will borrow it
(:meth:`~paddle_graphpp.core.runtime.PoolLending.prepare_pool`), then captures every
recorded position in recorded order into one pool generation (a
:class:`~paddle_graphpp.core.batch.CaptureBatch`, discarded afterwards):
forward graphs and backward graphs interleaved exactly as the step ran them, so memory a
graph frees is only reused by graphs that run after it (so is a gradient one graph hands another,
once no position that may read it is left: see
:meth:`~paddle_graphpp.core.batch.CaptureBatch.consumed`). No eager pass runs beside a
capture, so the capture costs what one eager step's activations cost, once. Capture does
not execute anything; the episode that follows replays the new graphs.

Under the stream-ordered allocator nothing is recorded: graph memory exists only once a
graph has run, so each position is captured and launched in its own step
(see :mod:`paddle_graphpp.core.engine`).
"""

from __future__ import annotations

import gc
import logging
import os
import warnings
import weakref
from collections import defaultdict
from typing import Any, Callable, Hashable, Optional, Sequence

from . import collectives as _collectives
from . import memory as _memory
from .batch import CaptureBatch, Link
from .errors import CaptureError, CollectiveTimeoutError
from .flags import env_flag
from .runtime import capabilities
from .schedule import EpisodeClock
from .watchdog import ReplayWatchdog, parse_timeout

__all__ = ["Process", "process_for", "Link"]

logger = logging.getLogger("paddle_graphpp")

_UNRESOLVED = object()  # the watchdog is decided at first use

MAX_DEFERRED_EPISODES = 4096  # recordings dropped in a row at most while the runtime asks to wait
# (episodes, not steps: on the last stage of a 1F1B pipeline every micro-batch is one)


class Process:
    """Process-wide state of one runtime: episode clock, memory plan, the recording, and what
    replays check after a capture. Layers take part as
    :class:`~paddle_graphpp.core.batch.CaptureParticipant` objects (their ``capture``)."""

    def __init__(self, plan: "_memory.MemoryPlan"):
        self.runtime = plan.runtime
        self.caps = capabilities(plan.runtime)
        self.plan = plan
        self.clock = EpisodeClock()
        # (participant, key, position, forward, half): half is None, or "input" / "weight" for the
        # two halves of a split backward
        self._events: list[tuple[Any, Hashable, int, bool, Optional[str]]] = []
        self._slot_specs: list = []  # spec of each static buffer slot of the recording
        self._free_slots: dict[Any, list] = defaultdict(list)
        self._layers = weakref.WeakValueDictionary()  # id -> participant with captured graphs
        # id(parameter) -> (weak reference to it, to the participant whose graphs accumulate its gradient)
        self._grad_owners: dict[int, tuple] = {}
        # Tensors recorded calls produced, by (kind, alias key): (weak reference, Link). The
        # weak reference proves the memory still belongs to that tensor when it is looked up.
        self._produced_recorded: dict[tuple, tuple] = {}
        # While recording: the input gradients whose memory is watched (see watch_grads)
        self._grad_watched: set = set()
        self.deferred = 0  # recordings dropped in a row because the runtime asked to wait
        # Outputs that die within the recorded episode (see watch_outputs): while recording, the
        # watches [(is the memory in use, Link)] and per event index the outputs found dead before it
        self._watches: list = []
        self._deaths: dict[int, list] = {}
        # After capture: per (participant id, key, position, kind) of a captured graph, the outputs
        # whose memory later graphs may take once it has run (checked before it replays); per
        # (participant id, key, position), weak references to what its last forward replay handed out
        self._checks: dict[tuple, tuple] = {}
        self._handed: dict[tuple, list] = {}
        #: Backward graph replays (and eager recorded backwards) so far that changed parameter
        #: gradients in ``.grad`` outside autograd (gradient accumulation inside graphs). A
        #: replay's writes do not bump tensors' version counters, so code that skips work on
        #: gradients nobody wrote (``GraphedOptimizer.zero_grad``) compares this count as well.
        self.grad_writes = 0
        #: Set by a framework's capture-agreement helper (torch: ``agree_on_captures``): called at
        #: the end of every batch of captures with whether an error of this process's captures is
        #: about to reach the user; returns the ranks of the agreement group whose captures failed
        #: (empty: none), or raises :class:`~paddle_graphpp.CaptureError` when the peers do not
        #: answer in time. ``None``: each process decides alone.
        self.agreement: Optional[Callable[[bool], list]] = None
        self._watchdog: Any = _UNRESOLVED  # core.watchdog.ReplayWatchdog, None, or not decided yet
        self._published_failure = False  # this process told its peers a capture failed: it stops anyway

    # ------------------------------------------------------ shared parameters
    def accumulate_in_graphs(self, layer: Any, params: Sequence[Any]) -> None:
        """``layer``'s graphs add the gradients of ``params`` into ``.grad`` from now on."""
        for p in params:
            self._grad_owners[id(p)] = (weakref.ref(p), weakref.ref(layer))

    def graph_accumulator_of(self, param: Any) -> Optional[Any]:
        """The layer whose graphs add ``param``'s gradient into ``.grad``, if one still does
        (not reset, not turned eager; the entry names this very tensor, not one that took its id)."""
        entry = self._grad_owners.get(id(param))
        if entry is None:
            return None
        layer = entry[1]()
        if entry[0]() is not param or layer is None or not layer.accumulates_in_graphs(param):
            del self._grad_owners[id(param)]
            return None
        return layer

    # ------------------------------------------------------------- recording
    def record(self, layer: Any, key: Hashable, position: int, forward: bool, *, half: Optional[str] = None) -> None:
        """Append one call of the episode being recorded (``half``: ``"input"`` or ``"weight"``
        for the halves of a split backward)."""
        self._events.append((layer, key, position, forward, half))

    def forget(self, layer: Any) -> None:
        """``layer`` was reset: drop its calls from the recording (the static buffer slots they
        took stay allocated; inputs recorded as links to its outputs get buffers of their own
        at capture) and from the layers whose graphs a dropped generation concerns."""
        kept, deaths, carried = [], {}, []
        for index, event in enumerate(self._events):
            carried.extend(self._deaths.get(index, ()))
            if event[0] is not layer:
                if carried:
                    deaths[len(kept)], carried = carried, []
                kept.append(event)
        mine = id(layer)
        self._events = kept
        self._deaths = {i: kept_links for i, links in deaths.items()
                        if (kept_links := [link for link in links if link.layer != mine])}
        self._watches = [w for w in self._watches if w[1].layer != mine]
        self._grad_watched = {link for link in self._grad_watched if link.layer != mine}
        self._checks = {k: links for k, links in self._checks.items() if k[0] != mine}
        self._handed = {k: refs for k, refs in self._handed.items() if k[0] != mine}
        self._layers.pop(id(layer), None)

    def buffer_slot(self, spec: Any, *, reuse: bool) -> int:
        """The static buffer a recorded call will copy a tensor of ``spec`` into, as a slot of
        this recording's buffers (allocated at capture). With ``reuse``, a slot released
        earlier in the recording for the same shape, dtype and device is taken over."""
        key = (spec.shape, spec.dtype, spec.device)
        free = self._free_slots.get(key) if reuse else None
        if free:
            return free.pop()
        self._slot_specs.append(spec)
        return len(self._slot_specs) - 1

    def release_slot(self, slot: int) -> None:
        """No graph recorded after this point reads ``slot``'s buffer as its own."""
        spec = self._slot_specs[slot]
        self._free_slots[(spec.shape, spec.dtype, spec.device)].append(slot)

    def note_produced(self, layer: Any, key: Hashable, position: int, kind: str,
                      tensors: Sequence[Any]) -> None:
        """A recorded call produced ``tensors`` (its outputs, or its input gradients)."""
        rt = self.runtime
        for index, t in enumerate(tensors):
            if t is None:
                continue
            try:
                ref = weakref.ref(t)
            except TypeError:  # a tensor type without weak references: nothing is linked
                return
            self._produced_recorded[(kind, rt.alias_key(t))] = (ref, Link(id(layer), key, position, index, kind))

    def link_of(self, kind: str, tensor: Any) -> Optional[Link]:
        """The recorded producer ``tensor`` is an exact alias of, if it is still alive."""
        entry = self._produced_recorded.get((kind, self.runtime.alias_key(tensor)))
        if entry is None or entry[0]() is None:
            return None
        return entry[1]

    def watch_outputs(self, layer: Any, key: Hashable, position: int, outputs: Sequence[Any],
                      others: Sequence[Any]) -> None:
        """A recorded forward returned ``outputs`` (the eager run's; ``others``: its inputs and
        parameters). The moment in the episode after which nothing uses an output's memory any
        more (no reader holds it: not the schedule, not a later layer's saved input, not the
        producer's own backward) is noted, at the start of the next graphed call, as the event recorded
        next (never the one during which it died: that one may still read it); the captured output then
        gives its memory back to the pool at that point of the capture order
        (:class:`~paddle_graphpp.core.batch.CaptureBatch`), as eager memory is freed. An output whose memory is shared
        (a view of an input, two outputs of one storage) or still in use at the end of the
        episode stays the position's for good."""
        watches = self.caps.release.memory_watches(outputs, others) if self.caps.release is not None else None
        if watches is None:
            return
        self._watches.extend((alive, Link(id(layer), key, position, index, "out"))
                             for index, alive in enumerate(watches) if alive is not None)

    def poll_watches(self) -> None:
        """At the start of a graphed call (before it runs anything): the watched outputs found
        dead now died before the event recorded next, which may take their memory."""
        if not self._watches:
            return
        dead = [link for alive, link in self._watches if not alive()]
        if dead:
            self._watches = [w for w in self._watches if w[1] not in dead]
            self._deaths.setdefault(len(self._events), []).extend(dead)

    def handed_out(self, layer: Any, key: Hashable, position: int, outputs: Sequence[Any]) -> None:
        """A launch of ``layer``'s forward at ``position`` handed out ``outputs`` (aliases of its
        static outputs), remembered weakly: memory they alias is overwritten by the position's
        next launch, and, for an output given back to the pool, by the graphs after its release
        point (see :meth:`move_held`, :meth:`before_replay`)."""
        try:
            self._handed[(id(layer), key, position)] = [weakref.ref(t) for t in outputs]
        except TypeError:  # a tensor type without weak references: nothing is tracked
            self._handed.pop((id(layer), key, position), None)

    def move_held(self, layer: Any, key: Hashable, position: int) -> bool:
        """Before a launch of ``layer``'s forward at ``position`` overwrites its output buffers:
        the outputs of its last launch that someone still holds get their values moved to
        memory of their own. False when some were held and the runtime cannot move them."""
        refs = self._handed.pop((id(layer), key, position), None)
        return self._move_refs(refs or [], None)

    def _move_refs(self, refs: list, indices: Optional[Sequence[int]]) -> bool:
        """Move what ``refs[i]`` (``i`` in ``indices``, default all) still reference to memory of
        its own, forgetting those references; False if some were held and could not be moved."""
        held = []
        for i in (range(len(refs)) if indices is None else indices):
            t = refs[i]() if refs[i] is not None else None
            refs[i] = None
            if t is not None:
                held.append(t)
        if not held:
            return True
        if self.caps.release is None:
            return False
        self.caps.release.move_to_copies(held)
        return True

    def before_replay(self, layer: Any, key: Hashable, position: int, kind: str) -> None:
        """Before a graph replays: outputs whose memory was given back to the pool at this point
        of the capture order, if someone still holds what their last replay handed out (a
        schedule that keeps outputs longer than in the recorded step), get their values moved to
        memory of their own first: the graphs from here on may overwrite that memory."""
        by_position: dict = {}
        for link in self._checks.get((id(layer), key, position, kind), ()):
            by_position.setdefault(link[:3], []).append(link.index)
        for (layer_id, k, pos), indices in by_position.items():
            refs = self._handed.get((layer_id, k, pos))
            if refs is not None and not self._move_refs(refs, indices):
                warnings.warn(f"paddle_graphpp: an output of an earlier micro-batch is still referenced where "
                              f"the recorded step had freed it, and the {self.runtime.name} runtime cannot move "
                              f"it to memory of its own: it may now hold other values. Clone an output you "
                              f"keep.", RuntimeWarning, stacklevel=3)

    def watch_grads(self, layer: Any, key: Hashable, position: int, grads: Sequence[Any],
                    others: Sequence[Any]) -> None:
        """A recorded backward produced the input gradients ``grads`` (the eager run's, ``None``
        where an input has none; ``others``: the gradients it received). The moment in the
        episode after which nothing uses a gradient's memory is noted as for outputs (see
        :meth:`watch_outputs`); at capture, a gradient handed to another graph is not given
        back before that point (:meth:`captured`). A gradient that shares its memory (passed
        on unchanged, or two of one storage) is not watched."""
        index = [i for i, g in enumerate(grads) if g is not None]
        release = self.caps.release
        watches = release.memory_watches([grads[i] for i in index], [o for o in others if o is not None]) \
            if index and release is not None else None
        if watches is None:
            return
        for i, alive in zip(index, watches):
            if alive is not None:
                link = Link(id(layer), key, position, i, "grad")
                self._watches.append((alive, link))
                self._grad_watched.add(link)

    # ------------------------------------------------------------- watchdog
    @property
    def watchdog(self) -> Optional[ReplayWatchdog]:
        """The replay watchdog (:mod:`paddle_graphpp.core.watchdog`), decided at first use:
        ``FLAGS_graphpp_replay_timeout`` (seconds; 0: off), else the runtime's default (the
        process group's timeout where a group of several ranks exists). Where several ranks
        exist it also turns a peer's failed capture into an error here, unless
        ``FLAGS_graphpp_capture_agreement=0``."""
        if self._watchdog is _UNRESOLVED:
            self._watchdog = None
            self.watch()
        return self._watchdog

    def watch(self, timeout: Any = _UNRESOLVED, *, grace: float = 30.0) -> Optional[ReplayWatchdog]:
        """(Re)configure the watchdog: ``timeout`` seconds (``None`` or 0: replays are not timed;
        default: the flag, else the runtime's default). Returns the watchdog, or ``None``."""
        events = self.caps.events
        if self._watchdog not in (None, _UNRESOLVED):
            self._watchdog.stop()
        self._watchdog = None
        if events is None:
            return None
        distributed = events.default_replay_timeout()
        if timeout is _UNRESOLVED:
            flag = os.environ.get("FLAGS_graphpp_replay_timeout")
            timeout = parse_timeout(flag, "FLAGS_graphpp_replay_timeout") if flag is not None else distributed
        else:
            timeout = parse_timeout(timeout, "watch_replays(timeout)")
        agree = distributed is not None and env_flag("FLAGS_graphpp_capture_agreement", True)
        if timeout is None and not agree:
            return None
        self._watchdog = ReplayWatchdog(events, timeout if timeout is not None else float("inf"), grace=grace,
                                        peer_failure=self._peer_failure if agree else None,
                                        faults=_collectives.collective_fault)
        return self._watchdog

    def _peer_failure(self) -> Optional[str]:
        """A peer's published capture failure (the watchdog's thread asks), unless this process
        published one of its own (its own error reaches its user)."""
        return None if self._published_failure else self.caps.events.peer_capture_failure()

    def launched(self, participant: Any, position: int, kind: str, graph: Any) -> None:
        """A graph of ``participant`` was replayed: the watchdog follows it."""
        watchdog = self.watchdog
        if watchdog is not None:
            watchdog.launched(lambda: _describe_graph(participant, position, kind, graph))

    def check_watchdog(self) -> None:
        """Raise the watchdog's error, if it has one, in the calling (main) thread; and a custom
        all-reduce's give-up (:func:`~paddle_graphpp.core.collectives.collective_fault`), asked
        here too, so that it raises without a watchdog and without its thread's delay."""
        watchdog = self._watchdog
        if watchdog is not None and watchdog is not _UNRESOLVED:
            watchdog.raise_pending()
        fault = _collectives.collective_fault()
        if fault is not None:
            raise CollectiveTimeoutError(fault)

    # --------------------------------------------------------------- capture
    def capture_if_due(self) -> None:
        """At a graphed forward that may start an episode: when the last episode was recorded and
        nothing is in flight now, capture it before the new episode starts."""
        if self._events and self.clock.between_episodes:
            self.capture_recorded()

    def capture_recorded(self) -> None:
        """Capture every position recorded in the last episode, in recorded order.

        Positions whose backward was not recorded are dropped (they are recorded again when
        they next run). A failure is handled by its layer (``fallback``); the first error
        that must reach the user is raised after the other layers' graphs are captured, and
        after the failed captures' memory is released.
        """
        self.poll_watches()  # what died after the episode's last call
        events, self._events = self._events, []
        specs, self._slot_specs = self._slot_specs, []
        deaths, self._deaths = self._deaths, {}
        self._watches = []  # outputs alive at the end of the episode stay their positions'
        grad_watched, self._grad_watched = self._grad_watched, set()
        self._free_slots.clear()
        self._produced_recorded.clear()
        layers = list({id(p): p for p, *_ in events}.values())
        if self._defer(layers):
            return
        # The recorded episode's activations are free but cached by the allocator: return them
        # so the graphs' pool can take that memory instead of adding to it.
        gc.collect()
        self.runtime.release_cached_memory()
        # The static buffers, in one block allocated on the emptied cache (allocated while the
        # recorded episode ran, they would pin pieces of its activations' cached blocks).
        batch = CaptureBatch(self.runtime, self.caps.release, events, specs, deaths, grad_watched)
        self._prepare_pool(layers)
        try:
            batch.run()
            self._checks.update(batch.checks)
        finally:
            batch.close()  # also when the batch escapes (an interrupt, a warning raised as an error)
        self._finish(layers, batch)

    def _defer(self, layers: list) -> bool:
        """Whether the runtime asks to wait: the recording is dropped and the next episode recorded."""
        lending = self.caps.lending
        wait = lending.defer_capture() if lending is not None and self.deferred < MAX_DEFERRED_EPISODES else None
        if not wait:
            self.deferred = 0
            return False
        if not self.deferred:
            logger.info("paddle_graphpp: captures wait (%s runtime: %s); the next episode is recorded instead",
                        self.runtime.name, wait)
        self.deferred += 1
        for layer in layers:
            layer.recording_dropped()
        return True

    def _prepare_pool(self, layers: list) -> None:
        if self.caps.lending is None or not any(p.memory_mode is _memory.MemoryMode.SHARED for p in layers):
            return
        gen = self.plan.generation_for_capture(_memory.MemoryMode.SHARED)
        if gen is not None and not gen.order:
            self.caps.lending.prepare_pool(gen.pool)

    def _finish(self, layers: list, batch: CaptureBatch) -> None:
        for layer in layers:
            layer.recording_captured()
        self._layers.update({id(layer): layer for layer in layers})
        gen = self.plan.newest_generation()
        if gen is not None and gen.order and self.caps.lending is not None:
            self.caps.lending.lend_pool(gen.pool, lambda: self.clock.between_episodes,
                                        lambda: self._drop_generation(gen))
        if batch.failed:
            gc.collect()
            self.runtime.release_cached_memory()
        self.plan.log_summary()
        if batch.errors and self.caps.events is not None and self.watchdog is not None:
            self._published_failure = True
            self.caps.events.publish_capture_failure(f"{type(batch.errors[0]).__name__}: {batch.errors[0]}"[:500])
        errors = self._agree(batch.errors)
        for extra in errors[1:]:
            warnings.warn(f"another capture failed as well: {extra}", RuntimeWarning, stacklevel=4)
        if errors:
            raise errors[0]

    def _agree(self, errors: list) -> list:
        """With a capture agreement set (:attr:`agreement`), every rank of
        the group raises when any rank's captures raise, so that no rank goes on into a
        collective that waits for a peer that stopped."""
        agreement = self.agreement
        if agreement is None:
            return errors
        failed = agreement(bool(errors))
        if errors:
            errors[0].add_note(f"paddle_graphpp: every rank of the capture agreement group raises with it "
                               f"(ranks whose captures failed: {failed}).")
        elif failed:
            errors = [CaptureError(
                f"capturing CUDA graphs failed on rank(s) {failed} of the capture agreement group, so this rank "
                f"raises too instead of going on into collectives they will not join. The cause is in those "
                f"ranks' CaptureError; fallback='eager' on the failing layers keeps every rank training.")]
        return errors

    def _drop_generation(self, gen: Any) -> None:
        """Eager work left memory allocated in ``gen``'s pool, which its graphs use as
        scratch: drop them (their positions are recorded and captured again, into a new pool)."""
        self.plan.note_aborted(gen)
        for layer in self._layers.values():
            layer.drop_generation(gen)
        logger.warning("paddle_graphpp: graphs of pool generation %d dropped; they are captured anew", gen.index)


def _describe_graph(participant: Any, position: int, kind: str, graph: Any) -> str:
    found = _collectives.collectives_in(graph)
    held = f"captured with {', '.join(found)}" if found else "no collective recorded in its capture"
    return f"the {kind} graph of {participant.name} (micro-batch position {position}; {held})"


_PROCESSES: dict[str, Process] = {}


def process_for(runtime: Any) -> Process:
    """The process-wide state of ``runtime`` (renewed when its memory plan is)."""
    plan = _memory.plan_for(runtime)
    proc = _PROCESSES.get(runtime.name)
    if proc is None or proc.plan is not plan:
        proc = _PROCESSES[runtime.name] = Process(plan)
    return proc
