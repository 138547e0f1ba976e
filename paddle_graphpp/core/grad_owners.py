"""Which graphed layer's graphs add a shared parameter's gradient into ``.grad``.

A layer's graphs may add its parameters' gradients into ``.grad`` themselves (in place, into
one buffer per parameter). That is eager's sum only where the layer's part is the whole gradient
of that backward: eagerly, autograd first sums every part a backward produces for a parameter and
then adds the sum to ``.grad`` (``G + (h + e)``), where graphs adding their part in place would
give ``(G + h) + e``. So a parameter that another live graphed layer holds too (a weight tied
between blocks, a tied embedding in two stage modules of one rank), or that a front door says gets
gradient from outside the layer (:attr:`~paddle_graphpp.core.layer.EngineHooks.summed_outside`),
gets its gradient through autograd in every layer that holds it (the choice is per layer: such a
layer hands out all its parameters' gradients; its signatures share its buffers, so they all
accumulate or none). :class:`GradOwners` is the process's table, and decides, when a signature
leaves warmup, whether its graphs accumulate (:meth:`GradOwners.choose`).

Where a library hooks a parameter's accumulation and adds ``.grad`` into a buffer of its own
(Megatron-Core's ``DistributedDataParallel`` and ``main_grad``), the graphs add into that buffer
instead, as the hook would (:attr:`GradPath.HOOKED`), and hand autograd zeros so the hook still
runs; the same rules of sharing hold.
"""

from __future__ import annotations

import enum
import gc
import logging
import weakref
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from .process import current_process
from .runtime import InGraphAccumulation
from .warn import warn

if TYPE_CHECKING:
    from .participant import CaptureParticipant

__all__ = ["GradOwners", "GradPath"]

logger = logging.getLogger("paddle_graphpp")


class GradPath(enum.Enum):
    """Where a layer's graphs put its parameters' gradients."""

    #: into the layer's buffers, handed to autograd, which adds them into ``.grad`` (or runs hooks)
    AUTOGRAD = "autograd"
    #: added into the layer's buffers, which are the parameters' ``.grad`` at replay
    GRAD = "grad"
    #: added into the buffers a library's accumulation hooks add into; autograd gets zeros
    HOOKED = "hooked"


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
               accumulation: Optional[InGraphAccumulation], outside: Sequence[Any] = (),
               fixed: Optional[GradPath] = None) -> GradPath:
        """Where ``participant``'s graphs put the gradients of ``params`` (``choice``: its
        ``accumulate_grads`` option; ``accumulation``: the runtime's capability; ``outside``: those
        of ``params`` whose gradient autograd also gets from outside the layer,
        :attr:`~paddle_graphpp.core.layer.EngineHooks.summed_outside`; ``fixed``: where the layer's
        signatures past warmup put them, ``None`` before the first). A layer's signatures share one
        set of gradient buffers, so once one is fixed the others follow it. Where they accumulate,
        ``participant`` claims ``params``.

        Raises:
            ValueError: ``accumulate_grads=True`` where a parameter has accumulation hooks (a
                data-parallel reducer's) without a buffer of their own to add into, gets part of its
                gradient from outside the layer, or another layer's graphs already accumulate it;
                hooks on a parameter of a layer whose graphs add into ``.grad`` already; hooks or
                their buffers gone from a layer whose graphs add into those buffers.
        """
        if choice is False or accumulation is None or fixed is GradPath.AUTOGRAD:
            return GradPath.AUTOGRAD
        name = participant.name
        hooked = accumulation.params_with_grad_hooks(params)
        # Every parameter's hook adds into a buffer of its library's own: the graphs add there.
        path = GradPath.HOOKED if hooked and all(accumulation.hooked_buffer(p) is not None for p in params) \
            else GradPath.GRAD
        if hooked and fixed is GradPath.GRAD:
            raise ValueError(
                f"{name}: parameters {hooked[:4]} have accumulation hooks (e.g. DistributedDataParallel's) now, "
                f"but this layer's graphs add their gradients into .grad, bypassing them, since before the hooks "
                f"were added. Call paddle_graphpp.reset_graphs(model) after adding the hooks.")
        if fixed is GradPath.HOOKED and path is not GradPath.HOOKED:
            raise ValueError(
                f"{name}: this layer's graphs add its gradients into the buffers its parameters' accumulation "
                f"hooks add into (Megatron-Core's main_grad), but those hooks or buffers are gone. Call "
                f"paddle_graphpp.reset_graphs(model) after changing the data-parallel wrapper.")
        if hooked and path is GradPath.GRAD:
            if choice is True:
                raise ValueError(
                    f"{name}: accumulate_grads=True bypasses autograd's gradient accumulation, but parameters "
                    f"{hooked[:4]} have accumulation hooks (e.g. DistributedDataParallel's); pass "
                    f"accumulate_grads='auto' or False for this layer")
            return GradPath.AUTOGRAD
        # A layer graphed after another one that holds the same weight left warmup: that one's
        # graphs add into .grad already (a parameter's .grad can be one layer's buffer only).
        other = next((o for o in map(self.owner_of, params) if o not in (None, participant)), None)
        if other is not None and fixed is None:
            if choice is True:
                raise ValueError(
                    f"{name}: accumulate_grads=True, but a parameter of this layer is also one of "
                    f"{other.name}'s, whose graphs already accumulate its gradient; pass accumulate_grads='auto' "
                    f"(this layer then leaves that parameter's accumulation to autograd) or False")
            warn(f"{name}: shares parameters with {other.name}, whose graphs began adding their gradients into "
                 f".grad before this layer was graphed; this layer's parts go through autograd. Where both run in "
                 f"one backward the sum differs from eager's in the last bits: graph both before the first "
                 f"training step.")
            return GradPath.AUTOGRAD
        held = {id(p) for p in params}
        shared = [p for p in outside if id(p) in held] or _held_by_other_layers(participant, held)
        if shared and fixed is not None:
            warn(f"{name}: a parameter of this layer (shape {tuple(shared[0].shape)}) is held by another graphed "
                 f"layer made after this layer's graphs began adding gradients into .grad; they go on doing so. "
                 f"Where both run in one backward the sum differs from eager's in the last bits: graph both before "
                 f"the first training step, or call paddle_graphpp.reset_graphs(model).")
        elif shared:
            # Eagerly autograd sums the parts (G + (h + e)); graphs adding theirs into .grad would
            # sum them in another order ((G + h) + e) wherever both parts come in one backward.
            if choice is True:
                raise ValueError(
                    f"{name}: accumulate_grads=True, but a parameter of this layer (shape "
                    f"{tuple(shared[0].shape)}) also gets gradient from outside it (another graphed layer "
                    f"holds it, or it is handed to this one as an argument), which autograd sums before adding "
                    f"to .grad; pass accumulate_grads='auto' or False for this layer")
            logger.info("%s: shares parameters with another graphed layer (or is handed one); its gradients go "
                        "through autograd", name)
            return GradPath.AUTOGRAD
        self.claim(participant, params)
        return path


def _held_by_other_layers(participant: "CaptureParticipant", held: set) -> list:
    """The parameters (of those with ids in ``held``) that another live graphed layer holds too.
    A wrapper dropped without ``undo()`` lives on in a reference cycle until the collector runs:
    a hit is checked again after one collection."""
    def scan() -> list:
        found = {id(p): p for engine in list(current_process().engines)
                 if engine.capture is not participant and engine.retired is None
                 for p in engine.params() if id(p) in held}
        return list(found.values())

    found = scan()
    if found:
        gc.collect()
        found = scan()
    return found
