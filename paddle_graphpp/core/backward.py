"""The backward of one graphed call: replayed, eager (and recorded), or in two halves.

A call's backward pairs with its forward through the layer's FIFO (:mod:`.schedule`). What it
does follows from how the forward ran (:mod:`.records`): a replayed forward replays its
position's backward graph, an eager one runs autograd (and, when recorded, notes the incoming
gradients' buffer slots for the capture), and under the stream-ordered allocator the backward
is captured and launched in the step (:mod:`.in_step`).

Zero-bubble schedules run a backward in two halves. Where the runtime can tell
(:class:`~paddle_graphpp.core.runtime.SplitBackward`), a backward that asks for input gradients
only runs the *input half* (B) and keeps what the *weight half* (W) needs; the next backward
through the same call (the schedule's weight pass) runs W. With gradient accumulation in the
graphs (:class:`~paddle_graphpp.core.runtime.InGraphAccumulation`) parameter gradients go into
``.grad`` inside the backward; otherwise they are handed to autograd.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Sequence

from . import collectives as _collectives
from . import memory as _memory
from .errors import GraphScheduleError
from .grad_moves import GradientMoves
from .in_step import InStepCapture
from .layer import GradBuffers, Layer
from .layer_capture import LayerCapture
from .lifecycle import Lifecycle
from .recompute import LayerRecompute
from .records import Call, Launched, Position, RanEager, Replayed, Signature
from .replay import Replays
from .runtime import clone_many
from .schedule import InFlightQueue
from .state import LayerStateCheck

if TYPE_CHECKING:
    from .capture import EpisodeCapture

__all__ = ["Backward"]


class Backward:
    """The backward paths of one graphed ``layer``: calls leave its ``queue``; signatures are read
    from its ``lifecycle``; graphs are launched by its ``replay`` side, recorded positions noted
    for its ``capture`` side, captured in the step by ``in_step``; its ``state`` check,
    ``recomputing`` mirrors and gradient ``buffers`` are read."""

    def __init__(self, layer: Layer, *, lifecycle: Lifecycle, queue: InFlightQueue, state: LayerStateCheck,
                 buffers: GradBuffers, recomputing: LayerRecompute, replay: Replays, capture: LayerCapture,
                 in_step: InStepCapture):
        self.layer = layer
        self.lifecycle = lifecycle
        self.queue = queue
        self.state = state
        self.buffers = buffers
        self.recomputing = recomputing
        self.replay_side = replay
        self.capture = capture
        self.in_step = in_step
        self.rt = layer.runtime
        self.split = layer.caps.split
        self.accumulation = layer.caps.accumulation
        self.moves = GradientMoves(layer.runtime, layer.caps.accumulation)

    # ---------------------------------------------------------------- dispatch
    def run(self, call: Call, grads: Sequence[Any], weights_wanted: bool = True) -> list:
        """One backward through ``call``: a full one, or a half of a split one. ``weights_wanted``:
        does autograd ask for the parameters' gradients? Asking for none runs the input half."""
        self.layer.process().poll_watches()
        if self.queue.awaits_weight(call):
            return self._weight_half(call)  # the schedule's weight pass, after the input pass
        split = not weights_wanted and bool(call.params) and self.split is not None
        if split:
            self._check_split(call)
        self.queue.pop(call, weight_later=split)
        sig = self.lifecycle.get(call.key)
        diff_grads = [g for g, d in zip(grads, call.differentiable) if d]
        if isinstance(call.run, RanEager) and not call.run.recorded:
            self.replay_side.unreplayed(call, sig, "input" if split else "backward")
        if split:
            try:
                return self._input_half(call, sig, diff_grads)
            except BaseException:
                # The micro-batch's backward is over (failed): it must not wait for a weight half.
                self.queue.pop_weight(call)
                self._leave_flight(call, sig)
                call.end()
                raise
        self._leave_flight(call, sig)
        try:
            return self._full(call, sig, diff_grads)
        finally:
            call.end()

    def _check_split(self, call: Call) -> None:
        name = self.layer.name
        if self.buffers.hooked:
            raise GraphScheduleError(
                f"{name}: a backward asked for input gradients only (a zero-bubble schedule's input pass) of a "
                f"layer whose graphs add parameter gradients into the buffers their accumulation hooks add into "
                f"(Megatron-Core's main_grad), which a split backward's weight pass does not go through. Pass "
                f"accumulate_grads=False to this layer to run split backwards.")
        if call.key.recompute:
            raise GraphScheduleError(
                f"{name}: a backward asked for input gradients only (a zero-bubble schedule's input pass) of a "
                f"layer that recomputes its forward (activation checkpointing), which graphed layers do not split. "
                f"Turn checkpointing off for graphed layers under zero-bubble schedules, or use 1F1B or "
                f"interleaved 1F1B.")
        if isinstance(call.run, Launched):
            raise GraphScheduleError(
                f"{name}: a backward asked for input gradients only (a zero-bubble schedule's input pass), "
                f"which the stream-ordered allocator (use_cuda_malloc_async_allocator) cannot serve: its graphs are "
                f"captured within the step, as one backward. Use the default caching allocator with "
                f"zero-bubble schedules, or a schedule with full backwards (1F1B, interleaved 1F1B).")
        if isinstance(call.run, Replayed) and call.run.position.weight_graph is None:
            raise GraphScheduleError(
                f"{name}: micro-batch position {call.position} was captured with a full backward, but "
                f"this step's backward asks for input gradients only (a zero-bubble schedule's input "
                f"pass). Graphs replay the schedule they were captured under: run the same schedule every "
                f"step (a schedule change needs new graphs: build the stage anew).")

    def _full(self, call: Call, sig: Optional[Signature], diff_grads: list) -> list:
        run = call.run
        if isinstance(run, Replayed):
            return self.replay(call, run.position, diff_grads)
        if isinstance(run, Launched):
            return self.replay(call, self.in_step.backward(call, sig, diff_grads), diff_grads)
        recorded = run.recorded and sig is not None
        # a layer adding into hooked buffers runs its eager backwards as eager does: the hooks add
        result = self._eager(call, diff_grads, into_grads=recorded and sig.accumulate and not self.buffers.hooked)
        if recorded:
            self.record(call, sig, diff_grads, result[:len(call.shape.specs)])
        return result

    def _leave_flight(self, call: Call, sig: Optional[Signature]) -> None:
        """The call's backward is complete (a full backward, or the weight half of a split one)."""
        call.anchor = None
        self.layer.process().clock.forward_done()
        if sig is not None:
            sig.busy.discard(call.position)

    # ------------------------------------------------------------- split halves
    def _input_half(self, call: Call, sig: Optional[Signature], diff_grads: list) -> list:
        """The input half of a split backward: input gradients now, parameter gradients left
        for :meth:`_weight_half`."""
        if isinstance(call.run, Replayed):
            return self.replay_input(call, call.run.position, diff_grads)
        run = call.run
        outs = [o for o, d in zip(run.outputs, call.differentiable) if d]
        wrt = [x for x, s in zip(run.inputs, call.shape.specs) if s.requires_grad]
        state = None
        if outs:
            got, param_grads, state = self.split.backward_input(outs, diff_grads, wrt, run.params)
        else:
            got, param_grads = [None] * len(wrt), [None] * len(call.params)
        # The weight half starts from the state, not the outputs: they are free to go now, as a
        # full backward's are after it (the recording then sees when their memory is unused).
        call.run = dataclasses.replace(run, outputs=None, weight_state=state)
        del outs, run
        it = iter(got)
        input_grads = [next(it) if s.requires_grad else None for s in call.shape.specs]
        if call.recorded and sig is not None:
            self.record(call, sig, diff_grads, input_grads, half="input")
        return input_grads + list(param_grads)

    def _weight_half(self, call: Call) -> list:
        """The weight half of a split backward. Without accumulation: the parameter gradients
        it produces, handed to autograd (the schedule's weight pass adds them into ``.grad``).
        With it (``accumulate_grads``): the gradients go into ``.grad`` and the weight pass gets
        the sums (see :meth:`~paddle_graphpp.core.grad_moves.GradientMoves.hand_over`)."""
        layer = self.layer
        sig = self.lifecycle.get(call.key)
        run = call.run
        accumulates = run.position.accumulate if isinstance(run, Replayed) else (
            call.recorded and sig is not None and sig.accumulate)
        if accumulates and not self.split.weight_pass_refills_grad():
            # Refused before anything changed: the micro-batch still awaits its weight pass.
            wp = self.split.refilling_weight_pass
            raise GraphScheduleError(
                f"{layer.name}: adds its parameter gradients into .grad inside its graphs (accumulate_grads), "
                f"so its weight half (a backward asking for the parameters after an input-only one) hands "
                f"the weight pass each parameter's whole sum, for it to put back into .grad, as {wp} does; this "
                f"backward is not that weight pass, and per-micro-batch parameter gradients do not exist here. "
                f"Run the weight pass through {wp}, or pass accumulate_grads=False to this layer.")
        self.queue.pop_weight(call)
        self._leave_flight(call, sig)
        if isinstance(run, RanEager) and not run.recorded:
            self.replay_side.unreplayed(call, sig, "weight")
        n_inputs = len(call.shape.specs)
        try:
            if isinstance(run, Replayed):
                return [None] * n_inputs + self.replay_weight(call, run.position, hand_over=True)
            grads = self._eager_weight(call, run, accumulates)
            if call.recorded and sig is not None:
                self.record(call, sig, [], [], half="weight")
            return [None] * n_inputs + grads
        finally:
            call.end()

    def _eager_weight(self, call: Call, run: RanEager, accumulates: bool) -> list:
        """The eager weight half. A recorded call of a layer whose graphs will accumulate: each
        group of gradients goes into ``.grad`` as it comes, as the graphs will do (not the whole
        stage's at once)."""
        grads = [None] * len(call.params)
        if run.weight_state is not None:
            for index, got in self.split.backward_weight(run.weight_state, run.params):
                if accumulates:
                    self.moves.add_into_grads([call.params[i] for i in index], got)
                    got = [self.accumulation.grad_of(call.params[i]) for i in index]
                for i, g in zip(index, got):
                    grads[i] = g
        if accumulates:
            self.layer.process().grad_writes += 1  # .grad changed outside autograd (see EpisodeCapture.grad_writes)
            grads = self.moves.hand_over(call.params, grads)
        return grads

    # ------------------------------------------------------------------ eager
    def _eager(self, call: Call, diff_grads: list, into_grads: bool = False) -> list:
        """The eager backward. With ``into_grads`` (a recorded call of a layer whose graphs will
        accumulate into ``.grad``) each parameter gradient goes into ``.grad`` as autograd
        produces it, as the graphs will do, instead of all of the run's gradients being handed
        back together (a whole stage's parameter gradients alive at once)."""
        run = call.run
        outs = [o for o, d in zip(run.outputs, call.differentiable) if d]
        inputs = [x for x, s in zip(run.inputs, call.shape.specs) if s.requires_grad]
        if into_grads and outs:
            got = iter(self.accumulation.backward_to_grads(outs, diff_grads, inputs, run.params, call.params))
            self.layer.process().grad_writes += 1  # .grad changed outside autograd (see EpisodeCapture.grad_writes)
            return [next(got) if s.requires_grad else None for s in call.shape.specs] + [None] * len(call.params)
        wrt = inputs + list(run.params)
        got = iter(self.rt.autograd_grad(outs, diff_grads, wrt) if outs else [None] * len(wrt))
        input_grads = [next(got) if s.requires_grad else None for s in call.shape.specs]
        return input_grads + list(got)

    def record(self, call: Call, sig: Signature, diff_grads: list, input_grads: list,
               half: Optional[str] = None) -> None:
        """Record a backward: a full one (``half=None``), or the ``"input"`` or ``"weight"``
        half of a split one. The static buffers of the position are released when its backward
        is complete: the weight half still reads the inputs and the incoming gradients."""
        rec = sig.recordings.get(call.position)
        if rec is None:
            return
        rt, recording = self.rt, self.layer.process().recorder()
        reuse = self.layer.memory_mode is not _memory.MemoryMode.PER_GRAPH
        if half != "weight":
            specs = tuple(rt.spec(g) for g in diff_grads)
            grad_slots = tuple((recording.link_of("grad", g) if reuse else None)
                               or recording.buffer_slot(s, reuse=reuse)
                               for g, s in zip(diff_grads, specs))
            rec = sig.recordings[call.position] = dataclasses.replace(
                rec, grad_slots=grad_slots, grad_specs=specs)
            if reuse:
                recording.note_produced(self.capture, call.key, call.position, "grad", input_grads)
                recording.watch_grads(self.capture, call.key, call.position, input_grads, diff_grads)
        if reuse and half != "input":
            # Positions recorded after this backward may take these buffers over: the inputs
            # are read by nothing after this backward, the gradients by nothing outside it.
            for slot in rec.input_slots + rec.grad_slots:
                if isinstance(slot, int):
                    recording.release_slot(slot)
        recording.record(self.capture, call.key, call.position, forward=False, half=half)

    # ----------------------------------------------------------------- replay
    def _prepare(self, call: Call, position: Position, graph: Any, kind: str, *, finishes: bool = True) -> "EpisodeCapture":
        """Before a backward graph replays: held outputs moved off memory it overwrites, the
        pool's capture order checked (raises before anything changed), collectives checked.
        Returns the layer's process side, for the launch."""
        layer, proc = self.layer, self.layer.process()
        proc.outputs.before_replay(self.capture, call.key, call.position, kind)
        proc.plan.note_replay(position.generation, id(graph), False, layer.name, finishes=finishes)
        _collectives.check_replay(graph)
        return proc

    def replay(self, call: Call, position: Position, diff_grads: list) -> list:
        """Replay the position's backward graph (both halves where it was captured split)."""
        if position.weight_graph is not None:  # captured as two halves; this step wants both at once
            n = len(call.shape.specs)
            first = self.replay_input(call, position, diff_grads)
            return first[:n] + self.moves.sum_grads(first[n:], self.replay_weight(call, position))
        if position.state is not None:  # the parameters may be set anew between forward and backward (FSDP2)
            self.state.check(position.state, self.queue.episode, "backward")
        proc = self._prepare(call, position, position.bwd_graph, "backward")
        if position.static_grad_outputs:
            self.rt.copy_many(position.static_grad_outputs, diff_grads)
        buffers, hooked = self.buffers.params, position.accumulate and self.buffers.hooked
        if hooked:  # the graph adds into the library's buffers: still the ones it was captured with?
            self.buffers.check_hooked(call.params, self.queue.episode, self.layer.name)
        elif position.accumulate:  # the graph adds into the buffers: make them the parameters' .grad first
            used = [(p, b) for p, b, u in zip(call.params, buffers, position.param_grad_used) if u]
            self.moves.bind_grads([p for p, _ in used], [b for _, b in used])
        if position.recomputes:
            self.recomputing.mirror().restore(call.run.rng)
        self.replay_side.launch(call, position.bwd_graph, "backward", proc)
        if position.accumulate:
            proc.grad_writes += 1  # gradients changed without a version bump
        if hooked:  # zeros, so that the accumulation hooks run (bucket readiness) and add nothing
            param_grads = [self.accumulation.zero_grad_like(p) if u else None
                           for p, u in zip(call.params, position.param_grad_used)]
        elif position.accumulate:
            param_grads = [None] * len(call.params)
        else:
            param_grads = [b if u else None for b, u in zip(buffers, position.param_grad_used)]
        return self.moves.hand_off(list(call.tensors) + list(call.params),
                              list(position.static_grad_inputs) + param_grads)

    def replay_input(self, call: Call, position: Position, diff_grads: list) -> list:
        proc = self._prepare(call, position, position.bwd_graph, "input", finishes=False)
        if position.static_grad_outputs:
            self.rt.copy_many(position.static_grad_outputs, diff_grads)
        self.replay_side.launch(call, position.bwd_graph, "backward (input half)", proc)
        used = position.input_param_used or (False,) * len(call.params)
        buffers = self.buffers.params if any(used) else [None] * len(call.params)
        return self.moves.hand_off(list(call.tensors) + list(call.params),
                              list(position.static_grad_inputs) + [b if u else None for b, u in zip(buffers, used)])

    def replay_weight(self, call: Call, position: Position, hand_over: bool = False) -> list:
        """Replay the weight half. Without accumulation: the parameter gradients, in buffers
        the layer keeps (copies where a parameter has no ``.grad`` yet: the caller may make the
        gradient it gets its ``.grad``, as the zero-bubble weight pass does, and the next replay
        would overwrite it). With accumulation the graph adds them into the layer's gradient
        buffers, bound as ``.grad`` first; a schedule's weight pass (``hand_over``) is handed
        each parameter's whole sum with ``.grad`` unset
        (:meth:`~paddle_graphpp.core.grad_moves.GradientMoves.hand_over`)."""
        proc = self._prepare(call, position, position.weight_graph, "weight")  # may raise: nothing changed yet
        if position.accumulate:
            used = [(p, b) for p, b, u in zip(call.params, position.weight_buffers, position.param_grad_used) if u]
            self.moves.bind_grads([p for p, _ in used], [b for _, b in used])
        self.replay_side.launch(call, position.weight_graph, "backward (weight half)", proc)
        grads = [b if u else None for b, u in zip(position.weight_buffers, position.param_grad_used)]
        if position.accumulate:
            proc.grad_writes += 1  # .grad changed without a version bump
            return self.moves.hand_over(call.params, grads) if hand_over else [None] * len(call.params)
        fresh = [i for i in self.rt.leaves_without_grad(call.params) if grads[i] is not None]
        if fresh:
            for i, c in zip(fresh, clone_many(self.rt, [grads[i] for i in fresh])):
                grads[i] = c
        return grads
