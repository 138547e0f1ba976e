"""The recording of one eager episode: what a batch of captures will capture, in which order.

A :class:`Recording` is opened by the process (:meth:`~paddle_graphpp.core.capture.EpisodeCapture.recorder`)
at the first call of a signature in phase ``RECORD``, and lives until the next episode start, when
a :class:`~paddle_graphpp.core.batch.CaptureBatch` consumes it (:meth:`Recording.captured` moves its
participants ``RECORD -> READY``) or the runtime asks to wait (:meth:`Recording.dropped`). It holds
the :class:`Event` list in the order the schedule ran, the static buffer slots, the :class:`Link`
between layers and the liveness watches: host bookkeeping only, with weak references to the eager
tensors, never the tensors. What each of them means:
docs/architecture.md#episodes-recordings-and-handed-out-outputs.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any, Hashable, NamedTuple, Optional, Sequence

from .participant import CaptureParticipant
from .runtime import GraphRuntime, OutputRelease

__all__ = ["Recording", "Link", "Event"]


class Link(NamedTuple):
    """Where a recorded input came from: output ``index`` (``kind="out"``) or input gradient
    ``index`` (``kind="grad"``) of ``layer``'s ``position`` under signature ``key``."""

    layer: int
    key: Hashable
    position: int
    index: int
    kind: str


class Event(NamedTuple):
    """One recorded call: a forward, or a backward (``half``: ``None`` for a whole one,
    ``"input"`` or ``"weight"`` for the halves of a split one)."""

    participant: "CaptureParticipant"
    key: Hashable
    position: int
    forward: bool
    half: Optional[str] = None


class Recording:
    """One episode's recording (docs/architecture.md#episodes-recordings-and-handed-out-outputs).

    Args:
        runtime: tells aliases apart (:meth:`~paddle_graphpp.core.runtime.GraphRuntime.alias_key`).
        release: the runtime's :class:`~paddle_graphpp.core.runtime.OutputRelease`, or ``None``:
            then no memory is watched and every output stays its position's.
    """

    def __init__(self, runtime: GraphRuntime, release: Optional[OutputRelease]):
        self.runtime = runtime
        self.release = release
        self.events: list[Event] = []
        self.specs: list = []  # spec of each static buffer slot
        self._free_slots: dict[Any, list] = defaultdict(list)
        # Tensors recorded calls produced, by (kind, alias key): (weak reference, Link). The
        # weak reference proves the memory still belongs to that tensor when it is looked up.
        self._produced: dict[tuple, tuple] = {}
        # The watches [(is the memory in use, Link)] and, per event index, the links found dead before it
        self._watches: list = []
        self.deaths: dict[int, list] = {}
        self.grad_watched: set = set()  # the input gradients whose memory is watched (see watch_grads)

    def __bool__(self) -> bool:
        """Whether anything was recorded (a recording whose layers were all reset holds nothing)."""
        return bool(self.events)

    def participants(self) -> list:
        """The participants with recorded calls, each once, in the order they first ran."""
        return list({id(e.participant): e.participant for e in self.events}.values())

    # ------------------------------------------------------------ the calls
    def record(self, participant: "CaptureParticipant", key: Hashable, position: int, forward: bool, *,
               half: Optional[str] = None) -> None:
        """Append one call of the episode."""
        self.events.append(Event(participant, key, position, forward, half))

    def forget(self, participant: "CaptureParticipant") -> None:
        """``participant`` was reset: drop its calls (the static buffer slots they took stay
        allocated; inputs recorded as links to its outputs get buffers of their own at capture)."""
        kept, deaths, carried = [], {}, []
        for index, event in enumerate(self.events):
            carried.extend(self.deaths.get(index, ()))
            if event.participant is not participant:
                if carried:
                    deaths[len(kept)], carried = carried, []
                kept.append(event)
        mine = id(participant)
        self.events = kept
        self.deaths = {i: kept_links for i, links in deaths.items()
                       if (kept_links := [link for link in links if link.layer != mine])}
        self._watches = [w for w in self._watches if w[1].layer != mine]
        self.grad_watched = {link for link in self.grad_watched if link.layer != mine}

    # ------------------------------------------------------------ the slots
    def buffer_slot(self, spec: Any, *, reuse: bool) -> int:
        """The static buffer a recorded call will copy a tensor of ``spec`` into, as a slot of
        this recording's buffers (allocated at capture). With ``reuse``, a slot released
        earlier in the recording for the same shape, dtype and device is taken over."""
        key = (spec.shape, spec.dtype, spec.device)
        free = self._free_slots.get(key) if reuse else None
        if free:
            return free.pop()
        self.specs.append(spec)
        return len(self.specs) - 1

    def release_slot(self, slot: int) -> None:
        """No graph recorded after this point reads ``slot``'s buffer as its own."""
        spec = self.specs[slot]
        self._free_slots[(spec.shape, spec.dtype, spec.device)].append(slot)

    # ------------------------------------------------------------ the links
    def note_produced(self, participant: "CaptureParticipant", key: Hashable, position: int, kind: str,
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
            self._produced[(kind, rt.alias_key(t))] = (ref, Link(id(participant), key, position, index, kind))

    def link_of(self, kind: str, tensor: Any) -> Optional[Link]:
        """The recorded producer ``tensor`` is an exact alias of, if it is still alive."""
        entry = self._produced.get((kind, self.runtime.alias_key(tensor)))
        if entry is None or entry[0]() is None:
            return None
        return entry[1]

    # ------------------------------------------------------------ the watches
    def watch_outputs(self, participant: "CaptureParticipant", key: Hashable, position: int, outputs: Sequence[Any],
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
        watches = self.release.memory_watches(outputs, others) if self.release is not None else None
        if watches is None:
            return
        self._watches.extend((alive, Link(id(participant), key, position, index, "out"))
                             for index, alive in enumerate(watches) if alive is not None)

    def watch_grads(self, participant: "CaptureParticipant", key: Hashable, position: int, grads: Sequence[Any],
                    others: Sequence[Any]) -> None:
        """A recorded backward produced the input gradients ``grads`` (the eager run's, ``None``
        where an input has none; ``others``: the gradients it received). The moment in the
        episode after which nothing uses a gradient's memory is noted as for outputs (see
        :meth:`watch_outputs`); at capture, a gradient handed to another graph is not given
        back before that point (:meth:`~paddle_graphpp.core.batch.CaptureBatch.captured`). A
        gradient that shares its memory (passed on unchanged, or two of one storage) is not watched."""
        index = [i for i, g in enumerate(grads) if g is not None]
        release = self.release
        watches = release.memory_watches([grads[i] for i in index], [o for o in others if o is not None]) \
            if index and release is not None else None
        if watches is None:
            return
        for i, alive in zip(index, watches):
            if alive is not None:
                link = Link(id(participant), key, position, i, "grad")
                self._watches.append((alive, link))
                self.grad_watched.add(link)

    def poll_watches(self) -> None:
        """At the start of a graphed call (before it runs anything), and once more when the
        episode ends: the watched outputs found dead now died before the event recorded next,
        which may take their memory."""
        if not self._watches:
            return
        dead = [link for alive, link in self._watches if not alive()]
        if dead:
            self._watches = [w for w in self._watches if w[1] not in dead]
            self.deaths.setdefault(len(self.events), []).extend(dead)

    # ------------------------------------------------------------ the end
    def dropped(self) -> None:
        """Not captured (the runtime asked to wait): the participants forget their recorded
        positions; the next episode is recorded instead."""
        for participant in self.participants():
            participant.recording_dropped()

    def captured(self) -> None:
        """The batch that consumed this recording is over: ``RECORD -> READY`` for every
        participant (its recorded positions replay from now on)."""
        for participant in self.participants():
            participant.recording_captured()
