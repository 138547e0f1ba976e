"""Outputs that replays handed out, kept valid while their graph memory is overwritten.

A replayed forward hands the caller aliases of its graph's static outputs. Two things later
overwrite that memory: the next launch of the same position, and, for an output that gave
its memory back to the pool at a point of the capture order (see
:class:`~paddle_graphpp.core.batch.CaptureBatch`), the graphs captured after that point. A
schedule that holds an output longer than the recorded step did (a pipeline's last stage
returning its outputs merged) would read other values. :class:`HandedOutputs` remembers, weakly,
what each position's last forward launch handed out, and before such an overwrite moves what
someone still holds to memory of its own (the runtime's
:meth:`~paddle_graphpp.core.runtime.OutputRelease.move_to_copies`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Hashable, Optional, Sequence

from .runtime import GraphRuntime, OutputRelease
from .warn import warn

if TYPE_CHECKING:
    from .batch import CaptureParticipant

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
        # per (participant id, key, position), weak references to what its last forward launch handed out
        self._handed: dict[tuple, list] = {}

    def forget(self, participant: "CaptureParticipant") -> None:
        """``participant`` was reset: its graphs are gone."""
        mine = id(participant)
        self.checks = {k: links for k, links in self.checks.items() if k[0] != mine}
        self._handed = {k: refs for k, refs in self._handed.items() if k[0] != mine}

    def handed_out(self, participant: "CaptureParticipant", key: Hashable, position: int,
                   outputs: Sequence[Any]) -> None:
        """A launch of ``participant``'s forward at ``position`` handed out ``outputs`` (aliases
        of its static outputs), remembered weakly: memory they alias is overwritten by the
        position's next launch, and, for an output given back to the pool, by the graphs after
        its release point (see :meth:`move_held`, :meth:`before_replay`)."""
        try:
            self._handed[(id(participant), key, position)] = [weakref.ref(t) for t in outputs]
        except TypeError:  # a tensor type without weak references: nothing is tracked
            self._handed.pop((id(participant), key, position), None)

    def move_held(self, participant: "CaptureParticipant", key: Hashable, position: int) -> bool:
        """Before a launch of ``participant``'s forward at ``position`` overwrites its output
        buffers: the outputs of its last launch that someone still holds get their values moved
        to memory of their own. False when some were held and the runtime cannot move them."""
        refs = self._handed.pop((id(participant), key, position), None)
        return self._move_refs(refs or [], None)

    def before_replay(self, participant: "CaptureParticipant", key: Hashable, position: int, kind: str) -> None:
        """Before a graph replays: outputs whose memory was given back to the pool at this point
        of the capture order, if someone still holds what their last replay handed out (a
        schedule that keeps outputs longer than in the recorded step), get their values moved to
        memory of their own first: the graphs from here on may overwrite that memory."""
        by_position: dict = {}
        for link in self.checks.get((id(participant), key, position, kind), ()):
            by_position.setdefault(link[:3], []).append(link.index)
        for (layer_id, k, pos), indices in by_position.items():
            refs = self._handed.get((layer_id, k, pos))
            if refs is not None and not self._move_refs(refs, indices):
                warn(f"paddle_graphpp: an output of an earlier micro-batch is still referenced where "
                              f"the recorded step had freed it, and the {self.runtime.name} runtime cannot move "
                              f"it to memory of its own: it may now hold other values. Clone an output you "
                              f"keep.")

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
        if self.release is None:
            return False
        self.release.move_to_copies(held)
        return True
