"""One batch of captures: every position recorded in an episode, captured in the recorded order.

A :class:`CaptureBatch` is created by :meth:`paddle_graphpp.core.capture.EpisodeCapture.capture_recorded`
for one recorded episode (it consumes that episode's
:class:`~paddle_graphpp.core.recording.Recording`) and discarded after it. It holds what is
valid during the batch only:
the static buffers of the recording's slots (allocated at its start, in one block), the static
tensors captured so far (so that a link — layer ``i + 1`` reading layer ``i``'s output, or a
gradient one graph hands another — resolves to the producer's captured tensor itself), the
outputs and gradients that give their memory back to the pool at the point of the capture
order where the recorded step freed them, and which positions may still read what.

Each layer takes part through :class:`~paddle_graphpp.core.participant.CaptureParticipant` (implemented by
:class:`~paddle_graphpp.core.layer_capture.LayerCapture`): the batch asks it to capture a
position's forward, then its backward (whole, or in two halves), and hands a failure back to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Optional, Sequence

from .participant import CaptureParticipant
from .recording import Link, Recording
from .runtime import GraphRuntime, OutputRelease

__all__ = ["CaptureBatch"]


@dataclass(slots=True, eq=False)
class _Handed:
    """During capture: an input gradient one graph produced, as other graphs may read it."""

    tensor: Any
    waiting: set = field(default_factory=set)  # positions that may still read it
    linked: bool = False  # a captured graph reads it through a link (see CaptureBatch.consumed)
    deaths: set = field(default_factory=set)  # its links whose recorded death it waits for
    kept: bool = False  # its eager twin was in use to the end of the episode: never given back


class CaptureBatch:
    """The captures of one recorded episode (see the module docstring).

    Args:
        runtime: the runtime (static buffers).
        release: its :class:`~paddle_graphpp.core.runtime.OutputRelease`, or ``None`` (then
            every output and gradient keeps its memory).
        recording: the episode's recording: its events in recorded order, its slots' specs, per
            event index the links found dead before it, the gradient links whose memory it watched.
    """

    def __init__(self, runtime: GraphRuntime, release: Optional[OutputRelease], recording: Recording):
        self.runtime = runtime
        self.release = release
        self.events = recording.events
        self.buffers = runtime.static_buffers(recording.specs) if recording.specs else []
        self.deaths = recording.deaths
        self.grad_watched = recording.grad_watched
        self.produced: dict[Link, Any] = {}  # captured static tensors, by link
        self.live: dict[tuple, Any] = {}  # positions whose forward is captured and backward is not
        self.pending: set = set()  # positions whose backward may still be captured
        self.readers: dict[Link, set] = {}  # per recorded gradient link, the positions reading it
        self.grad_readers: dict[int, _Handed] = {}  # the produced input gradients, by identity
        self.grad_dead: set = set()  # the gradient links found dead so far
        self.dying: set = set()  # the outputs that give their memory back
        self.owners: dict = {}  # per such output, the list holding its memory until its release point
        self.failed: set = set()  # (participant id, key) whose capture failed
        self.errors: list = []  # what must reach the user, in order
        self.checks: dict = {}  # (participant id, key, position, kind) -> outputs released before it

    # ------------------------------------------------ what participants call
    def static_for(self, slot: Any, spec: Any) -> Any:
        """The static tensor of a recorded slot: a buffer, or for a :class:`Link` the producer's
        captured tensor (a buffer of its own when the producer was not captured)."""
        if isinstance(slot, Link):
            tensor = self.produced.get(slot)
            return tensor if tensor is not None else self.runtime.static_buffers([spec])[0]
        return self.buffers[slot]

    def is_linked(self, slot: Any) -> bool:
        """Whether the static tensor of ``slot`` is another captured graph's tensor (read in place)."""
        return isinstance(slot, Link) and slot in self.produced

    def dies_in_episode(self, participant: CaptureParticipant, key: Hashable, position: int, index: int) -> bool:
        """The recorded output gives its memory back (it was found dead before a graph captured
        after it)."""
        return Link(id(participant), key, position, index, "out") in self.dying

    def own_output(self, participant: CaptureParticipant, key: Hashable, position: int, index: int,
                   owners: list) -> None:
        """``owners[index]`` holds the memory of that output until its release point."""
        self.owners[Link(id(participant), key, position, index, "out")] = (owners, index)

    def captured(self, participant: CaptureParticipant, key: Hashable, position: int, kind: str,
                 tensors: Sequence[Any]) -> None:
        """``tensors`` are the static outputs (or input gradients) of a position just captured,
        for the links recorded to them.

        An input gradient read by a link is given back to the pool (:meth:`_release_unread`)
        once nothing reads it. Where the recording watched its eager twin's memory and saw it
        freed within the episode, that is at that point of the capture order (eager readers
        included) and not before its readers' whole backwards: the positions recorded reading
        it and its producer (a weight half may restart from a gradient that passed a junction
        unchanged). A twin still in use at the end of the episode keeps its memory for good; one
        that could not be watched waits for every position in flight when it was made."""
        slot = (id(participant), key, position)
        for index, t in enumerate(tensors):
            if t is None:
                continue
            link = Link(id(participant), key, position, index, kind)
            self.produced[link] = t
            if kind != "grad":
                continue
            readers = {r for r in self.readers.get(link, ()) if r in self.pending}
            if slot in self.pending:
                readers.add(slot)
            entry = self.grad_readers.setdefault(id(t), _Handed(t))
            if link in self.dying:
                entry.deaths.add(link)
            elif link in self.grad_watched:
                entry.kept = True
            else:
                readers.update(self.live)
            entry.waiting.update(readers)

    def consumed(self, slots: Sequence[Any]) -> None:
        """A position whose incoming gradients were ``slots`` has its whole backward captured. A
        gradient another captured graph produced for it (a ``"grad"`` :class:`Link`) flows from
        graph to graph only; once no graph captured later can read it, its memory goes back to
        the pool for those graphs (:meth:`_release_unread`)."""
        for slot in slots:
            if isinstance(slot, Link) and slot.kind == "grad":
                tensor = self.produced.get(slot)
                entry = None if tensor is None else self.grad_readers.get(id(tensor))
                if entry is not None:
                    entry.linked = True
        self._release_unread()

    # ----------------------------------------------------------------- the run
    def run(self) -> None:
        """Capture the events in order; failures are handed to their participant, the errors
        that must reach the user kept in :attr:`errors`."""
        complete = {(id(p), key, pos) for p, key, pos, forward, half in self.events
                    if not forward and half != "input"}
        deaths = self._plan_deaths(complete)
        self._note_readers(complete)
        captured: set = set()  # per_graph slots come back within an episode: capture each once
        released: list = []  # outputs whose memory went back to the pool since the last captured graph
        first: Optional[tuple] = None  # the first graph captured: the next episode's first replay
        for index, event in enumerate(self.events):
            released.extend(self._deaths_before(deaths.get(index, ())))
            participant, key, pos, forward, half = event
            slot = (id(participant), key, pos)
            if slot not in complete or slot in captured or (id(participant), key) in self.failed:
                continue
            if not self._capture(event, slot, captured):
                continue
            check = (id(participant), key, pos, "forward" if forward else (half or "backward"))
            first = first or check
            if released:  # this graph is the first that may overwrite them
                self.checks[check] = (*self.checks.get(check, ()), *released)
                released = []
        if released and first is not None:  # released after the last graph: the next episode's first overwrites
            self.checks[first] = (*self.checks.get(first, ()), *released)
        self.grad_dead.update(self.late)
        self._release_unread()

    def _plan_deaths(self, complete: set) -> dict:
        """The deaths that concern graphs of this batch, keyed by event index; sets
        :attr:`dying` and :attr:`late`."""
        # An output freed after the last event that may be captured stays owned: no graph of
        # this batch would take its memory, and eager work between episodes (an optimizer step
        # borrowing the pool) could, while a schedule still holds it.
        last = max((i for i, (p, key, pos, *_) in enumerate(self.events) if (id(p), key, pos) in complete),
                   default=-1)
        # A gradient freed after that event was read by no graph after it: it goes back after the
        # batch's last graph (its eager readers run before the step ends).
        self.late = [link for i, links in self.deaths.items() if i > last for link in links if link.kind == "grad"]
        deaths = {i: links for i, links in self.deaths.items() if i <= last}
        self.dying = {link for links in deaths.values() for link in links} | set(self.late)
        return deaths

    def _deaths_before(self, links: Sequence[Link]) -> list:
        """Apply the deaths noted before an event; returns the outputs given back."""
        dead = [link for link in links if link.kind == "out"]
        for link in dead:
            entry = self.owners.pop(link, None)
            if entry is not None:
                entry[0][entry[1]] = None
        dead_grads = [link for link in links if link.kind == "grad"]
        if dead_grads:
            self.grad_dead.update(dead_grads)
            self._release_unread()
        return dead

    def _capture(self, event: tuple, slot: tuple, captured: set) -> bool:
        """Capture one event; True when a graph was captured. A failure is handed to the
        participant, and its signature's other positions are dropped from the batch."""
        participant, key, pos, forward, half = event
        live = self.live
        try:
            if forward:
                state = participant.forward(key, pos, self)
                if state is None:  # recorded again when it next runs: reads nothing in this batch
                    self._complete(slot)
                    return False
                live[slot] = state
            elif slot not in live:
                return False
            elif half == "input":
                live[slot] = participant.backward_input(key, pos, live[slot], self)
            else:
                (participant.backward_weight if half == "weight" else participant.backward)(
                    key, pos, live.pop(slot), self)
                captured.add(slot)
                self._complete(slot)
            return True
        except BaseException as exc:  # noqa: BLE001 - the participant decides what a failure means
            self._failed(participant, key, slot, exc)
            return False

    def _failed(self, participant: CaptureParticipant, key: Any, slot: tuple, exc: BaseException) -> None:
        self.failed.add((id(participant), key))
        self.live.pop(slot, None)
        self._complete(slot)
        for other in [s for s in self.live if s[:2] == (id(participant), key)]:
            del self.live[other]
            self._complete(other)
        self._abandon_pool(getattr(exc, "generation", None))
        for other in [s for s in self.pending if s[:2] == (id(participant), key)]:
            self._complete(other)  # its positions not captured yet will not be
        error = participant.failed(key, exc)
        exc = None  # the traceback's frames hold the failed capture's tensors
        if error is not None:
            self.errors.append(error)

    def _abandon_pool(self, generation: Any) -> None:
        """A capture into pool ``generation`` failed: the pool takes no further capture (a capture
        that failed can leave the framework's allocator recording into it, so that the next
        capture into it fails as well). The positions whose forward was captured into it and
        whose backward was not are dropped: they are recorded again when they next run, and
        captured into a new pool. Graphs captured later in this batch read their own buffers
        instead of those positions' outputs."""
        if generation is None:
            return
        dropped = {s for s, state in self.live.items() if getattr(state, "generation", None) is generation}
        for slot in dropped:
            del self.live[slot]
            self._complete(slot)
        for link in [link for link in self.produced if (link.layer, link.key, link.position) in dropped]:
            del self.produced[link]

    # ------------------------------------------------------ reading and release
    def _note_readers(self, complete: set) -> None:
        """Before the captures: which positions read each recorded gradient link (their
        recorded incoming gradients), among the positions whose backward will be captured."""
        self.pending = set(complete)
        for participant, key, pos, forward, half in self.events:
            if forward or half == "weight":
                continue
            for slot in participant.grad_slots(key, pos):
                if isinstance(slot, Link) and slot.kind == "grad" and (id(participant), key, pos) in complete:
                    self.readers.setdefault(slot, set()).add((id(participant), key, pos))

    def _complete(self, slot: tuple) -> None:
        """The position ``slot`` reads nothing more (its whole backward is captured, or its
        capture failed)."""
        self.pending.discard(slot)
        for entry in self.grad_readers.values():
            entry.waiting.discard(slot)
        self._release_unread()

    def _release_unread(self) -> None:
        """Give back the gradients read by a link that nothing reads any more (see
        :meth:`captured` for what each waits for). At replay the producer writes it and its
        readers read it before any graph captured later runs. The tensors the positions keep of
        it stay, as aliases that do not own the memory."""
        if self.release is None:
            return
        done = [key for key, e in self.grad_readers.items()
                if e.linked and not e.waiting and not e.kept and e.deaths <= self.grad_dead]
        for key in done:
            self.release.release_to_pool(self.grad_readers.pop(key).tensor)

    def close(self) -> None:
        """Drop every tensor the batch holds (also when it escaped with an exception): nothing of
        it may reach the next batch. The captured positions hold the tensors they use."""
        self.buffers, self.produced, self.live, self.grad_readers = (), {}, {}, {}
        self.pending, self.readers, self.grad_dead, self.dying, self.owners = set(), {}, set(), set(), {}
