"""Which graphed layer's graphs add a shared parameter's gradient into ``.grad``.

A parameter's ``.grad`` can be one layer's buffer only (the backward graphs of a layer that
accumulates inside its graphs add into it in place). A weight shared with a layer that already
does so (a tied embedding in two stage modules of one rank) gets its gradient through autograd
in the other layers, which adds into that buffer. :class:`GradOwners` is the process's table.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    from .batch import CaptureParticipant

__all__ = ["GradOwners"]


class GradOwners:
    """Per parameter (by identity, weakly): the participant whose graphs accumulate its gradient."""

    def __init__(self):
        # id(parameter) -> (weak reference to it, to the participant whose graphs accumulate its gradient)
        self._owners: dict[int, tuple] = {}

    def claim(self, participant: "CaptureParticipant", params: Sequence[Any]) -> None:
        """``participant``'s graphs add the gradients of ``params`` into ``.grad`` from now on."""
        for p in params:
            self._owners[id(p)] = (weakref.ref(p), weakref.ref(participant))

    def owner_of(self, param: Any) -> Optional["CaptureParticipant"]:
        """The participant whose graphs add ``param``'s gradient into ``.grad``, if one still does
        (not reset, not turned eager; the entry names this very tensor, not one that took its id)."""
        entry = self._owners.get(id(param))
        if entry is None:
            return None
        owner = entry[1]()
        if entry[0]() is not param or owner is None or not owner.accumulates_in_graphs(param):
            del self._owners[id(param)]
            return None
        return owner
