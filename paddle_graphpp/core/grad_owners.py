"""Which graphed layer's graphs add a shared parameter's gradient into ``.grad``.

A parameter's ``.grad`` can be one layer's buffer only (the backward graphs of a layer that
accumulates inside its graphs add into it in place). A weight shared with a layer that already
does so (a tied embedding in two stage modules of one rank) gets its gradient through autograd
in the other layers, which adds into that buffer. :class:`GradOwners` is the process's table,
and decides, when a signature leaves warmup, whether its graphs accumulate (:meth:`GradOwners.choose`).
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from .runtime import InGraphAccumulation

if TYPE_CHECKING:
    from .participant import CaptureParticipant

__all__ = ["GradOwners"]

logger = logging.getLogger("paddle_graphpp")


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

    def choose(self, participant: "CaptureParticipant", params: Sequence[Any], choice: Union[bool, str],
               accumulation: Optional[InGraphAccumulation], outside: Sequence[Any] = ()) -> bool:
        """Whether ``participant``'s graphs add the gradients of ``params`` into ``.grad``
        (``choice``: its ``accumulate_grads`` option; ``accumulation``: the runtime's capability;
        ``outside``: those of ``params`` whose gradient autograd also gets from outside the layer,
        :attr:`~paddle_graphpp.core.layer.EngineHooks.summed_outside`). Where they will,
        ``participant`` claims ``params``.

        Raises:
            ValueError: ``accumulate_grads=True`` where a parameter has accumulation hooks (a
                data-parallel reducer's), gets part of its gradient from outside the layer, or
                another layer's graphs already accumulate it.
        """
        if choice is False or accumulation is None:
            return False
        name = participant.name
        held = {id(p) for p in params}
        if any(id(p) in held for p in outside):
            # Eagerly autograd sums the parts (G + (h + e)); graphs adding theirs into .grad would
            # sum them in another order ((G + h) + e) from a step's second micro-batch on.
            if choice is True:
                raise ValueError(
                    f"{name}: accumulate_grads=True, but a parameter handed to this layer as an argument also "
                    f"gets gradient from outside it, which autograd sums before adding to .grad; pass "
                    f"accumulate_grads='auto' or False for this layer")
            return False
        hooked = accumulation.params_with_grad_hooks(params)
        if hooked and choice is True:
            raise ValueError(
                f"{name}: accumulate_grads=True bypasses autograd's gradient accumulation, but parameters "
                f"{hooked[:4]} have accumulation hooks (e.g. DistributedDataParallel's); pass "
                f"accumulate_grads='auto' or False for this layer")
        if hooked:
            return False
        # A parameter's .grad can be one layer's buffer only: a weight shared with a layer that
        # already accumulates in its graph (a tied embedding in two stage modules of one rank)
        # gets its gradient through autograd here, which adds into that buffer in place.
        other = next((o for o in map(self.owner_of, params) if o not in (None, participant)), None)
        if other is not None:
            if choice is True:
                raise ValueError(
                    f"{name}: accumulate_grads=True, but a parameter of this layer is also one of "
                    f"{other.name}'s, whose graphs already accumulate its gradient; pass accumulate_grads='auto' "
                    f"(this layer then leaves that parameter's accumulation to autograd) or False")
            logger.info("%s: shares parameters with %s, which accumulates them in its graphs; this layer's "
                        "gradients go through autograd", name, other.name)
            return False
        self.claim(participant, params)
        return True
