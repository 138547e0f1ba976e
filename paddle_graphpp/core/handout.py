"""Outputs that replays handed out, kept valid while their graph memory is overwritten.

:class:`HandedOutputs` remembers, weakly, what each position's last forward launch handed out,
and before the next launch of that position (or a graph captured after the output gave its
memory back to the pool) has the runtime move what is still in use to memory of its own. With
:class:`~paddle_graphpp.core.runtime.OutputRelease` every tensor sharing an output's memory is
watched, and what cannot be moved raises when read; without it only the handed-out objects are
watched, and one still held when its memory is overwritten is named in a warning. How:
docs/architecture.md#episodes-recordings-and-handed-out-outputs.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Hashable, Optional, Sequence

from .runtime import GraphRuntime, OutputRelease
from .warn import warn

if TYPE_CHECKING:
    from .participant import CaptureParticipant

__all__ = ["HandedOutputs"]


class HandedOutputs:
    """Per runtime: what forward launches handed out, and which outputs each graph's replay
    may overwrite after a release point (``checks``, from the capture batches)."""

    def __init__(self, runtime: GraphRuntime, release: Optional[OutputRelease]):
        self.runtime = runtime
        self.release = release
        # per (participant id, key, position, kind) of a captured graph, the outputs whose memory
        # later graphs may take once it has run (checked before it replays)
        self.checks: dict[tuple, tuple] = {}
        # per (participant id, key, position): the participant's name and, per output its last
        # forward launch handed out, a watch (a function returning what to move, or None)
        self._handed: dict[tuple, tuple[str, list]] = {}

    def forget(self, participant: "CaptureParticipant") -> None:
        """``participant`` was reset: its graphs are gone."""
        mine = id(participant)
        self.checks = {k: links for k, links in self.checks.items() if k[0] != mine}
        self._handed = {k: entry for k, entry in self._handed.items() if k[0] != mine}

    def hand_out(self, participant: "CaptureParticipant", key: Hashable, position: int,
                 static_outputs: Sequence[Any]) -> list:
        """A launch of ``participant``'s forward at ``position`` wrote ``static_outputs``: the
        aliases of them the caller gets, watched weakly. Memory they alias is overwritten by the
        position's next launch, and, for an output given back to the pool, by the graphs after
        its release point (see :meth:`move_held`, :meth:`before_replay`)."""
        if self.release is not None:
            outs, watches = self.release.hand_out(static_outputs)
        else:
            outs = [self.runtime.detach(o) for o in static_outputs]
            watches = _object_watches(outs)
        self._handed[(id(participant), key, position)] = (participant.name, watches)
        return outs

    def move_held(self, participant: "CaptureParticipant", key: Hashable, position: int) -> bool:
        """Before a launch of ``participant``'s forward at ``position`` overwrites its output
        buffers: what still uses the outputs of its last launch gets their values moved to
        memory of its own. False when some were held and the runtime cannot move them."""
        entry = self._handed.pop((id(participant), key, position), None)
        return entry is None or self._move(entry, None)

    def before_replay(self, participant: "CaptureParticipant", key: Hashable, position: int, kind: str) -> None:
        """Before a graph replays: outputs whose memory was given back to the pool at this point
        of the capture order, if something still uses what their last replay handed out (a
        schedule that keeps outputs longer than in the recorded step), get their values moved to
        memory of their own first: the graphs from here on may overwrite that memory."""
        by_position: dict = {}
        for link in self.checks.get((id(participant), key, position, kind), ()):
            by_position.setdefault(link[:3], []).append(link.index)
        for (layer_id, k, pos), indices in by_position.items():
            entry = self._handed.get((layer_id, k, pos))
            if entry is not None and not self._move(entry, indices):
                warn(f"paddle_graphpp: {entry[0]}: an output of an earlier micro-batch is still referenced where "
                     f"the recorded step had freed it, and the {self.runtime.name} runtime cannot move it to memory "
                     f"of its own: it may now hold other values. Clone an output you keep.")

    def _move(self, entry: tuple[str, list], indices: Optional[Sequence[int]]) -> bool:
        """Move what the watches ``entry[1][i]`` (``i`` in ``indices``, default all) still see to
        memory of its own, forgetting those watches; False if something was held and the runtime
        cannot move it."""
        name, watches = entry
        held = []
        for i in (range(len(watches)) if indices is None else indices):
            found = watches[i]() if watches[i] is not None else None
            watches[i] = None
            if found is not None:
                held.append(found)
        if not held:
            return True
        if self.release is None:
            return False
        self.release.move_to_copies(held, _overwritten(name))
        return True


def _object_watches(outs: Sequence[Any]) -> list:
    """Watches over the handed-out objects themselves (a runtime without
    :class:`~paddle_graphpp.core.runtime.OutputRelease`): tensors made from them are not seen."""
    try:
        return [weakref.ref(t) for t in outs]
    except TypeError:  # a tensor type without weak references: nothing is watched
        return [None] * len(outs)


def _overwritten(name: str) -> str:
    return (f"paddle_graphpp: {name}: this tensor shares memory with an output that a CUDA graph replay of the "
            f"layer handed out, and a later graph replay has overwritten that memory. Clone what you keep "
            f"of a graphed layer's outputs past its next micro-batch (out.detach().clone(), not .detach() or a "
            f"view).")
