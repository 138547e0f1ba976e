"""The graph engine: one graphed layer's life, from warmup to replay.

One :class:`GraphedCallable` serves one wrapped layer. Calls are grouped by input
*signature* (tensor shapes, dtypes, devices and requires-grad, non-tensor arguments, the
argument structure, train/eval mode and mixed precision), and each signature goes through
these phases (:class:`Phase`):

``WARMUP``
    The first ``num_warmup_steps`` forwards run eagerly.
``RECORD``
    From the next *episode* start (a moment when no micro-batch is in flight in any graphed
    layer of the process) the episode runs eagerly, and each call is recorded with its
    *position* (its index among this layer's calls of the signature in the episode) and the
    static buffers that position will use (:mod:`paddle_graphpp.core.capture`).
``READY``
    At the start of the following episode, every recorded position of every layer is
    captured, in the order the step ran them, into one pool generation; no eager pass runs
    beside the capture, and nothing is replayed before all of them are captured. From then
    on a forward copies its inputs into its position's static buffers and replays the
    forward graph; its backward copies the incoming gradients in and replays the backward
    graph. A position never seen before runs eagerly and is recorded, to be captured at
    the next episode start into a new generation.

Under the stream-ordered allocator (cudaMallocAsync) graph memory exists only once a graph
has run, so a signature goes from ``WARMUP`` straight to ``READY`` and each new position is
captured and launched in the step it first runs in (its launch gives that step's results).

A new signature is warmed up and captured anew, up to ``max_signatures``; past that it runs
eagerly with one warning. A signature is never replayed into another's graph.

Backwards pair with forwards through the layer's FIFO (:mod:`paddle_graphpp.core.schedule`),
so 1F1B and interleaved schedules work. Memory modes are described in
:mod:`paddle_graphpp.core.memory`.

Zero-bubble schedules run a backward in two halves. Where the runtime can tell (PyTorch: the
custom function asks autograd whether the parameters' gradients are wanted), a backward that
asks for input gradients only runs the *input half* (B) and keeps what the *weight half* (W)
needs; the next backward through the same call (the schedule's weight pass) runs W. A
position recorded that way is captured as three graphs (forward, B, W) in the order the step
ran them, into the same pool; W hands the parameter gradients to autograd, which the schedule
adds into ``.grad`` as it does eagerly. A backward that asks for everything stays one graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from . import collectives as _collectives
from . import guards as _guards
from . import memory as _memory
from .capture import Link, Process, process_for
from .errors import CaptureError, GraphedLayerError, GraphScheduleError, SignatureError, StateReplacedError, release_frames
from .runtime import GraphRuntime, TensorSpec, runtime_for
from .schedule import InFlightQueue
from .state import StateWatch
from .tree import flatten, unflatten

__all__ = ["GraphedCallable", "EngineOptions", "Phase", "GRAPHED_LAYER_DOC", "graphed_layer_doc", "graphed_engine", "node_forward",
           "node_backward", "reset_graphs"]

logger = logging.getLogger("paddle_graphpp")

_FALLBACKS = ("error", "eager")


# --------------------------------------------------------------------------- options
@dataclass(kw_only=True, slots=True)
class EngineOptions:
    """Settings of one graphed layer (validated on construction)."""

    num_warmup_steps: int = 3
    """Eager forwards per signature before it is recorded (recording also waits for an
    episode start)."""
    fallback: str = "error"
    """``"error"``: a failed capture raises :class:`CaptureError`. ``"eager"``: warn once and
    keep running this layer eagerly."""
    memory: str = "shared"
    """``"shared"`` or ``"per_graph"``; see :mod:`paddle_graphpp.core.memory`."""
    max_in_flight: int = 64
    """Forwards that may wait for their backward before that is an error."""
    max_signatures: int = 4
    """Input signatures captured per layer; further ones run eagerly with a warning."""
    accumulate_grads: Any = "auto"
    """``True``: the backward graph adds parameter gradients into ``.grad`` itself (one
    in-graph add per parameter; ``.grad`` becomes a buffer the layer owns). ``False``: the
    graph writes them into a buffer of the layer that autograd then adds to ``.grad`` (a
    second set of gradient buffers, and one more pass over them per micro-batch).
    ``"auto"`` (default): ``True`` where the runtime supports it and no parameter's
    gradient accumulation runs hooks (Python accumulation hooks, or a DistributedDataParallel
    forward around the layer); ``False`` there, so the hooks keep seeing every gradient."""
    generators: Any = None
    """Random generators the layer draws from besides the framework's default one (which is
    always registered): a sequence, or a callable returning one at each capture. Runtimes
    also register the generators of RNG trackers they recognise (see each runtime)."""

    def validate(self, owner: str) -> "_memory.MemoryMode":
        if not isinstance(self.num_warmup_steps, int) or self.num_warmup_steps < 0:
            raise ValueError(f"{owner}: num_warmup_steps must be an int >= 0, got {self.num_warmup_steps!r}")
        if self.fallback not in _FALLBACKS:
            raise ValueError(f"{owner}: fallback must be one of {_FALLBACKS}, got {self.fallback!r}")
        if not isinstance(self.max_signatures, int) or self.max_signatures < 1:
            raise ValueError(f"{owner}: max_signatures must be an int >= 1, got {self.max_signatures!r}")
        if not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise ValueError(f"{owner}: max_in_flight must be an int >= 1, got {self.max_in_flight!r}")
        if not (isinstance(self.accumulate_grads, bool) or self.accumulate_grads == "auto"):
            raise ValueError(f"{owner}: accumulate_grads must be a bool or 'auto', got {self.accumulate_grads!r}")
        if not (self.generators is None or callable(self.generators)
                or isinstance(self.generators, (list, tuple))):
            raise ValueError(f"{owner}: generators must be a list or tuple of generators, or a callable returning "
                             f"one, got {type(self.generators).__name__}")
        return _memory.MemoryMode.parse(self.memory, owner)


# --------------------------------------------------------------------------- records
class Phase(enum.Enum):
    """Where one input signature of a layer stands (see the module docstring)."""

    WARMUP = "warmup"
    RECORD = "record"
    READY = "ready"


class _Run(enum.Enum):
    """How one call ran: decides what its backward does."""

    EAGER = "eager"  # eagerly, nothing kept for capture
    RECORDED = "recorded"  # eagerly, and recorded for capture at the next episode start
    REPLAY = "replay"  # replayed its position's forward graph
    LAUNCHED_CAPTURE = "launched_capture"  # stream-ordered allocator: captured, then launched


@dataclass(frozen=True, slots=True)
class _Tree:
    """A nested structure with its tensors taken out: leaves (tensor slots ``None``), tree
    spec, and which leaves are tensors."""

    leaves: tuple
    spec: Any
    tensor_index: tuple

    def rebuild(self, tensors: Sequence[Any]) -> Any:
        """The structure with ``tensors`` put back in their slots."""
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_index, tensors):
            leaves[i] = t
        return unflatten(self.spec, leaves)


@dataclass(frozen=True, slots=True)
class _CallShape(_Tree):
    """The argument structure of a signature, and its tensors' specs."""

    specs: tuple


@dataclass(frozen=True, slots=True)
class _Outputs(_Tree):
    """A call's output structure, and which of its tensors carry a gradient."""

    differentiable: tuple


@dataclass(frozen=True, slots=True)
class _Recording:
    """What capturing one recorded position needs, kept without the eager tensors: its static
    buffers as slots of the recording (:meth:`Process.buffer_slot`) and its output structure."""

    input_slots: tuple  # a slot index, or a capture.Link to the tensor's producer
    outputs: _Outputs
    grad_slots: Optional[tuple] = None  # set when its backward is recorded
    grad_specs: Optional[tuple] = None
    split: bool = False  # its backward ran as an input half and a weight half


@dataclass(frozen=True, slots=True)
class _Position:
    """The graphs of one (signature, position) and their static buffers. Built once, after
    both graphs are captured; never changed."""

    generation: Any
    fwd_graph: Any
    bwd_graph: Any
    static_inputs: tuple
    static_outputs: tuple  # detached aliases of the forward graph's outputs
    static_grad_outputs: tuple
    static_grad_inputs: tuple  # one per tensor input (None: no gradient)
    param_grad_used: tuple  # per parameter: does the backward graph produce its gradient
    outputs: _Outputs
    accumulate: bool
    keepalive: Any = None  # stream-ordered allocator: the forward capture's tensors (see _capture_backward)
    # Inputs whose static tensor is another position's static output (a recorded link): their
    # index and alias key. A replay is only right when the call passes exactly that tensor.
    linked: tuple = ()
    state: Optional[StateWatch] = None  # the layer's parameters and buffers the graphs read (core.state)
    # Split backward (zero-bubble schedules): bwd_graph is the input half, weight_graph the
    # weight half, which writes the gradients of the parameters marked in param_grad_used into
    # weight_buffers; input_param_used marks those the input half wrote into the layer's
    # parameter-gradient buffers (handed to autograd with the input gradients).
    weight_graph: Any = None
    weight_buffers: tuple = ()
    input_param_used: tuple = ()
    # Per output: the tensor owning its memory where static_outputs holds an alias that does not
    # (an output the recorded step freed within the episode), until its release point in the
    # capture order sets it to None (Process.watch_outputs); None where static_outputs owns it
    owned: Any = ()


@dataclass(slots=True)
class _Live:
    """A captured forward's autograd graph, held until its backward is captured."""

    generation: Any
    graph: Any
    static_inputs: tuple
    inputs: list
    outputs: list
    params: list
    outputs_shape: _Outputs
    linked: tuple = ()  # see _Position.linked
    state: Optional[StateWatch] = None  # see _Position.state
    static_outputs: tuple = ()  # see _Position.static_outputs
    owned: Any = ()  # see _Position.owned


@dataclass(slots=True)
class _InputHalf:
    """A captured input half (B) of a split backward, held until its weight half is captured."""

    live: _Live
    graph: Any
    static_grads: tuple
    static_grad_inputs: tuple
    weight_state: Any  # the runtime's backward_input state: what the weight half needs
    param_used: tuple = ()  # per parameter: did the input half write its gradient (see _Position)


class _Signature:
    """One input signature of a layer: its phase, parameters and captured positions."""

    __slots__ = ("key", "describe", "shape", "phase", "warm", "params", "accumulate", "positions",
                 "recordings", "busy")

    def __init__(self, key: Any, describe: str, shape: _CallShape):
        self.key = key
        self.describe = describe
        self.shape = shape
        self.phase = Phase.WARMUP
        self.warm = 0
        self.params: Optional[tuple] = None  # fixed when the signature leaves warmup
        self.accumulate = False
        self.positions: dict[int, _Position] = {}
        self.recordings: dict[int, _Recording] = {}
        self.busy: set = set()  # per_graph mode: slots whose backward has not run

    def free_slot(self) -> int:
        """Lowest slot not in flight: ``per_graph`` recycles a position once its backward ran."""
        slot = 0
        while slot in self.busy:
            slot += 1
        return slot

    def reset(self) -> None:
        """Forget graphs and recordings and warm up again (after a failed capture)."""
        self.phase, self.warm = Phase.WARMUP, 0
        self.positions.clear()
        self.recordings.clear()


class _Call:
    """One forward call and, later, its backward. Lives in the layer's FIFO in between."""

    __slots__ = ("engine", "key", "shape", "tensors", "params", "force_eager", "position", "run", "outputs",
                 "done", "eager", "live", "weight_state", "anchor")

    def __init__(self, engine: "GraphedCallable", key: Any, shape: _CallShape, tensors: list, params: tuple,
                 force_eager: bool):
        self.engine = engine
        self.key = key
        self.shape = shape
        self.tensors = tensors
        self.params = params
        self.force_eager = force_eager
        self.position = -1
        self.run = _Run.EAGER
        self.outputs: Optional[_Outputs] = None
        self.done: Optional[_Position] = None  # the position replayed (or captured and launched)
        self.eager: Optional[tuple] = None  # (inputs, outputs, params) of the eager autograd graph
        self.live: Optional[_Live] = None  # stream-ordered allocator: forward captured this step
        self.weight_state: Any = None  # eager split backward: the runtime's state between B and W
        self.anchor: Any = None  # set by a runtime: keeps the call's autograd node alive until its backward is over

    @property
    def differentiable(self) -> tuple:
        return self.outputs.differentiable

    def forward(self) -> list:
        return self.engine._forward(self)

    def backward(self, grads: Sequence[Any], weights_wanted: bool = True) -> list:
        return self.engine._backward(self, grads, weights_wanted)

    @property
    def weight_pending(self) -> bool:
        """The input half of this call's backward ran and its weight half has not."""
        return self.engine.queue.awaits_weight(self)


class _UserError(Exception):
    """Wraps an exception raised by the layer's own code during a capture."""

    def __init__(self, phase: str, error: BaseException):
        super().__init__(phase)
        self.phase = phase
        self.error = error


class _CaptureFailed(Exception):
    """Wraps a failure of capture itself."""

    def __init__(self, phase: str, error: BaseException, generation: Any):
        super().__init__(phase)
        self.phase = phase
        self.error = error
        self.generation = generation


# --------------------------------------------------------------------------- engine
class GraphedCallable:
    """Framework-neutral graphed callable; the runtimes' layer classes are thin shells over it.

    Args:
        fn: the wrapped layer's call.
        runtime: the framework adapter.
        params: returns the trainable parameters ``fn`` uses (read while a signature warms up;
            its graphs keep the list they were captured against).
        name: the layer's name in messages.
        options: :class:`EngineOptions`.
    """

    def __init__(self, fn: Callable, runtime: GraphRuntime, params: Callable[[], list], *,
                 name: str, options: EngineOptions):
        self.fn = fn
        self.runtime = runtime
        self.params = params
        self.name = name
        self.options = options
        self.memory_mode = options.validate(name)
        if options.accumulate_grads is True and not runtime.accumulates_grads_in_graph:
            raise ValueError(f"{name}: accumulate_grads=True is not supported by the {runtime.name} runtime; "
                             "leave it 'auto' or False (gradients then reach .grad through autograd).")
        self.queue = InFlightQueue(name, options.max_in_flight)
        self._signatures: dict[Any, _Signature] = {}
        self._param_grad_buffers: Optional[list] = None
        self._weight_grad_buffers: Optional[list] = None  # split backward: what the weight half writes
        self._disabled_reason: Optional[str] = None
        self._warned: set = set()
        self._watch: Optional[StateWatch] = None  # parameters and buffers as the newest capture read them
        self._state_checked: Optional[tuple] = None  # (episode, watch) last found unchanged
        self.replays = 0  # forward + backward graph replays, for tests and telemetry
        self.captures = 0

    @property
    def process(self) -> Process:
        return process_for(self.runtime)

    @property
    def plan(self) -> "_memory.MemoryPlan":
        return self.process.plan

    # ------------------------------------------------------------------ entry
    def __call__(self, args: tuple, kwargs: dict) -> Any:
        rt = self.runtime
        if not rt.grad_enabled():
            return self.fn(*args, **kwargs)  # inference: no backward will pair with it
        leaves, spec = flatten((args, kwargs))
        tensor_index = [i for i, x in enumerate(leaves) if rt.is_tensor(x)]
        tensors = [leaves[i] for i in tensor_index]
        specs = tuple(rt.spec(t) for t in tensors)
        key = self._signature_key(leaves, tensor_index, specs, spec)
        sig = self._signatures.get(key)
        # Parameters are read while a signature warms up; its graphs keep the tuple they were
        # captured against (walking module.parameters() on every replay would cost more than
        # the replay itself).
        params = sig.params if sig is not None and sig.params is not None else tuple(self.params())
        if not params and not any(s.requires_grad for s in specs):
            return self.fn(*args, **kwargs)  # nothing to differentiate
        reason = self._disabled_reason or rt.graphs_unavailable_reason(tensors)
        if reason is not None:
            self._warn_once("unavailable", f"{self.name}: CUDA graphs are not used ({reason}); running eagerly.")
        proc = self.process
        if reason is None and proc.has_recording and proc.clock.between_episodes:
            proc.capture_recorded()  # the last episode was recorded: capture it before this one starts
        if sig is not None:
            shape = sig.shape
        else:
            slots = set(tensor_index)
            shape = _CallShape(tuple(None if i in slots else x for i, x in enumerate(leaves)), spec,
                               tuple(tensor_index), specs)
        call = _Call(self, key, shape, tensors, params, reason is not None)
        outputs = rt.apply_graphed_function(call, tensors, params)
        return call.outputs.rebuild(outputs)

    # --------------------------------------------------------------- forward
    def _forward(self, call: _Call) -> list:
        self.process.poll_watches()
        clock = self.process.clock
        sig = None if call.force_eager else self._signature_for(call)
        episode = clock.forward_started()
        first_in_episode = self.queue.episode != episode
        try:
            if sig is not None and sig.phase is Phase.WARMUP and first_in_episode \
                    and sig.warm >= self.options.num_warmup_steps:
                self._leave_warmup(sig, call)
            call.position = self.queue.push(call, call.key, episode=episode)
            if sig is not None and self.memory_mode is _memory.MemoryMode.PER_GRAPH:
                # Upstream semantics: one position per in-flight slot, safe because no pool is shared.
                call.position = sig.free_slot()
                sig.busy.add(call.position)
            if sig is None or sig.phase is Phase.WARMUP:
                if sig is not None:
                    sig.warm += 1
                return self._run_eager(call)
            done = sig.positions.get(call.position)
            if done is not None:
                if done.linked and not self._inputs_in_place(call, done):
                    self._unreplayed(call, sig, "forward")
                    return self._run_eager(call)
                return self._replay_forward(call, done)
            if self.plan.async_allocator:
                return self._capture_and_launch_forward(call, sig)
            outputs = self._run_eager(call)  # a position not captured yet: run it, record it
            self._record_forward(call, sig)
            return outputs
        except BaseException:
            self.queue.discard(call)
            clock.forward_done()
            if sig is not None:
                sig.busy.discard(call.position)
            raise

    def _leave_warmup(self, sig: _Signature, call: _Call) -> None:
        """Fix the signature's parameters and gradient path; record from this episode on
        (or capture in step under the stream-ordered allocator)."""
        sig.params = tuple(call.params)
        sig.accumulate = self._accumulates(sig.params)
        sig.phase = Phase.READY if self.plan.async_allocator else Phase.RECORD

    def _accumulates(self, params: tuple) -> bool:
        choice = self.options.accumulate_grads
        if choice is False or not self.runtime.accumulates_grads_in_graph:
            return False
        hooked = self.runtime.params_with_grad_hooks(params)
        if hooked and choice is True:
            raise ValueError(
                f"{self.name}: accumulate_grads=True bypasses autograd's gradient accumulation, but parameters "
                f"{hooked[:4]} have accumulation hooks (e.g. DistributedDataParallel's); pass "
                f"accumulate_grads='auto' or False for this layer")
        if hooked:
            return False
        # A parameter's .grad can be one layer's buffer only: a weight shared with a layer that
        # already accumulates in its graph (a tied embedding in two stage modules of one rank)
        # gets its gradient through autograd here, which adds into that buffer in place.
        other = next((o for o in map(self.process.graph_accumulator_of, params) if o not in (None, self)), None)
        if other is not None:
            if choice is True:
                raise ValueError(
                    f"{self.name}: accumulate_grads=True, but a parameter of this layer is also one of "
                    f"{other.name}'s, whose graphs already accumulate its gradient; pass accumulate_grads='auto' "
                    f"(this layer then leaves that parameter's accumulation to autograd) or False")
            logger.info("%s: shares parameters with %s, which accumulates them in its graphs; this layer's "
                        "gradients go through autograd", self.name, other.name)
            return False
        self.process.accumulate_in_graphs(self, params)
        return True

    def accumulates_in_graphs(self, param: Any) -> bool:
        """Whether this layer's graphs add ``param``'s gradient into ``.grad`` (a signature past
        warmup that accumulates and holds ``param``, and the layer not turned eager)."""
        return self._disabled_reason is None and any(
            sig.accumulate and any(q is param for q in sig.params or ()) for sig in self._signatures.values())

    def _run_eager(self, call: _Call) -> list:
        rt = self.runtime
        call.run = _Run.EAGER
        with rt.enable_grad():
            inner = [rt.detach(t, s.requires_grad) for t, s in zip(call.tensors, call.shape.specs)]
            args, kwargs = call.shape.rebuild(inner)
            result, inner_params = rt.call_with_param_aliases(self.fn, call.params, args, kwargs)
        call.outputs, outs = self._outputs_of(result)
        call.eager = (inner, outs, inner_params)
        return [rt.detach(o) for o in outs]

    def _record_forward(self, call: _Call, sig: _Signature) -> None:
        """Keep what capturing this position needs: the slots of its static input buffers
        (taken over from positions whose backward has run, see core.memory), or links to the
        recorded layers whose outputs the inputs are, and its output structure."""
        proc = self.process
        reuse = self.memory_mode is not _memory.MemoryMode.PER_GRAPH
        slots = tuple((proc.link_of("out", t) if reuse else None) or proc.buffer_slot(s, reuse=reuse)
                      for t, s in zip(call.tensors, call.shape.specs))
        sig.recordings[call.position] = _Recording(slots, call.outputs)
        proc.record(self, call.key, call.position, forward=True)
        if reuse:
            proc.note_produced(self, call.key, call.position, "out", call.eager[1])
            inner, outs, inner_params = call.eager
            proc.watch_outputs(self, call.key, call.position, outs, [*inner, *inner_params])
        call.run = _Run.RECORDED

    def _inputs_in_place(self, call: _Call, done: _Position) -> bool:
        """The linked inputs are the tensors the graph reads. If not (the data flow between
        layers differs from the captured step's), copying into them would overwrite another
        position's outputs: the call runs eagerly instead."""
        rt = self.runtime
        for index, key in done.linked:
            if rt.alias_key(call.tensors[index]) != key:
                self._warn_once("linked", (
                    f"{self.name}: input {index} is not the tensor the previous graphed layer returned, as it was "
                    f"in the captured step; such calls run eagerly (correct, without the graphs' speed). Pass "
                    f"the previous layer's output unchanged, or give the layer a copy in every step."))
                return False
        return True

    def _replay_forward(self, call: _Call, done: _Position, copy_inputs: bool = True) -> list:
        rt = self.runtime
        self.process.before_replay(self, call.key, call.position, "forward")
        if done.state is not None:
            self._check_state(done.state)
        self.plan.note_replay(done.generation, id(done.fwd_graph), True, self.name)
        _collectives.check_replay(done.fwd_graph)
        self._keep_held_outputs(call)
        if copy_inputs:
            rt.copy_many(done.static_inputs, call.tensors)
        rt.replay_graph(done.fwd_graph)
        self.replays += 1
        call.run, call.done, call.outputs = _Run.REPLAY, done, done.outputs
        return self._hand_out(call, done.static_outputs)

    def _unreplayed(self, call: _Call, sig: Optional[_Signature], kind: str) -> None:
        """A captured position's graph runs eagerly this time (its inputs are not where the graph
        reads them): the graphs after it still overwrite what was released before it, so the
        outputs held past their release point move as before a replay (:meth:`Process.before_replay`)."""
        if sig is None or call.position not in sig.positions:
            return
        kinds = ("backward", "input", "weight") if kind == "backward" else (kind,)  # a full backward of split graphs
        for k in kinds:
            self.process.before_replay(self, call.key, call.position, k)

    def _hand_out(self, call: _Call, static_outputs: Sequence[Any]) -> list:
        """Aliases of a launched forward's output buffers for the caller, remembered weakly:
        the position's next launch overwrites them (see :meth:`_keep_held_outputs`)."""
        outs = [self.runtime.detach(o) for o in static_outputs]
        self.process.handed_out(self, call.key, call.position, outs)
        return outs

    def _keep_held_outputs(self, call: _Call) -> None:
        """Before a launch overwrites the position's output buffers: outputs of its last launch
        that someone still holds get their values moved to memory of their own. A pipeline
        schedule keeps the last stage's outputs until the step ends, to return them merged,
        and on the last stage of a 1F1B pipeline every micro-batch replays the same position;
        eagerly each output is its own tensor, and so it stays here (copied only when held)."""
        if not self.process.move_held(self, call.key, call.position):
            self._warn_once("held", (
                f"{self.name}: outputs of an earlier micro-batch are still referenced when the same micro-batch "
                f"position replays and overwrites them, and the {self.runtime.name} runtime cannot move them to "
                f"memory of their own: they now hold the new values. Clone an output you keep."))

    # -------------------------------------------------------------- backward
    def _backward(self, call: _Call, grads: Sequence[Any], weights_wanted: bool = True) -> list:
        """``weights_wanted``: does autograd ask for the parameters' gradients? Asking for none
        runs the input half of a split backward."""
        self.process.poll_watches()
        if call.weight_pending:
            return self._backward_weight(call)  # the schedule's weight pass, after the input pass
        split = not weights_wanted and bool(call.params) and self.runtime.splits_backward
        if split and call.run is _Run.LAUNCHED_CAPTURE:
            raise GraphScheduleError(
                f"{self.name}: a backward asked for input gradients only (a zero-bubble schedule's input pass), "
                f"which the stream-ordered allocator (backend:cudaMallocAsync) cannot serve: its graphs are "
                f"captured within the step, as one backward. Use the default caching allocator with "
                f"zero-bubble schedules, or a schedule with full backwards (1F1B, interleaved 1F1B).")
        if split and call.run is _Run.REPLAY and call.done.weight_graph is None:
            raise GraphScheduleError(
                f"{self.name}: micro-batch position {call.position} was captured with a full backward, but "
                f"this step's backward asks for input gradients only (a zero-bubble schedule's input "
                f"pass). Graphs replay the schedule they were captured under: run the same schedule every "
                f"step (a schedule change needs new graphs: build the stage anew).")
        self.queue.pop(call, weight_later=split)
        sig = self._signatures.get(call.key)
        diff_grads = [g for g, d in zip(grads, call.differentiable) if d]
        if call.run is _Run.EAGER:
            self._unreplayed(call, sig, "input" if split else "backward")
        if split:
            try:
                return self._backward_input(call, sig, diff_grads)
            except BaseException:
                # The micro-batch's backward is over (failed): it must not wait for a weight half.
                self.queue.pop_weight(call)
                self._leave_flight(call, sig)
                self._end_call(call)
                raise
        self._leave_flight(call, sig)
        try:
            if call.run is _Run.REPLAY:
                return self._replay_backward(call, call.done, diff_grads)
            if call.run is _Run.LAUNCHED_CAPTURE:
                return self._capture_and_launch_backward(call, sig, diff_grads)
            result = self._eager_backward(call, diff_grads, into_grads=call.run is _Run.RECORDED
                                          and sig is not None and sig.accumulate)
            if call.run is _Run.RECORDED and sig is not None:
                self._record_backward(call, sig, diff_grads, result[:len(call.shape.specs)])
            return result
        finally:
            self._end_call(call)

    @staticmethod
    def _end_call(call: _Call) -> None:
        """The call's backward is over: it keeps no tensor. (Its autograd node keeps the call,
        and the node lives as long as anyone holds the call's outputs: the inputs, often
        another graphed layer's outputs, would be held with them.)"""
        call.tensors = ()
        call.eager = call.weight_state = None

    def _leave_flight(self, call: _Call, sig: Optional[_Signature]) -> None:
        """The call's backward is complete (a full backward, or the weight half of a split one)."""
        call.anchor = None
        self.process.clock.forward_done()
        if sig is not None:
            sig.busy.discard(call.position)

    def _backward_input(self, call: _Call, sig: Optional[_Signature], diff_grads: list) -> list:
        """The input half of a split backward: input gradients now, parameter gradients left
        for :meth:`_backward_weight`."""
        if call.run is _Run.REPLAY:
            return self._replay_backward_input(call, call.done, diff_grads)
        rt = self.runtime
        inner, outs, inner_params = call.eager
        outs = [o for o, d in zip(outs, call.differentiable) if d]
        wrt = [x for x, s in zip(inner, call.shape.specs) if s.requires_grad]
        if outs:
            got, param_grads, call.weight_state = rt.backward_input(outs, diff_grads, wrt, inner_params)
        else:
            got, param_grads = [None] * len(wrt), [None] * len(call.params)
        # The weight half starts from the state, not the outputs: they are free to go now, as a
        # full backward's are after it (the recording then sees when their memory is unused).
        call.eager = (inner, None, inner_params)
        outs = None
        it = iter(got)
        input_grads = [next(it) if s.requires_grad else None for s in call.shape.specs]
        if call.run is _Run.RECORDED and sig is not None:
            self._record_backward(call, sig, diff_grads, input_grads, half="input")
        return input_grads + list(param_grads)

    def _backward_weight(self, call: _Call) -> list:
        """The weight half of a split backward. Without accumulation: the parameter gradients
        it produces, handed to autograd (the schedule's weight pass adds them into ``.grad``).
        With it (``accumulate_grads``): the gradients go into ``.grad`` and the weight pass gets
        the sums (see :meth:`_hand_over`)."""
        sig = self._signatures.get(call.key)
        rt = self.runtime
        accumulates = call.done.accumulate if call.run is _Run.REPLAY else (
            call.run is _Run.RECORDED and sig is not None and sig.accumulate)
        if accumulates and not rt.weight_pass_refills_grad():
            # Refused before anything changed: the micro-batch still awaits its weight pass.
            raise GraphScheduleError(
                f"{self.name}: adds its parameter gradients into .grad inside its graphs (accumulate_grads), "
                f"so its weight half (a backward asking for the parameters after an input-only one) hands "
                f"the weight pass each parameter's whole sum, for it to put back into .grad, as "
                f"{rt.refilling_weight_pass} does; this backward is not that weight pass, and "
                f"per-micro-batch parameter gradients do not exist here. Run the weight pass through "
                f"{rt.refilling_weight_pass}, or pass accumulate_grads=False to this layer.")
        self.queue.pop_weight(call)
        self._leave_flight(call, sig)
        if call.run is _Run.EAGER:
            self._unreplayed(call, sig, "weight")
        n_inputs = len(call.shape.specs)
        try:
            if call.run is _Run.REPLAY:
                return [None] * n_inputs + self._replay_weight_graph(call, call.done, hand_over=True)
            # A recorded call of a layer whose graphs will accumulate: each group of gradients
            # goes into .grad as it comes, as the graphs will do (not the whole stage's at once)
            grads = [None] * len(call.params)
            if call.weight_state is not None:
                _, _, inner_params = call.eager
                for index, got in rt.backward_weight(call.weight_state, inner_params):
                    if accumulates:
                        self._add_into_grads([call.params[i] for i in index], got)
                        got = [rt.grad_of(call.params[i]) for i in index]
                    for i, g in zip(index, got):
                        grads[i] = g
            if accumulates:
                rt.graph_grad_writes += 1  # .grad changed outside autograd (see GraphRuntime)
                grads = self._hand_over(call.params, grads)
            if call.run is _Run.RECORDED and sig is not None:
                self._record_backward(call, sig, [], [], half="weight")
            return [None] * n_inputs + grads
        finally:
            self._end_call(call)

    def _add_into_grads(self, params: Sequence[Any], grads: Sequence[Any]) -> None:
        """``.grad += grad`` for each parameter; an unset ``.grad`` adopts the gradient."""
        rt = self.runtime
        dst, src = [], []
        for p, g in zip(params, grads):
            have = rt.grad_of(p)
            if have is None:
                rt.set_grad(p, g)
            else:
                dst.append(have)
                src.append(g)
        if dst:
            rt.add_many(dst, src)

    def _hand_over(self, params: Sequence[Any], totals: Sequence[Any]) -> list:
        """For the schedule's weight pass, which puts the gradients it gets into ``.grad``
        (assigned where ``.grad`` is unset, added otherwise; only then is this called, see
        :meth:`GraphRuntime.weight_pass_refills_grad`): each parameter's ``.grad``, already
        holding the sum (``totals``), is unset and handed over whole, so the sum returns to
        ``.grad`` without a copy."""
        for p, total in zip(params, totals):
            if total is not None:
                self.runtime.set_grad(p, None)
        return list(totals)

    def _eager_backward(self, call: _Call, diff_grads: list, into_grads: bool = False) -> list:
        """The eager backward. With ``into_grads`` (a recorded call of a layer whose graphs will
        accumulate into ``.grad``) each parameter gradient goes into ``.grad`` as autograd
        produces it, as the graphs will do, instead of all of the run's gradients being handed
        back together (a whole stage's parameter gradients alive at once)."""
        rt = self.runtime
        inner, outs, inner_params = call.eager
        outs = [o for o, d in zip(outs, call.differentiable) if d]
        inputs = [x for x, s in zip(inner, call.shape.specs) if s.requires_grad]
        if into_grads and outs:
            got = iter(rt.backward_to_grads(outs, diff_grads, inputs, inner_params, call.params))
            rt.graph_grad_writes += 1  # .grad changed outside autograd (see GraphRuntime)
            return [next(got) if s.requires_grad else None for s in call.shape.specs] + [None] * len(call.params)
        wrt = inputs + list(inner_params)
        got = iter(rt.autograd_grad(outs, diff_grads, wrt) if outs else [None] * len(wrt))
        input_grads = [next(got) if s.requires_grad else None for s in call.shape.specs]
        return input_grads + list(got)

    def _record_backward(self, call: _Call, sig: _Signature, diff_grads: list, input_grads: list,
                         half: Optional[str] = None) -> None:
        """Record a backward: a full one (``half=None``), or the ``"input"`` or ``"weight"``
        half of a split one. The static buffers of the position are released when its backward
        is complete: the weight half still reads the inputs and the incoming gradients."""
        rt, proc = self.runtime, self.process
        rec = sig.recordings.get(call.position)
        if rec is None:
            return
        reuse = self.memory_mode is not _memory.MemoryMode.PER_GRAPH
        if half != "weight":
            specs = tuple(rt.spec(g) for g in diff_grads)
            grad_slots = tuple((proc.link_of("grad", g) if reuse else None) or proc.buffer_slot(s, reuse=reuse)
                               for g, s in zip(diff_grads, specs))
            rec = sig.recordings[call.position] = dataclasses.replace(
                rec, grad_slots=grad_slots, grad_specs=specs, split=half == "input")
            if reuse:
                proc.note_produced(self, call.key, call.position, "grad", input_grads)
                proc.watch_grads(self, call.key, call.position, input_grads, diff_grads)
        if reuse and half != "input":
            # Positions recorded after this backward may take these buffers over: the inputs
            # are read by nothing after this backward, the gradients by nothing outside it.
            for slot in rec.input_slots + rec.grad_slots:
                if isinstance(slot, int):
                    proc.release_slot(slot)
        proc.record(self, call.key, call.position, forward=False, half=half)

    def _replay_backward(self, call: _Call, done: _Position, diff_grads: list) -> list:
        rt = self.runtime
        if done.weight_graph is not None:  # captured as two halves; this step wants both at once
            n = len(call.shape.specs)
            first = self._replay_backward_input(call, done, diff_grads)
            return first[:n] + self._sum_grads(first[n:], self._replay_weight_graph(call, done))
        self.process.before_replay(self, call.key, call.position, "backward")
        self.plan.note_replay(done.generation, id(done.bwd_graph), False, self.name)
        _collectives.check_replay(done.bwd_graph)
        if done.static_grad_outputs:
            rt.copy_many(done.static_grad_outputs, diff_grads)
        buffers = self._param_grad_buffers
        if done.accumulate:  # the graph adds into the buffers: make them the parameters' .grad first
            used = [(p, b) for p, b, u in zip(call.params, buffers, done.param_grad_used) if u]
            self._bind_grads([p for p, _ in used], [b for _, b in used])
        rt.replay_graph(done.bwd_graph)
        self.replays += 1
        if done.accumulate:
            rt.graph_grad_writes += 1  # .grad changed without a version bump (see GraphRuntime)
            param_grads = [None] * len(call.params)
        else:
            param_grads = [b if u else None for b, u in zip(buffers, done.param_grad_used)]
        return self._hand_off(list(call.tensors) + list(call.params), list(done.static_grad_inputs) + param_grads)

    def _replay_backward_input(self, call: _Call, done: _Position, diff_grads: list) -> list:
        rt = self.runtime
        self.process.before_replay(self, call.key, call.position, "input")
        self.plan.note_replay(done.generation, id(done.bwd_graph), False, self.name, finishes=False)
        _collectives.check_replay(done.bwd_graph)
        if done.static_grad_outputs:
            rt.copy_many(done.static_grad_outputs, diff_grads)
        rt.replay_graph(done.bwd_graph)
        self.replays += 1
        used = done.input_param_used or (False,) * len(call.params)
        buffers = self._param_grad_buffers if any(used) else [None] * len(call.params)
        return self._hand_off(list(call.tensors) + list(call.params),
                              list(done.static_grad_inputs) + [b if u else None for b, u in zip(buffers, used)])

    def _replay_weight_graph(self, call: _Call, done: _Position, hand_over: bool = False) -> list:
        """Replay the weight half. Without accumulation: the parameter gradients, in buffers
        the layer keeps (copies where a parameter has no ``.grad`` yet: the caller may make the
        gradient it gets its ``.grad``, as the zero-bubble weight pass does, and the next replay
        would overwrite it).

        With accumulation the graph adds them into the layer's gradient buffers, bound as
        ``.grad`` first, as a full backward does. Inside a full backward autograd gets nothing
        for them. A schedule's weight pass (``hand_over``) adds what it gets into ``.grad``, and
        assigns it where ``.grad`` is unset (torch.distributed.pipelining's
        ``stage_backward_weight``): each parameter's ``.grad`` is unset and its buffer,
        which holds the whole sum, handed over, so the sum ends in ``.grad`` without a second
        set of buffers and without a copy."""
        rt = self.runtime
        if done.accumulate:
            used = [(p, b) for p, b, u in zip(call.params, done.weight_buffers, done.param_grad_used) if u]
            self._bind_grads([p for p, _ in used], [b for _, b in used])
        self.process.before_replay(self, call.key, call.position, "weight")
        self.plan.note_replay(done.generation, id(done.weight_graph), False, self.name)
        _collectives.check_replay(done.weight_graph)
        rt.replay_graph(done.weight_graph)
        self.replays += 1
        if done.accumulate:
            rt.graph_grad_writes += 1  # .grad changed without a version bump (see GraphRuntime)
            if not hand_over:
                return [None] * len(call.params)
            return self._hand_over(call.params, [b if u else None for b, u in zip(done.weight_buffers,
                                                                                  done.param_grad_used)])
        grads = [b if u else None for b, u in zip(done.weight_buffers, done.param_grad_used)]
        fresh = [i for i in rt.leaves_without_grad(call.params) if grads[i] is not None]
        if fresh:
            for i, c in zip(fresh, rt.clone_many([grads[i] for i in fresh])):
                grads[i] = c
        return grads

    # ---------------------------------------------------------------- capture
    # Called by Process.capture_recorded, in recorded order, between episodes.
    def _capture_recorded_forward(self, key: Any, position: int) -> Optional[_Live]:
        """``None``: the layer's train/eval mode changed since the recording (the position is
        recorded again when it next runs)."""
        rt, proc = self.runtime, self.process
        sig = self._signatures[key]
        rec = sig.recordings[position]
        training, mode = key[3]
        if getattr(self.fn, "training", None) != training:
            return None
        static_inputs = tuple(proc.static_for(slot, spec) for slot, spec in zip(rec.input_slots, sig.shape.specs))
        with rt.mode_context(mode):
            live = self._capture_forward(sig, static_inputs, rec.outputs)
        live.linked = tuple((i, rt.alias_key(t)) for i, (slot, t) in enumerate(zip(rec.input_slots, static_inputs))
                            if not isinstance(slot, int))
        statics, owned = list(live.static_outputs), [None] * len(live.static_outputs)
        for index, t in enumerate(statics):
            link = Link(id(self), key, position, index, "out")
            alias = rt.weak_alias(t) if proc.dies_in_episode(link) else None
            if alias is not None:  # its memory goes back to the pool where the recorded step freed it
                statics[index], owned[index] = alias, t
                proc.own_output(link, owned, index)
        live.static_outputs, live.owned = tuple(statics), owned
        proc.captured(self, key, position, "out", live.static_outputs)
        return live

    def _capture_recorded_backward(self, key: Any, position: int, live: _Live) -> None:
        proc = self.process
        sig = self._signatures[key]
        rec = sig.recordings.pop(position)
        static_grads = tuple(proc.static_for(slot, spec) for slot, spec in zip(rec.grad_slots, rec.grad_specs))
        done = sig.positions[position] = self._capture_backward(sig, live, static_grads)
        proc.captured(self, key, position, "grad", done.static_grad_inputs)
        proc.consumed(rec.grad_slots)

    def _capture_recorded_backward_input(self, key: Any, position: int, live: _Live) -> _InputHalf:
        proc = self.process
        sig = self._signatures[key]
        rec = sig.recordings[position]
        static_grads = tuple(proc.static_for(slot, spec) for slot, spec in zip(rec.grad_slots, rec.grad_specs))
        half = self._capture_backward_input(sig, live, static_grads)
        proc.captured(self, key, position, "grad", half.static_grad_inputs)
        return half

    def _capture_recorded_backward_weight(self, key: Any, position: int, half: _InputHalf) -> None:
        sig = self._signatures[key]
        rec = sig.recordings.pop(position)
        sig.positions[position] = self._capture_backward_weight(sig, half)
        self.process.consumed(rec.grad_slots)  # the weight half may read them too (saved at a junction)

    def _recorded_grad_slots(self, key: Any, position: int) -> tuple:
        """The slots of the incoming gradients recorded for ``position`` (empty: none recorded)."""
        sig = self._signatures.get(key)
        rec = None if sig is None else sig.recordings.get(position)
        return (rec.grad_slots or ()) if rec is not None else ()

    def _drop_generation(self, gen: Any) -> None:
        """Forget the positions captured into ``gen`` (they are recorded again when they run)."""
        for sig in self._signatures.values():
            for pos in [p for p, done in sig.positions.items() if done.generation is gen]:
                del sig.positions[pos]

    def _recording_dropped(self) -> None:
        """The recorded episode is not captured (the runtime asked to wait): the next one is
        recorded instead."""
        for sig in self._signatures.values():
            sig.recordings.clear()

    def _recording_captured(self) -> None:
        """The capture batch is over: recorded signatures replay from now on."""
        for sig in self._signatures.values():
            sig.recordings.clear()
            if sig.phase is Phase.RECORD:
                sig.phase = Phase.READY

    def _capture_forward(self, sig: _Signature, static_inputs: Sequence[Any],
                         outputs: Optional[_Outputs]) -> _Live:
        """Capture the forward over ``static_inputs``; its autograd graph stays live for the
        backward capture. ``outputs``: the structure the eager run returned (``None``: none
        ran, the capture defines it)."""
        rt, plan = self.runtime, self.plan
        gen = plan.generation_for_capture(self.memory_mode)
        graph = rt.create_graph()
        start = _memory.now()
        with self._capturing(graph, gen, "forward"):
            with rt.enable_grad():
                inputs = [rt.detach(b, s.requires_grad) for b, s in zip(static_inputs, sig.shape.specs)]
                args, kwargs = sig.shape.rebuild(inputs)
                result, params = rt.call_with_param_aliases(self.fn, sig.params, args, kwargs)
        captured, outs = self._outputs_of(result)
        if outputs is not None and (captured.spec != outputs.spec or captured.tensor_index != outputs.tensor_index):
            raise CaptureError(f"{self.name}: the captured forward returned a different structure than the "
                               f"eager run; a graphed layer must return the same structure every call.")
        plan.note_capture(gen, id(graph), _memory.now() - start)
        self.captures += 1
        return _Live(gen, graph, tuple(static_inputs), inputs, outs, list(params), outputs or captured,
                     state=self._state_watch(), static_outputs=tuple(rt.detach(o) for o in outs))

    def _capture_backward(self, sig: _Signature, live: _Live, static_grads: Sequence[Any]) -> _Position:
        """Capture the backward of ``live``'s forward; returns the position's record."""
        rt, plan = self.runtime, self.plan
        param_buffers = self._param_buffers(sig.params)
        shape = live.outputs_shape
        outs = [o for o, d in zip(live.outputs, shape.differentiable) if d]
        wrt = [x for x, s in zip(live.inputs, sig.shape.specs) if s.requires_grad]
        graph = rt.create_graph()
        start = _memory.now()
        with self._capturing(graph, live.generation, "backward"):
            # Parameter gradients go into the layer's buffers as autograd produces them (added:
            # the buffers are the parameters' .grad at replay, see _bind_grads; or copied), so
            # the graph holds one parameter's gradient at a time, as eager autograd does.
            # Under the stream-ordered allocator, freeing the forward graph's saved tensors
            # inside this capture would put another graph's allocations into this one; they
            # are released after the capture instead (with ``live``).
            if outs:
                input_grads, param_used = rt.backward_into(
                    outs, list(static_grads), wrt, live.params, param_buffers, accumulate=sig.accumulate,
                    retain_graph=plan.async_allocator)
            else:
                input_grads, param_used = [None] * len(wrt), [False] * len(live.params)
            param_used = tuple(param_used)
        plan.note_capture(live.generation, id(graph), _memory.now() - start)
        self.captures += 1
        it = iter(input_grads)
        return _Position(
            generation=live.generation, fwd_graph=live.graph, bwd_graph=graph, static_inputs=live.static_inputs,
            static_outputs=live.static_outputs, static_grad_outputs=tuple(static_grads),
            static_grad_inputs=tuple(next(it) if s.requires_grad else None for s in sig.shape.specs),
            param_grad_used=param_used, outputs=shape, accumulate=sig.accumulate, linked=live.linked,
            state=live.state, owned=live.owned)

    def _capture_backward_input(self, sig: _Signature, live: _Live, static_grads: Sequence[Any]) -> _InputHalf:
        """Capture the input half of ``live``'s backward; its autograd graph stays live for
        the weight half."""
        rt, plan = self.runtime, self.plan
        outs = [o for o, d in zip(live.outputs, live.outputs_shape.differentiable) if d]
        wrt = [x for x, s in zip(live.inputs, sig.shape.specs) if s.requires_grad]
        graph = rt.create_graph()
        start = _memory.now()
        param_used = (False,) * len(live.params)
        with self._capturing(graph, live.generation, "backward (input half)"):
            if outs:
                input_grads, param_grads, state = rt.backward_input(outs, list(static_grads), wrt, live.params)
                param_used = tuple(g is not None for g in param_grads)
                if any(param_used):
                    # into the layer's parameter-gradient buffers, handed to autograd at replay
                    # (as a full backward's are without accumulation)
                    if sig.accumulate:
                        raise RuntimeError(f"{rt.name} runtime: backward_input returned parameter gradients "
                                           f"for a layer that accumulates inside its graphs")
                    buffers = self._param_buffers(sig.params)
                    rt.copy_many([buffers[i] for i, u in enumerate(param_used) if u],
                                 [g for g in param_grads if g is not None])
                del param_grads
            else:
                input_grads, state = [None] * len(wrt), None
        plan.note_capture(live.generation, id(graph), _memory.now() - start)
        self.captures += 1
        live.outputs = []  # the weight half starts from the state: the outputs' memory may go (see _Live.owned)
        it = iter(input_grads)
        return _InputHalf(live, graph, tuple(static_grads),
                          tuple(next(it) if s.requires_grad else None for s in sig.shape.specs), state, param_used)

    def _capture_backward_weight(self, sig: _Signature, half: _InputHalf) -> _Position:
        """Capture the weight half: every parameter's gradient added into the layer's gradient
        buffers (with accumulation: the buffers a full backward adds into, ``.grad`` at replay),
        or copied into weight-gradient buffers of its own (the schedule's weight pass adds them
        into ``.grad``). The autograd graph kept since the forward is released inside this
        capture, as a full backward releases it."""
        rt, plan, live = self.runtime, self.plan, half.live
        if sig.accumulate:
            buffers = tuple(self._param_buffers(sig.params))
        else:
            if self._weight_grad_buffers is None or len(self._weight_grad_buffers) != len(sig.params):
                self._weight_grad_buffers = [rt.static_like(p) for p in sig.params]
            buffers = tuple(self._weight_grad_buffers)
        move = rt.add_many if sig.accumulate else rt.copy_many
        graph = rt.create_graph()
        start = _memory.now()
        used = [False] * len(sig.params)
        with self._capturing(graph, live.generation, "backward (weight half)"):
            if half.weight_state is not None:
                for index, grads in rt.backward_weight(half.weight_state, live.params):
                    move([buffers[i] for i in index], grads)
                    for i in index:
                        used[i] = True
            half.weight_state = None  # drops the last references to the autograd graph
        plan.note_capture(live.generation, id(graph), _memory.now() - start)
        self.captures += 1
        return _Position(
            generation=live.generation, fwd_graph=live.graph, bwd_graph=half.graph, static_inputs=live.static_inputs,
            static_outputs=live.static_outputs, static_grad_outputs=half.static_grads,
            static_grad_inputs=half.static_grad_inputs, param_grad_used=tuple(used),
            outputs=live.outputs_shape, accumulate=sig.accumulate, linked=live.linked, weight_graph=graph,
            weight_buffers=buffers, state=live.state, input_param_used=half.param_used, owned=live.owned)

    @contextlib.contextmanager
    def _capturing(self, graph: Any, gen: Any, phase: str):
        """Around every capture: compiled code traces the branch that will be captured
        (core.guards), custom all-reduce buffers reserved inside belong to ``graph``
        (core.collectives). Sorts failures: the runtime's and CUDA's (``RuntimeError``) are
        failures of capture; anything else was raised by the layer's own code."""
        rt = self.runtime
        try:
            with _guards.sot_warmup_guard(True), _collectives.capturing_graph(graph, self.name), \
                    rt.capture_to_graph(graph, self.plan.pool_for(gen), generators=self._generators()):
                try:
                    yield
                except GraphedLayerError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    if isinstance(exc, RuntimeError):
                        raise
                    raise _UserError(phase, exc) from exc
        except (_UserError, GraphedLayerError):
            raise
        except Exception as exc:  # noqa: BLE001
            raise _CaptureFailed(phase, exc, gen) from exc

    def _capture_failed(self, key: Any, exc: BaseException) -> Optional[BaseException]:
        """A capture of signature ``key`` failed. Forget its graphs; returns the error to
        raise, or ``None`` when ``fallback="eager"`` turned the layer eager."""
        release_frames(exc)  # the frames below the capture hold its buffers and outputs
        sig = self._signatures.get(key)
        if sig is not None:
            sig.reset()
        if isinstance(exc, _CaptureFailed):
            self.plan.note_aborted(exc.generation)
        if isinstance(exc, _UserError):
            return _with_layer(exc.error, f"{self.name}: raised while capturing the {exc.phase}")
        if not isinstance(exc, _CaptureFailed):
            return exc  # the engine's own errors (GraphedLayerError) and interrupts
        cause = f"{type(exc.error).__name__}: {exc.error}"
        hint = self.runtime.capture_failure_hint(exc.error, self._generators()) or (
            "Graphs cannot contain host synchronisation (.item(), .numpy(), printing a tensor, "
            "data-dependent shapes such as nonzero/masked_select) or CPU work. Move it out of the "
            "layer, or pass fallback='eager'.")
        if self.options.fallback == "eager":
            self._disabled_reason = f"capturing the {exc.phase} failed: {cause}"
            for other in self._signatures.values():
                other.reset()
            self._warn_once("fallback", f"{self.name}: capturing the {exc.phase} failed ({cause}); the layer "
                                        f"runs eagerly from now on (fallback='eager'). {hint}")
            return None
        error = CaptureError(f"{self.name}: capturing the {exc.phase} failed: {cause}. The capture's memory was "
                             f"released; the layer warms up again. {hint}")
        error.__cause__ = exc.error
        return error

    # ------------------------------------------- stream-ordered allocator: capture in step
    def _capture_and_launch_forward(self, call: _Call, sig: _Signature) -> list:
        """Capture this position's forward over a copy of the inputs and launch the capture:
        its launch gives this call's results (graph memory exists only once a graph ran)."""
        rt = self.runtime
        static_inputs = [rt.static_like(t) for t in call.tensors]
        rt.copy_many(static_inputs, call.tensors)  # before capture: a later copy would bump versions
        try:
            live = self._capture_forward(sig, static_inputs, None)
        except BaseException as exc:  # noqa: BLE001
            error = self._fail_in_step(call.key, exc)
            if error is not None:
                raise error from None
            return self._run_eager(call)  # fallback="eager"
        call.live, call.outputs = live, live.outputs_shape
        self.plan.note_replay(live.generation, id(live.graph), True, self.name)
        self._keep_held_outputs(call)
        rt.replay_graph(live.graph)
        self.replays += 1
        call.run = _Run.LAUNCHED_CAPTURE
        return self._hand_out(call, live.outputs)

    def _capture_and_launch_backward(self, call: _Call, sig: _Signature, diff_grads: list) -> list:
        rt, live = self.runtime, call.live
        call.live = None
        static_grads = [rt.static_like(g) for g in diff_grads]
        try:
            done = self._capture_backward(sig, live, static_grads)
        except BaseException as exc:  # noqa: BLE001
            error = self._fail_in_step(call.key, exc)
            raise (error or CaptureError(
                f"{self.name}: capturing the backward failed under the stream-ordered allocator, where no "
                f"eager run stands beside the capture; the layer runs eagerly from the next call on.")) from None
        # The capture's own launches allocated its saved tensors; the graphs are instantiated
        # to free them on relaunch. Keep the tensors referenced so they are not freed twice.
        sig.positions[call.position] = dataclasses.replace(done, keepalive=live)
        return self._replay_backward(call, done, diff_grads)

    def _fail_in_step(self, key: Any, exc: BaseException) -> Optional[BaseException]:
        error = self._capture_failed(key, exc)
        exc = None  # drop the traceback's frames: they hold the capture's tensors
        gc.collect()
        self.runtime.release_cached_memory()
        return error

    # --------------------------------------------------- replaced state, reset
    def _state_watch(self) -> Optional[StateWatch]:
        """The watch a new capture records: the current one while nothing was replaced (every
        position then shares it, and one check per step covers them all), else a new one."""
        watch = self._watch
        if watch is None or watch.changed() is not None:
            slots = self.runtime.state_slots(self.fn)
            watch = self._watch = StateWatch(self.runtime, slots) if slots else None
        return watch

    def _check_state(self, watch: StateWatch) -> None:
        """Refuse to replay graphs whose parameters or buffers were replaced since their capture.
        Checked once per step (episode) and watch: replacing a parameter between the
        micro-batches of one step is not something a training loop does."""
        checked = self._state_checked
        episode = self.queue.episode
        if checked is not None and checked[0] == episode and checked[1] is watch:
            return
        what = watch.changed()
        if what is not None:
            raise StateReplacedError(
                f"{self.name}: {what} since its CUDA graphs were captured; replaying them would compute with "
                f"the old memory, so the layer refuses to. Change parameters and buffers in place "
                f"(module.load_state_dict(...) without assign=True, param.copy_(...) under no_grad) rather than assigning new "
                f"tensors or storage. If the replacement is meant (a dtype round trip, a checkpoint loader that "
                f"rebinds tensors), call paddle_graphpp.reset_graphs(model) between steps: it makes every graphed layer "
                f"of the model forget its graphs and capture them anew, against the new tensors, after warmup.")
        self._state_checked = (episode, watch)

    def reset(self) -> None:
        """Forget every graph and recording of this layer, as if it were newly wrapped: each
        signature warms up and is captured again, reading the layer's parameters and buffers
        anew. Its graph memory is freed with the graphs (positions of other layers keep theirs;
        new captures go into a new pool generation).

        Raises:
            GraphScheduleError: micro-batches of this layer are in flight (run their backwards first).
        """
        if self.in_flight:
            raise GraphScheduleError(
                f"{self.name}: reset with {self.in_flight} micro-batch(es) in flight; run their "
                f"backwards first (reset between steps).")
        self.process.forget(self)
        self._signatures.clear()
        self._param_grad_buffers = self._weight_grad_buffers = None
        self._disabled_reason = None
        self._warned.clear()
        self._watch = self._state_checked = None

    # ----------------------------------------------------------------- helpers
    def _outputs_of(self, result: Any) -> tuple:
        """The output structure of ``result`` and its tensors."""
        rt = self.runtime
        leaves, spec = flatten(result)
        index = tuple(i for i, x in enumerate(leaves) if rt.is_tensor(x))
        if not index:
            raise SignatureError(f"{self.name}: the wrapped layer returned no tensor; a graphed layer "
                                 f"must return at least one tensor.")
        tensors = [leaves[i] for i in index]
        shape = _Outputs(tuple(None if i in index else x for i, x in enumerate(leaves)), spec, index,
                         tuple(rt.spec(t).requires_grad for t in tensors))
        return shape, tensors

    def _hand_off(self, targets: list, grads: list) -> list:
        """Give autograd gradients it may keep. A leaf with no gradient yet may adopt the tensor
        it is handed, and a static buffer would then be overwritten by the next replay. Where
        the framework adopts only tensors nobody else holds (PyTorch), handing over the held
        buffers themselves is safe; elsewhere (Paddle) such leaves get copies."""
        rt = self.runtime
        if not rt.adopts_held_gradients:
            return grads
        adopt = [i for i in rt.leaves_without_grad(targets) if grads[i] is not None]
        if adopt:
            for i, c in zip(adopt, rt.clone_many([grads[i] for i in adopt])):
                grads[i] = c
        return grads

    def _sum_grads(self, first: list, second: list) -> list:
        """Per parameter, the sum of two optional gradients (new tensors where both exist)."""
        rt = self.runtime
        both = [i for i, (a, b) in enumerate(zip(first, second)) if a is not None and b is not None]
        out = [a if a is not None else b for a, b in zip(first, second)]
        if both:
            sums = rt.clone_many([first[i] for i in both])
            rt.add_many(sums, [second[i] for i in both])
            for i, total in zip(both, sums):
                out[i] = total
        return out

    def _bind_grads(self, params: list, buffers: list) -> None:
        """Make each buffer its parameter's ``.grad``, keeping the gradient's value: an unset
        ``.grad`` becomes the zeroed buffer, another tensor is copied into it."""
        rt = self.runtime
        unset, dst, src = [], [], []
        for p, b in zip(params, buffers):
            g = rt.grad_of(p)
            if g is b:
                continue
            if g is None:
                unset.append(b)
            else:
                dst.append(b)
                src.append(g)
            rt.set_grad(p, b)
        rt.zero_many(unset)
        rt.copy_many(dst, src)

    def _generators(self) -> tuple:
        """The generators named by the ``generators`` option, read at each capture."""
        chosen = self.options.generators
        if chosen is None:
            return ()
        return tuple(chosen() if callable(chosen) else chosen)

    def _param_buffers(self, params: Sequence[Any]) -> list:
        if self._param_grad_buffers is None or len(self._param_grad_buffers) != len(params):
            self._param_grad_buffers = [self.runtime.static_like(p) for p in params]
        return self._param_grad_buffers

    def _signature_key(self, leaves, tensor_index, specs, spec):
        """Everything a capture bakes in: tensor specs, non-tensor arguments, the argument
        structure, train/eval mode (dropout on or off) and mixed precision."""
        tensor_pos = set(tensor_index)
        consts = tuple(_const_key(x) for i, x in enumerate(leaves) if i not in tensor_pos)
        mode = (getattr(self.fn, "training", None), self.runtime.mode_key())
        return (specs, consts, _hashable_spec(spec), mode)

    def _signature_for(self, call: _Call) -> Optional[_Signature]:
        sig = self._signatures.get(call.key)
        if sig is not None:
            return sig
        if len(self._signatures) >= self.options.max_signatures:
            self._warn_once(("full", call.key),
                            f"{self.name}: input signature {_describe(call.shape.specs)} is new and "
                            f"{self.options.max_signatures} signatures are already captured "
                            f"(max_signatures); it runs eagerly. Pad inputs to a few fixed shapes, or "
                            f"raise max_signatures.")
            return None
        if self._signatures:
            logger.info("%s: new input signature %s; it will be warmed up and captured anew",
                        self.name, _describe(call.shape.specs))
        sig = self._signatures[call.key] = _Signature(call.key, _describe(call.shape.specs), call.shape)
        return sig

    def _warn_once(self, key, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    # ------------------------------------------------------------ inspection
    @property
    def in_flight(self) -> int:
        return len(self.queue)

    def graph_count(self) -> int:
        return sum(2 + (p.weight_graph is not None) for s in self._signatures.values() for p in s.positions.values())

    def position_kinds(self) -> dict:
        """Captured positions by backward: ``{"full": n, "split": m}`` (split: an input half and
        a weight half, as zero-bubble schedules run them)."""
        done = [p for s in self._signatures.values() for p in s.positions.values()]
        split = sum(p.weight_graph is not None for p in done)
        return {"full": len(done) - split, "split": split}

    def phase(self, key: Any = None) -> Optional[Phase]:
        """The phase of signature ``key`` (default: the only signature), or ``None``."""
        if key is None:
            if len(self._signatures) != 1:
                return None
            return next(iter(self._signatures.values())).phase
        sig = self._signatures.get(key)
        return sig.phase if sig is not None else None


def _with_layer(error: BaseException, context: str) -> BaseException:
    """``error``'s type with the layer named, chained to ``error``; the original (with a
    note) where the type cannot be rebuilt from a message."""
    try:
        new = type(error)(f"{context}: {error}")
    except Exception:  # noqa: BLE001 - a constructor that wants other arguments
        error.add_note(context)
        return error
    new.__cause__ = error
    return new


def _buffer_key(spec: TensorSpec):
    return (spec.shape, spec.dtype, spec.device)


def _const_key(x):
    try:
        hash(x)
        return (type(x).__name__, x)
    except TypeError:
        return (type(x).__name__, repr(x))


def _hashable_spec(spec):
    if spec[0] == "leaf":
        return "leaf"
    kind, meta, children = spec
    meta_key = tuple(meta) if kind == "dict" else (meta.__name__ if isinstance(meta, type) else None)
    return (kind, meta_key, tuple(_hashable_spec(c) for c in children))


def _describe(specs: Sequence[TensorSpec]) -> str:
    return "(" + "; ".join(s.describe() for s in specs) + ")"


def node_forward(ctx: Any, call: _Call) -> tuple:
    """Body of a runtime's custom autograd function forward: run the call, keep it on ``ctx``,
    and mark the outputs that carry no gradient."""
    outputs = call.forward()
    ctx.call = call  # kept after backward: a second backward must reach the FIFO check and fail there
    frozen = [o for o, d in zip(outputs, call.differentiable) if not d]
    if frozen:
        ctx.mark_non_differentiable(*frozen)
    return tuple(outputs)


def node_backward(ctx: Any, grads: Sequence[Any], weights_wanted: bool = True) -> list:
    """Body of the matching backward: one gradient (or ``None``) per tensor input and parameter.
    ``weights_wanted=False`` (the runtime saw that autograd asks for no parameter gradient)
    runs the input half of a split backward; the next backward through ``ctx`` the weight half."""
    return ctx.call.backward(list(grads), weights_wanted)


_ACCUMULATE_DOC = """        accumulate_grads: ``"auto"`` (default) adds parameter gradients into ``.grad``
            inside the backward graph (``.grad`` becomes a buffer the layer owns), except where
            a parameter's accumulation runs hooks (DistributedDataParallel, Python accumulation
            hooks): there autograd accumulates, and the hooks see every gradient. ``True``
            forces it (an error with such hooks); ``False`` turns it off (the layer then keeps
            a second set of gradient buffers).
"""

_GENERATORS_DOC = """        generators: random generators the layer draws from besides the default CUDA
            generator (always registered), as a list or a callable returning one; each
            capture registers them so every replay draws fresh numbers from them. The
            generators of Megatron-Core's RNG tracker are found and registered without this
            (``model_parallel_cuda_manual_seed(..., use_cudagraphable_rng=True)``).
"""

#: The documentation of both frameworks' graphed layer classes (formatted per framework).
GRAPHED_LAYER_DOC = """Wrap ``{arg}`` so that, after warmup, its forward and backward replay CUDA graphs.

    Calls ``1..num_warmup_steps`` run eagerly. The next step (from a moment no micro-batch is
    in flight) runs eagerly too and is recorded; at the start of the step after it, every
    recorded micro-batch position of every graphed layer is captured in the order the step
    ran them, into one memory pool, and that step replays. Each position of the schedule
    gets its own forward/backward graph pair; backwards pair with forwards in FIFO order, so
    1F1B and interleaved schedules work.

    Args:
        {arg}: the {base} to graph. Its parameters must stay on the GPU at fixed addresses.
        num_warmup_steps: eager calls per input signature before recording.
        fallback: ``"error"`` (default) raises :class:`paddle_graphpp.CaptureError` when capture
            fails; ``"eager"`` warns once and keeps running eagerly.
        memory: ``"shared"`` (default: one pool, static buffers shared by lifetime) or
            ``"per_graph"`` (a pool per graph, upstream Paddle's design).
        max_in_flight: forwards that may await their backward before that is an error.
        max_signatures: input signatures captured; later new ones run eagerly with a warning.
{accumulate}{generators}{extra}        name: the name used in messages (default: the class name of ``{arg}``).

    Without CUDA (or with CPU inputs) it runs eagerly and warns once. Under ``{no_grad}`` it
    always runs eagerly.

    .. warning:: Outputs alias graph memory until the same micro-batch position is replayed
       again, or, for an output the recorded step had freed within the step, until the graphs
       captured after that point run. (PyTorch) An output object still referenced then is first
       moved to memory of its own, so the outputs themselves keep their values when kept (a
       schedule keeping them to return them merged), at the cost of a copy; tensors made from
       them without a copy (``out.detach()``, a slice, a view) are not moved and are
       overwritten: clone those (or keep them in the recorded step too, which keeps the memory).
       (Paddle) outputs are overwritten: clone what you keep.
    .. warning:: Do not modify outputs in place, and do not replace parameters or buffers
       (assigning new tensors or storage to them, ``module.to(dtype)``) after capture: graphs
       read fixed addresses, and the next replay raises
       :class:`paddle_graphpp.StateReplacedError` (call :func:`paddle_graphpp.reset_graphs`
       on the model to capture anew). In-place updates (optimizers, ``load_state_dict``) are fine.
    .. warning:: Code inside must not synchronise with the host (``.item()``, printing tensors,
       data-dependent shapes); capture fails with a :class:`paddle_graphpp.CaptureError`.
       Other exceptions raised by its code during capture keep their type, with the layer named.
    .. warning:: Gradient hooks on tensors inside the wrapped {base} run at capture only; hooks
       on its inputs, outputs and parameters work as usual.
    .. warning:: The schedule must repeat every step: graphs are replayed in capture order, and a
       different order raises :class:`paddle_graphpp.GraphScheduleError` (use ``memory="per_graph"``).
    .. warning:: (PyTorch) A backward that asks for input gradients only (``torch.autograd.grad``
       w.r.t. the inputs, as zero-bubble schedules' input pass does) runs the input half; the
       micro-batch stays in flight until a backward asks for the parameters' gradients (the
       weight pass), which receives them as autograd would (the schedule adds them into ``.grad``).
       With ``accumulate_grads`` (default ``"auto"``) the weight graph adds them into ``.grad``
       itself and ``torch.distributed.pipelining``'s weight pass is handed each parameter's
       whole sum with ``.grad`` unset, which it puts back into ``.grad``; per-micro-batch
       parameter gradients do not exist then, and any other weight pass raises
       :class:`paddle_graphpp.GraphScheduleError` (pass ``accumulate_grads=False`` for it).
    """


def graphed_layer_doc(*, arg: str, base: str, no_grad: str, accumulate_grads: bool, generators: bool,
                      extra_args: str = "") -> str:
    """:data:`GRAPHED_LAYER_DOC` for one framework's class (``accumulate_grads``,
    ``generators``: whether its constructor takes that argument; ``extra_args``: the entries of
    the framework's own arguments, indented as the others)."""
    return GRAPHED_LAYER_DOC.format(arg=arg, base=base, no_grad=no_grad,
                                    accumulate=_ACCUMULATE_DOC if accumulate_grads else "",
                                    generators=_GENERATORS_DOC if generators else "", extra=extra_args)


def graphed_engine(wrapped: Any, runtime: GraphRuntime, trainable: Callable[[], list], *, kind: str,
                   name: Optional[str], **options: Any) -> GraphedCallable:
    """The engine behind a framework's graphed layer class (``kind`` names that class)."""
    return GraphedCallable(wrapped, runtime, trainable, name=name or f"{kind}({type(wrapped).__name__})",
                           options=EngineOptions(**options))


def reset_graphs(model: Any) -> int:
    """Make every graphed layer in ``model`` (``model`` itself included) forget its graphs and
    capture them anew after warmup, against the parameters and buffers it has now.

    Call it between steps after replacing parameters or buffers on purpose (a dtype round
    trip, a checkpoint loader that assigns new tensors): replays of the old graphs raise
    :class:`paddle_graphpp.StateReplacedError`. Resetting all layers of a model together keeps
    chained layers (one graphed layer reading another's output) linked in the new capture.
    In-place loads (``load_state_dict``) need no reset.

    Args:
        model: a ``torch.nn.Module`` or ``paddle.nn.Layer``.

    Returns:
        The number of graphed layers reset.

    Raises:
        GraphScheduleError: a micro-batch is in flight in one of them (nothing is reset).
    """
    subs = runtime_for(model).submodules(model)
    # Graphed layer classes expose their engine as ``engine`` (blocks graphed in place by
    # ``paddle_graphpp.torch.graph_layers`` hold theirs outside the module tree).
    engines = list({id(e): e for e in (getattr(m, "engine", None) for m in subs)
                    if isinstance(e, GraphedCallable)}.values())
    busy = [e.name for e in engines if e.in_flight]
    if busy:
        raise GraphScheduleError(f"reset_graphs: micro-batches are in flight in {busy[:4]}; run their "
                                 f"backwards first (reset between steps). Nothing was reset.")
    for engine in engines:
        engine.reset()
    return len(engines)
