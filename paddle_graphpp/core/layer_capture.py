"""Capturing one graphed layer's recorded positions: its side of a capture batch.

:class:`LayerCapture` is what a :class:`~paddle_graphpp.core.batch.CaptureBatch` sees of a layer
(the :class:`~paddle_graphpp.core.participant.CaptureParticipant` protocol): it captures a recorded
position's forward graph over the batch's static inputs, then its backward (whole, or as an
input half and a weight half), into the batch's pool generation, and turns a failure into what
the user sees (:meth:`LayerCapture.failed`). The process-wide bookkeeping it reads and writes
during a batch (static buffers, links between layers, outputs that give their memory back) is
the batch's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from functools import partial
from typing import TYPE_CHECKING, Any, ContextManager, Optional, Sequence

from . import collectives as _collectives
from . import guards as _guards
from . import memory as _memory
from .errors import CaptureError, GraphedLayerError, StateReplacedError, release_frames
from .layer import GradBuffers, Layer
from .lifecycle import Lifecycle
from .recompute import LayerRecompute
from .records import CaptureFailed, InputHalf, Live, Outputs, Position, Signature, UserError, with_layer
from .runtime import CaptureHints, backward_into
from .state import LayerStateCheck

if TYPE_CHECKING:
    from .batch import CaptureBatch

__all__ = ["LayerCapture"]

logger = logging.getLogger("paddle_graphpp")


class LayerCapture:
    """The capture side of one graphed ``layer``: it moves signatures through the layer's
    ``lifecycle``, reads its ``state`` check and ``recomputing`` mirrors, and writes the parameter
    gradients into its gradient ``buffers``."""

    def __init__(self, layer: Layer, *, lifecycle: Lifecycle, state: LayerStateCheck, recomputing: LayerRecompute,
                 buffers: GradBuffers):
        self.layer = layer
        self.lifecycle = lifecycle
        self.state = state
        self.recomputing = recomputing
        self.buffers = buffers
        self.rt = layer.runtime
        self.caps = layer.caps

    @property
    def name(self) -> str:
        return self.layer.name

    @property
    def memory_mode(self) -> "_memory.MemoryMode":
        return self.layer.memory_mode

    # ---------------------------------------------------- the batch's protocol
    def forward(self, key: Any, position: int, batch: "CaptureBatch") -> Optional[Live]:
        """Capture the forward of recorded ``position``; its autograd graph stays live for the
        backward. ``None``: the layer's train/eval mode changed since the recording (the
        position is recorded again when it next runs)."""
        layer, rt = self.layer, self.rt
        sig = self.lifecycle.get(key)
        rec = sig.recordings[position]
        training, mode = key[3]
        if getattr(layer.fn, "training", None) != training:
            return None
        static_inputs = tuple(batch.static_for(slot, spec) for slot, spec in zip(rec.input_slots, sig.shape.specs))
        with self.caps.mode_context(mode), layer.hooks.capture_view():
            live = self.capture_forward(sig, static_inputs, rec.outputs)
        # Inputs read in place from another graph's output; one whose producer was not captured got
        # a buffer of its own and is copied into at replay like any other.
        linked = tuple((i, rt.alias_key(t)) for i, (slot, t) in enumerate(zip(rec.input_slots, static_inputs))
                       if batch.is_linked(slot))
        statics, owned = list(live.static_outputs), [None] * len(live.static_outputs)
        release = self.caps.release
        for index, t in enumerate(statics):
            dies = release is not None and batch.dies_in_episode(self, key, position, index)
            alias = release.weak_alias(t) if dies else None
            if alias is not None:  # its memory goes back to the pool where the recorded step freed it
                statics[index], owned[index] = alias, t
                batch.own_output(self, key, position, index, owned)
        live = dataclasses.replace(live, linked=linked, static_outputs=tuple(statics), owned=owned)
        batch.captured(self, key, position, "out", live.static_outputs)
        return live

    def backward(self, key: Any, position: int, live: Live, batch: "CaptureBatch") -> None:
        """Capture the whole backward of ``position``, completing it."""
        sig = self.lifecycle.get(key)
        rec = sig.recordings.pop(position)
        static_grads = tuple(batch.static_for(slot, spec) for slot, spec in zip(rec.grad_slots, rec.grad_specs))
        with self.layer.hooks.capture_view():
            done = sig.positions[position] = self.capture_backward(sig, live, static_grads)
        batch.captured(self, key, position, "grad", done.static_grad_inputs)
        batch.consumed(rec.grad_slots)

    def backward_input(self, key: Any, position: int, live: Live, batch: "CaptureBatch") -> InputHalf:
        """Capture the input half of ``position``'s split backward."""
        sig = self.lifecycle.get(key)
        rec = sig.recordings[position]
        static_grads = tuple(batch.static_for(slot, spec) for slot, spec in zip(rec.grad_slots, rec.grad_specs))
        with self.layer.hooks.capture_view():
            half = self._capture_input_half(sig, live, static_grads)
        batch.captured(self, key, position, "grad", half.static_grad_inputs)
        return half

    def backward_weight(self, key: Any, position: int, half: InputHalf, batch: "CaptureBatch") -> None:
        """Capture the weight half, completing ``position``."""
        sig = self.lifecycle.get(key)
        rec = sig.recordings.pop(position)
        with self.layer.hooks.capture_view():
            sig.positions[position] = self._capture_weight_half(sig, half)
        batch.consumed(rec.grad_slots)  # the weight half may read them too (saved at a junction)

    def grad_slots(self, key: Any, position: int) -> tuple:
        """The slots of the incoming gradients recorded for ``position`` (empty: none recorded)."""
        sig = self.lifecycle.get(key)
        rec = None if sig is None else sig.recordings.get(position)
        return (rec.grad_slots or ()) if rec is not None else ()

    def recording_dropped(self) -> None:
        """The recorded episode is not captured (the runtime asked to wait): the next one is
        recorded instead."""
        self.lifecycle.dropped()

    def recording_captured(self) -> None:
        """The capture batch is over: recorded signatures replay from now on."""
        self.lifecycle.captured()

    def drop_generation(self, gen: Any) -> None:
        """Forget the positions captured into ``gen`` (they are recorded again when they run)."""
        self.lifecycle.drop_generation(gen)

    def accumulates_in_graphs(self, param: Any) -> bool:
        return self.lifecycle.accumulates(param)

    # ------------------------------------------------------------ the captures
    def capture_forward(self, sig: Signature, static_inputs: Sequence[Any], outputs: Optional[Outputs]) -> Live:
        """Capture the forward over ``static_inputs``; its autograd graph stays live for the
        backward capture. ``outputs``: the structure the eager run returned (``None``: none
        ran, the capture defines it)."""
        layer, rt, plan = self.layer, self.rt, self.layer.process().plan
        self._check_params(sig)
        gen = plan.generation_for_capture(layer.memory_mode)
        # recompute: no autograd graph, so the forward's activations go back to the pool inside
        # the capture; the backward capture runs the forward again (see capture_backward)
        recompute = sig.key.recompute and self.caps.recomputation is not None
        with self._captured(gen, "forward") as graph:
            with self.caps.recomputation.no_grad() if recompute else rt.enable_grad():
                inputs = [rt.detach(b, s.requires_grad) for b, s in zip(static_inputs, sig.shape.specs)]
                args, kwargs = sig.shape.rebuild(inputs)
                result, params = rt.call_with_param_aliases(layer.fn, sig.params, args, kwargs)
            # checked before the capture counts as done (an error here ends it like the layer's own)
            captured, outs = layer.outputs_of(result)
            if outputs is not None and (captured.spec != outputs.spec or captured.tensor_index != outputs.tensor_index):
                raise CaptureError(f"{layer.name}: the captured forward returned a different structure than the "
                                   f"eager run; a graphed layer must return the same structure every call.")
        return Live(gen, graph, tuple(static_inputs), inputs, outs, list(params), outputs or captured,
                    state=self.state.watch(), static_outputs=tuple(rt.detach(o) for o in outs),
                    recomputes=recompute)

    def _check_params(self, sig: Signature) -> None:
        """The parameters fixed when ``sig`` left warmup must still be the layer's: a graph
        captured over a replaced one would read memory the layer no longer uses."""
        current = {id(p) for p in self.layer.params()}
        gone = [i for i, p in enumerate(sig.params or ()) if id(p) not in current]
        if gone:
            raise StateReplacedError(
                f"{self.layer.name}: {len(gone)} of the parameters it was warmed up with (parameter {gone[0]}) "
                f"are no longer its own: they were replaced after warmup. Replace parameters before the "
                f"first call, or call paddle_graphpp.reset_graphs(model) after replacing them.")

    def capture_backward(self, sig: Signature, live: Live, static_grads: Sequence[Any]) -> Position:
        """Capture the backward of ``live``'s forward; returns the position's record."""
        rt, plan = self.rt, self.layer.process().plan
        param_buffers = self.buffers.for_params(sig.params)
        shape = live.outputs_shape
        mirror = self.recomputing.mirror() if live.recomputes else None
        with self._captured(live.generation, "backward", around=mirror.swapped() if mirror else None) as graph:
            if live.recomputes:  # the forward again, drawing what the forward graph drew (the mirrors)
                live = self._recomputed(sig, live)
            outs = [o for o, d in zip(live.outputs, shape.differentiable) if d]
            wrt = [x for x, s in zip(live.inputs, sig.shape.specs) if s.requires_grad]
            # Parameter gradients go into the layer's buffers as autograd produces them (added:
            # the buffers are the parameters' .grad at replay; or copied), so the graph holds one
            # parameter's gradient at a time, as eager autograd does. Under the stream-ordered
            # allocator, freeing the forward graph's saved tensors inside this capture would put
            # another graph's allocations into this one; they are released after the capture
            # instead (with ``live``).
            if outs:
                input_grads, param_used = backward_into(
                    rt, outs, list(static_grads), wrt, live.params, param_buffers, accumulate=sig.accumulate,
                    retain_graph=plan.async_allocator)
            else:
                input_grads, param_used = [None] * len(wrt), [False] * len(live.params)
            param_used = tuple(param_used)
        it = iter(input_grads)
        return Position(
            generation=live.generation, fwd_graph=live.graph, bwd_graph=graph, static_inputs=live.static_inputs,
            static_outputs=live.static_outputs, static_grad_outputs=tuple(static_grads),
            static_grad_inputs=tuple(next(it) if s.requires_grad else None for s in sig.shape.specs),
            param_grad_used=param_used, outputs=shape, accumulate=sig.accumulate, linked=live.linked,
            state=live.state, owned=live.owned, recomputes=mirror is not None)

    def _recomputed(self, sig: Signature, live: Live) -> Live:
        """``live`` with the autograd graph of the forward run again over its static inputs (inside
        the backward capture, under the forward's autocast mode)."""
        layer, rt = self.layer, self.rt
        with self.caps.mode_context(sig.key[3][1]), rt.enable_grad():
            inputs = [rt.detach(b, s.requires_grad) for b, s in zip(live.static_inputs, sig.shape.specs)]
            args, kwargs = sig.shape.rebuild(inputs)
            result, params = rt.call_with_param_aliases(layer.fn, sig.params, args, kwargs)
        _, outs = layer.outputs_of(result)
        return dataclasses.replace(live, inputs=inputs, outputs=outs, params=list(params))

    def _capture_input_half(self, sig: Signature, live: Live, static_grads: Sequence[Any]) -> InputHalf:
        """Capture the input half of ``live``'s backward; its autograd graph stays live for
        the weight half."""
        rt, split = self.rt, self.caps.split
        outs = [o for o, d in zip(live.outputs, live.outputs_shape.differentiable) if d]
        wrt = [x for x, s in zip(live.inputs, sig.shape.specs) if s.requires_grad]
        param_used = (False,) * len(live.params)
        with self._captured(live.generation, "backward (input half)") as graph:
            if outs:
                input_grads, param_grads, state = split.backward_input(outs, list(static_grads), wrt, live.params)
                param_used = tuple(g is not None for g in param_grads)
                if any(param_used):
                    # into the layer's parameter-gradient buffers, handed to autograd at replay
                    # (as a full backward's are without accumulation)
                    if sig.accumulate:
                        raise RuntimeError(f"{rt.name} runtime: backward_input returned parameter gradients "
                                           f"for a layer that accumulates inside its graphs")
                    buffers = self.buffers.for_params(sig.params)
                    rt.copy_many([buffers[i] for i, u in enumerate(param_used) if u],
                                 [g for g in param_grads if g is not None])
                del param_grads
            else:
                input_grads, state = [None] * len(wrt), None
        it = iter(input_grads)
        # the weight half starts from the state: the outputs' memory may go (see Live.owned)
        return InputHalf(dataclasses.replace(live, outputs=[]), graph, tuple(static_grads),
                         tuple(next(it) if s.requires_grad else None for s in sig.shape.specs), state, param_used)

    def _capture_weight_half(self, sig: Signature, half: InputHalf) -> Position:
        """Capture the weight half: every parameter's gradient added into the layer's gradient
        buffers (with accumulation: the buffers a full backward adds into, ``.grad`` at replay),
        or copied into weight-gradient buffers of its own (the schedule's weight pass adds them
        into ``.grad``). The autograd graph kept since the forward is released inside this
        capture, as a full backward releases it."""
        rt, live = self.rt, half.live
        buffers = tuple(self.buffers.for_params(sig.params) if sig.accumulate else self.buffers.for_weights(sig.params))
        move = rt.add_many if sig.accumulate else rt.copy_many
        used = [False] * len(sig.params)
        with self._captured(live.generation, "backward (weight half)") as graph:
            state, half = half.weight_state, dataclasses.replace(half, weight_state=None)
            if state is not None:
                for index, grads in self.caps.split.backward_weight(state, live.params):
                    move([buffers[i] for i in index], grads)
                    for i in index:
                        used[i] = True
            del state  # drops the last references to the autograd graph
        return Position(
            generation=live.generation, fwd_graph=live.graph, bwd_graph=half.graph, static_inputs=live.static_inputs,
            static_outputs=live.static_outputs, static_grad_outputs=half.static_grads,
            static_grad_inputs=half.static_grad_inputs, param_grad_used=tuple(used),
            outputs=live.outputs_shape, accumulate=sig.accumulate, linked=live.linked, weight_graph=graph,
            weight_buffers=buffers, state=live.state, input_param_used=half.param_used, owned=live.owned)

    @contextlib.contextmanager
    def _captured(self, gen: Any, phase: str, around: Optional[ContextManager] = None):
        """One capture into pool generation ``gen``: a new graph (yielded) captured inside the
        block (see :meth:`_capturing`), then noted with its duration and counted. ``around``:
        entered before the capture begins (the RNG mirrors the graph registers)."""
        graph = self.rt.create_graph()
        start = _memory.now()
        with around or contextlib.nullcontext(), self._capturing(graph, gen, phase):
            yield graph
        self.layer.process().plan.note_capture(gen, id(graph), _memory.now() - start)
        self.lifecycle.captures += 1

    @contextlib.contextmanager
    def _capturing(self, graph: Any, gen: Any, phase: str):
        """Around every capture: compiled code traces the branch that will be captured
        (core.guards), custom all-reduce buffers reserved inside belong to ``graph``
        (core.collectives). Sorts failures: the runtime's and the device's
        (:meth:`~paddle_graphpp.core.runtime.CaptureHints.is_capture_failure`) are failures of
        capture; anything else was raised by the layer's own code."""
        layer, rt = self.layer, self.rt
        hints = self.caps.hints
        of_capture = hints.is_capture_failure if hints is not None else partial(CaptureHints.is_capture_failure, None)
        try:
            with _guards.sot_warmup_guard(True), _collectives.capturing_graph(graph, layer.name), \
                    rt.capture_to_graph(graph, layer.process().plan.pool_for(gen), generators=layer.generators()):
                try:
                    yield
                except GraphedLayerError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    if of_capture(exc):
                        raise
                    raise UserError(phase, exc) from exc
        except (UserError, GraphedLayerError):
            raise
        except Exception as exc:  # noqa: BLE001
            raise CaptureFailed(phase, exc, gen) from exc

    # --------------------------------------------------------------- failures
    def failed(self, key: Any, exc: BaseException) -> Optional[BaseException]:
        """A capture of signature ``key`` failed. Forget its graphs; returns the error to
        raise, or ``None`` when ``fallback="eager"`` turned the layer eager."""
        layer = self.layer
        release_frames(exc)  # the frames below the capture hold its buffers and outputs
        if isinstance(exc, CaptureFailed):
            layer.process().plan.note_aborted(exc.generation)
        if not isinstance(exc, CaptureFailed):
            self.lifecycle.warm_up_again(key)
            if isinstance(exc, UserError):  # the layer's own code raised: its error, raised as is
                return with_layer(exc.error, f"{layer.name}: raised while capturing the {exc.phase}")
            return exc  # the engine's own errors (GraphedLayerError) and interrupts
        instead = layer.hooks.another_way(exc.error) if layer.hooks.another_way is not None else None
        if instead is not None:
            return self.lifecycle.capture_failed(key, f"the {exc.phase}", exc.error, instead, instead=True)
        hints = self.caps.hints
        own = layer.hooks.capture_hint
        hint = (own(exc.error) if own is not None else None) or (
            hints.capture_failure_hint(exc.error, layer.generators()) if hints is not None else None) or (
            "Graphs cannot contain host synchronisation (.item(), .numpy(), printing a tensor, "
            "data-dependent shapes such as nonzero/masked_select) or CPU work. Move it out of the "
            "layer, or pass fallback='eager'.")
        return self.lifecycle.capture_failed(key, f"the {exc.phase}", exc.error, hint)
