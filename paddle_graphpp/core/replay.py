"""The replay side of one graphed layer: launches, what they hand out, and the checks first.

A forward replay (:meth:`Replays.forward`) checks that the layer's parameters and buffers are
still the tensors its graphs read (:mod:`.state`), that its pool generation's capture order
holds (:mod:`.memory`) and that its collectives may run (:mod:`.collectives`), moves outputs an
earlier launch handed out and someone still holds off the memory it overwrites
(:class:`~paddle_graphpp.core.handout.HandedOutputs`), copies the inputs into the static
buffers and launches. Every launch of a graph, forward or backward, in step or replayed, goes
through :meth:`Replays.launch`: the replay, the watchdog's note, the count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from . import collectives as _collectives
from .layer import Layer
from .lifecycle import Lifecycle
from .participant import CaptureParticipant
from .recompute import LayerRecompute
from .records import Call, Position, Replayed, Signature
from .schedule import InFlightQueue
from .state import LayerStateCheck

if TYPE_CHECKING:
    from .capture import EpisodeCapture

__all__ = ["Replays"]


class Replays:
    """The launches of one graphed ``layer``: its ``lifecycle`` counts them; its ``queue`` (the
    episode), ``state`` check and ``recomputing`` mirrors are read; the process's services keep
    what they hand out under the layer's ``participant`` (its capture side)."""

    def __init__(self, layer: Layer, *, lifecycle: Lifecycle, queue: InFlightQueue, state: LayerStateCheck,
                 recomputing: LayerRecompute, participant: CaptureParticipant):
        self.layer = layer
        self.lifecycle = lifecycle
        self.queue = queue
        self.state = state
        self.recomputing = recomputing
        self.participant = participant

    def inputs_in_place(self, call: Call, done: Position) -> bool:
        """The linked inputs are the tensors the graph reads. If not (the data flow between
        layers differs from the captured step's), copying into them would overwrite another
        position's outputs: the call runs eagerly instead."""
        rt = self.layer.runtime
        for index, key in done.linked:
            if rt.alias_key(call.tensors[index]) != key:
                self.lifecycle.warn_once("linked", (
                    f"{self.layer.name}: input {index} is not the tensor the previous graphed layer returned, as it "
                    f"was in the captured step; such calls run eagerly (correct, without the graphs' speed). Pass "
                    f"the previous layer's output unchanged, or give the layer a copy in every step."))
                return False
        return True

    def forward(self, call: Call, done: Position) -> list:
        """Replay ``done``'s forward graph over the call's inputs; the outputs handed out."""
        layer = self.layer
        proc = layer.process()
        proc.outputs.before_replay(self.participant, call.key, call.position, "forward")
        if done.state is not None:
            self.state.check(done.state, self.queue.episode)
        proc.plan.note_replay(done.generation, id(done.fwd_graph), True, layer.name)
        _collectives.check_replay(done.fwd_graph)
        self.keep_held_outputs(call, proc)
        layer.runtime.copy_many(done.static_inputs, call.tensors)
        rng = self.recomputing.mirror().note() if done.recomputes else None  # what the backward's recompute redraws
        self.launch(call, done.fwd_graph, "forward", proc)
        call.run, call.outputs = Replayed(done, rng), done.outputs
        return self.hand_out(call, done.static_outputs, proc)

    def unreplayed(self, call: Call, sig: Optional[Signature], kind: str) -> None:
        """A captured position's graph runs eagerly this time (its inputs are not where the graph
        reads them): the graphs after it still overwrite what was released before it, so the
        outputs held past their release point move as before a replay
        (:meth:`~paddle_graphpp.core.handout.HandedOutputs.before_replay`)."""
        if sig is None or call.position not in sig.positions:
            return
        kinds = ("backward", "input", "weight") if kind == "backward" else (kind,)  # a full backward of split graphs
        outputs = self.layer.process().outputs
        for k in kinds:
            outputs.before_replay(self.participant, call.key, call.position, k)

    def launch(self, call: Call, graph: Any, kind: str, proc: "EpisodeCapture") -> None:
        """Launch one of the call's graphs (``kind`` names it in the watchdog's message:
        ``"forward"``, ``"backward"``, ``"backward (input half)"``, ``"backward (weight half)"``);
        the replay watchdog follows it. ``proc``: the layer's process side
        (:class:`~paddle_graphpp.core.capture.EpisodeCapture`), as the caller has it."""
        self.layer.runtime.replay_graph(graph)
        proc.replay_watch.launched(self.participant, call.position, kind, graph)
        self.lifecycle.replays += 1

    def hand_out(self, call: Call, static_outputs: Sequence[Any], proc: "EpisodeCapture") -> list:
        """Aliases of a launched forward's output buffers for the caller, watched weakly: the
        position's next launch overwrites them (see :meth:`keep_held_outputs`)."""
        return proc.outputs.hand_out(self.participant, call.key, call.position, static_outputs)

    def keep_held_outputs(self, call: Call, proc: "EpisodeCapture") -> None:
        """Before a launch overwrites the position's output buffers: what still uses the outputs
        of its last launch (the tensors handed out, or, with the runtime's
        :class:`~paddle_graphpp.core.runtime.OutputRelease`, any tensor sharing their memory)
        gets their values moved to memory of its own. A pipeline schedule keeps the last stage's
        outputs until the step ends, to return them merged, and on the last stage of a 1F1B
        pipeline every micro-batch replays the same position; eagerly each output is its own
        tensor, and so it stays here (copied only when held)."""
        if not proc.outputs.move_held(self.participant, call.key, call.position):
            self.lifecycle.warn_once("held", (
                f"{self.layer.name}: outputs of an earlier micro-batch are still referenced when the same "
                f"micro-batch position replays and overwrites them, and the {self.layer.runtime.name} runtime "
                f"cannot move them to memory of their own: they now hold the new values. Clone an output you keep."))
