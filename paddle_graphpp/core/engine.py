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
    static buffers that position will use, in the episode's
    :class:`~paddle_graphpp.core.recording.Recording`.
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
eagerly with one warning. A signature is never replayed into another's graph. A layer whose
capture failed with ``fallback="eager"`` is in phase ``EAGER`` for good. Every transition
is one of :class:`~paddle_graphpp.core.phases.LayerPhases`'s.

Backwards pair with forwards through the layer's FIFO (:mod:`paddle_graphpp.core.schedule`),
so 1F1B and interleaved schedules work. Memory modes are described in
:mod:`paddle_graphpp.core.memory`.

One micro-batch's path through a layer, top to bottom: :meth:`GraphedCallable.__call__` keys
the call by signature, lets the process capture a recorded episode that is due
(:meth:`~paddle_graphpp.core.capture.Process.capture_if_due`), and enters the runtime's custom
autograd function, which runs :meth:`GraphedCallable.forward`: warm up or run eagerly
(:meth:`run_eager`, recording the position when the signature is armed), or replay the
position's forward graph (:mod:`.replay`); under the stream-ordered allocator capture and launch it
(:mod:`.in_step`). The call waits in the layer's FIFO; its backward
(:mod:`.backward`) replays the position's backward graph, or runs autograd (and records it).
A recorded episode is captured by a :class:`~paddle_graphpp.core.batch.CaptureBatch`, which
asks each layer's :class:`~paddle_graphpp.core.layer_capture.LayerCapture` for its graphs in
the recorded order.

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
import logging
import weakref
from typing import Any, Callable, Optional, Sequence

from . import memory as _memory
from .backward import Backward
from .scope import layers_inlined
from .capture import Process, process_for
from .errors import GraphScheduleError, SignatureError
from .in_step import InStepCapture
from .layer_capture import LayerCapture
from .phases import LayerPhases
from .options import GRAPHED_LAYER_DOC, EngineOptions, graphed_layer_doc
from .recompute import LayerRecompute
from .records import (Call, CallShape, Launched, Outputs, Phase, PositionRecord, RanEager, Replayed, Signature,
                      SignatureKey, signature_key_parts)
from .runtime import GraphRuntime, capabilities, runtime_for
from .replay import Replays
from .schedule import InFlightQueue
from .state import LayerStateCheck
from .tree import flatten
from .warn import warn

__all__ = ["GraphedCallable", "EngineOptions", "Phase", "GRAPHED_LAYER_DOC", "graphed_layer_doc", "graphed_engine",
           "graphed_label", "HoldsEngine", "node_forward", "node_backward", "reset_graphs", "drop_in_flight"]

logger = logging.getLogger("paddle_graphpp")


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
        self.caps = capabilities(runtime)
        self.params = params
        self.name = name
        self.options = options
        self.memory_mode = options.validate(name)
        if options.accumulate_grads is True and self.caps.accumulation is None:
            raise ValueError(f"{name}: accumulate_grads=True is not supported by the {runtime.name} runtime; "
                             "leave it 'auto' or False (gradients then reach .grad through autograd).")
        self.queue = InFlightQueue(name, options.max_in_flight)
        _LIVE_ENGINES.add(self)
        self.phases = LayerPhases(name, options.max_signatures)  # its signatures; the only code moving them
        self._param_grad_buffers: Optional[list] = None
        self._weight_grad_buffers: Optional[list] = None  # split backward: what the weight half writes
        self._warned: set = set()
        self.state = LayerStateCheck(runtime, fn, name)  # replays refuse replaced parameters and buffers
        self.recomputing = LayerRecompute(self)  # whether calls recompute; the RNG mirrors
        #: Entered around each capture of the layer: the layer as its graphs read it (a front door
        #: sets it where the layer's parameters are swapped out between calls, as FSDP2 does).
        self.capture_view: Callable[[], Any] = contextlib.nullcontext
        self.replays = 0  # forward + backward graph replays, for tests and telemetry
        self.captures = 0
        #: Set by :meth:`retire` (a front door's ``undo()``): what to call instead of this layer.
        self.retired: Optional[str] = None
        self.backward = Backward(self)
        self.capture = LayerCapture(self)
        self.in_step = InStepCapture(self)
        self.replay = Replays(self)

    @property
    def process(self) -> Process:
        return process_for(self.runtime)

    @property
    def plan(self) -> "_memory.MemoryPlan":
        return self.process.plan

    # ------------------------------------------------------------------ entry
    def __call__(self, args: tuple, kwargs: dict) -> Any:
        if self.retired is not None:
            raise RuntimeError(f"{self.name} was undone and its graphs released; {self.retired}")
        rt = self.runtime
        if not rt.grad_enabled():
            return self.fn(*args, **kwargs)  # inference: no backward will pair with it
        if layers_inlined() or rt.is_capturing():  # an enclosing graph captures this call's work (core.scope)
            if self.caps.lending is not None:
                self.caps.lending.end_borrowed_work()  # no eager work routed into a pool (see below)
            return self.fn(*args, **kwargs)
        leaves, spec = flatten((args, kwargs))
        tensor_index = [i for i, x in enumerate(leaves) if rt.is_tensor(x)]
        tensors = [leaves[i] for i in tensor_index]
        specs = tuple(rt.spec(t) for t in tensors)
        consts, structure = signature_key_parts(leaves, tensor_index, spec)
        key = SignatureKey((specs, consts, structure, (getattr(self.fn, "training", None), self.caps.mode_key()),
                            self.recomputing.when()))
        sig = self.phases.get(key)
        if sig is not None:
            key = sig.key  # hashed once; the tables keyed by it find it by identity
        # Parameters are read while a signature warms up; its graphs keep the tuple they were
        # captured against (walking module.parameters() on every replay would cost more than
        # the replay itself).
        params = sig.params if sig is not None and sig.params is not None else tuple(self.params())
        if not params and not any(s.requires_grad for s in specs):
            return self.fn(*args, **kwargs)  # nothing to differentiate
        if self.caps.lending is not None:
            self.caps.lending.end_borrowed_work()  # before any capture: no eager work routed into a pool
        reason = self.phases.eager_reason or rt.graphs_unavailable_reason(tensors)
        if reason is not None:
            self.warn_once("unavailable", f"{self.name}: CUDA graphs are not used ({reason}); running eagerly.")
        else:
            proc = self.process
            proc.replay_watch.check()  # a replay that never completed, or a peer's failed capture
            proc.capture_if_due()  # a recorded episode is captured before the next one starts
        if sig is not None:
            shape = sig.shape
        else:
            slots = set(tensor_index)
            shape = CallShape(tuple(None if i in slots else x for i, x in enumerate(leaves)), spec,
                              tuple(tensor_index), specs)
        call = Call(self, key, shape, tensors, params, reason is not None)
        outputs = rt.apply_graphed_function(call, tensors, params)
        return call.outputs.rebuild(outputs)

    # --------------------------------------------------------------- forward
    def forward(self, call: Call) -> list:
        """The forward of ``call`` inside the runtime's autograd function (see :meth:`Call.forward`):
        its FIFO position, then the run its signature's phase asks for."""
        self.process.poll_watches()
        clock = self.process.clock
        sig = None if call.force_eager else self.phases.add(call, self.warn_once)
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
            return self._forward_as(call, sig)
        except BaseException:
            self.queue.discard(call)
            clock.forward_done()
            if sig is not None:
                sig.busy.discard(call.position)
            raise

    def _forward_as(self, call: Call, sig: Optional[Signature]) -> list:
        """Run the forward as the signature's phase says: warm up, replay, capture in step, or
        run eagerly and record."""
        if sig is None or sig.phase is Phase.WARMUP:
            if sig is not None:
                sig.warm += 1
            return self.run_eager(call)
        done = sig.positions.get(call.position)
        if done is not None:
            if done.linked and not self.replay.inputs_in_place(call, done):
                self.replay.unreplayed(call, sig, "forward")
                return self.run_eager(call)
            return self.replay.forward(call, done)
        if self.plan.async_allocator:
            return self.in_step.forward(call, sig)
        outputs = self.run_eager(call)  # a position not captured yet: run it, record it
        self._record_forward(call, sig)
        return outputs

    def _leave_warmup(self, sig: Signature, call: Call) -> None:
        """Fix the signature's parameters and gradient path; record from this episode on
        (or capture in step under the stream-ordered allocator)."""
        params = tuple(call.params)
        if sig.key.recompute:
            self.recomputing.check()
        accumulate = self.process.grad_owners.choose(self.capture, params, self.options.accumulate_grads,
                                                     self.caps.accumulation)
        self.phases.leave_warmup(sig, params, accumulate, in_step=self.plan.async_allocator)

    def accumulates_in_graphs(self, param: Any) -> bool:
        """Whether this layer's graphs add ``param``'s gradient into ``.grad`` (a signature past
        warmup that accumulates and holds ``param``, and the layer not turned eager)."""
        return self.phases.accumulates(param)

    def run_eager(self, call: Call) -> list:
        """Run the call eagerly, keeping its autograd graph for the backward."""
        rt = self.runtime
        with rt.enable_grad():
            inner = [rt.detach(t, s.requires_grad) for t, s in zip(call.tensors, call.shape.specs)]
            args, kwargs = call.shape.rebuild(inner)
            recompute = self.caps.recomputation if call.key.recompute else None
            run = recompute.call_checkpointed if recompute is not None else rt.call_with_param_aliases
            result, inner_params = run(self.fn, call.params, args, kwargs)
        call.outputs, outs = self.outputs_of(result)
        call.run = RanEager(inner, outs, inner_params)
        return [rt.detach(o) for o in outs]

    def _record_forward(self, call: Call, sig: Signature) -> None:
        """Keep what capturing this position needs: the slots of its static input buffers
        (taken over from positions whose backward has run, see core.memory), or links to the
        recorded layers whose outputs the inputs are, and its output structure."""
        rec, run = self.process.recorder(), call.run
        reuse = self.memory_mode is not _memory.MemoryMode.PER_GRAPH
        slots = tuple((rec.link_of("out", t) if reuse else None) or rec.buffer_slot(s, reuse=reuse)
                      for t, s in zip(call.tensors, call.shape.specs))
        sig.recordings[call.position] = PositionRecord(slots, call.outputs)
        rec.record(self.capture, call.key, call.position, forward=True)
        if reuse:
            rec.note_produced(self.capture, call.key, call.position, "out", run.outputs)
            rec.watch_outputs(self.capture, call.key, call.position, run.outputs, [*run.inputs, *run.params])
        call.run = dataclasses.replace(run, recorded=True)

    # ------------------------------------------------------------------ reset
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
        self.process.forget(self.capture)
        self.phases.reset()
        self._param_grad_buffers = self._weight_grad_buffers = None
        self.recomputing.reset()
        self._warned.clear()
        self.state.reset()

    def check_undo(self) -> None:
        """What :meth:`retire` checks first; a front door undoing several layers checks them all
        before retiring any, so that a refusal changes nothing.

        Raises:
            GraphScheduleError: micro-batches of this layer are in flight.
            RuntimeError: retired already (undone twice).
        """
        if self.retired is not None:
            raise RuntimeError(f"{self.name}: undo() was called twice; it is undone already ({self.retired})")
        if self.in_flight:
            raise GraphScheduleError(
                f"{self.name}: undo() with {self.in_flight} micro-batch(es) in flight; run their backwards first "
                f"(undo between steps), or drop them with paddle_graphpp.drop_in_flight(model). Nothing was undone.")

    def retire(self, fix: str) -> None:
        """Release this layer's graphs for good (:meth:`reset`), as a front door's ``undo()`` does:
        every later call raises ``RuntimeError`` naming the layer and ``fix`` (what to call instead).
        Raises what :meth:`check_undo` raises."""
        self.check_undo()
        self.reset()
        self.retired = fix

    # ----------------------------------------------------------------- helpers
    def outputs_of(self, result: Any) -> tuple:
        """The output structure of ``result`` and its tensors."""
        rt = self.runtime
        leaves, spec = flatten(result)
        index = tuple(i for i, x in enumerate(leaves) if rt.is_tensor(x))
        if not index:
            raise SignatureError(f"{self.name}: the wrapped layer returned no tensor; a graphed layer "
                                 f"must return at least one tensor.")
        tensors = [leaves[i] for i in index]
        shape = Outputs(tuple(None if i in index else x for i, x in enumerate(leaves)), spec, index,
                        tuple(rt.spec(t).requires_grad for t in tensors))
        return shape, tensors

    def generators(self) -> tuple:
        """The generators named by the ``generators`` option, read at each capture."""
        chosen = self.options.generators
        if chosen is None:
            return ()
        return tuple(chosen() if callable(chosen) else chosen)

    def param_buffers(self, params: Sequence[Any]) -> list:
        """The layer's parameter-gradient buffers (made at its first capture)."""
        if self._param_grad_buffers is None or len(self._param_grad_buffers) != len(params):
            self._param_grad_buffers = [self.runtime.static_like(p) for p in params]
        return self._param_grad_buffers

    def weight_buffers(self, params: Sequence[Any]) -> list:
        """The buffers a split backward's weight half writes without accumulation."""
        if self._weight_grad_buffers is None or len(self._weight_grad_buffers) != len(params):
            self._weight_grad_buffers = [self.runtime.static_like(p) for p in params]
        return self._weight_grad_buffers

    def warn_once(self, key, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn(message)

    # ------------------------------------------------------------ inspection
    def signature(self, key: Any) -> Optional[Signature]:
        """The signature ``key``, or ``None`` (the engine's own record, for its parts)."""
        return self.phases.get(key)

    def signatures(self) -> dict:
        """``{key: SignatureView}``: each input signature's phase, accumulation and captured
        positions (copies, for inspection)."""
        return self.phases.views()

    def positions(self) -> list:
        """Every captured :class:`~paddle_graphpp.core.records.Position` of the layer, by signature
        in the order they were first seen, then by position."""
        return self.phases.positions()

    @property
    def param_grad_buffers(self) -> Optional[list]:
        """The buffers the backward graphs write parameter gradients into (``None`` before a capture)."""
        return self._param_grad_buffers

    @property
    def weight_grad_buffers(self) -> Optional[list]:
        """The buffers split backwards' weight halves write into without accumulation (or ``None``)."""
        return self._weight_grad_buffers

    @property
    def in_flight(self) -> int:
        return len(self.queue)

    def graph_count(self) -> int:
        return sum(2 + (p.weight_graph is not None) for p in self.positions())

    def position_kinds(self) -> dict:
        """Captured positions by backward: ``{"full": n, "split": m}`` (split: an input half and
        a weight half, as zero-bubble schedules run them)."""
        done = self.positions()
        split = sum(p.weight_graph is not None for p in done)
        return {"full": len(done) - split, "split": split}

    def phase(self, key: Any = None) -> Optional[Phase]:
        """The phase of signature ``key`` (default: the only signature), or ``None``; ``EAGER``
        once the layer went eager for good."""
        return self.phases.phase(key)


def node_forward(ctx: Any, call: Call) -> tuple:
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


def graphed_label(kind: str, module: Any, name: Optional[str]) -> str:
    """The name a graphed layer goes by in errors and logs: ``name``, else ``Kind(ModuleClass)``
    (``kind`` names the framework's graphed layer class)."""
    return name or f"{kind}({type(module).__name__})"


def graphed_engine(wrapped: Any, runtime: GraphRuntime, trainable: Callable[[], list], *, name: str,
                   options: EngineOptions) -> GraphedCallable:
    """The engine behind a framework's graphed layer class, named ``name`` (:func:`graphed_label`),
    with the ``options`` its front door gathered (:func:`~paddle_graphpp.core.options.engine_options`)."""
    return GraphedCallable(wrapped, runtime, trainable, name=name, options=options)


class HoldsEngine:
    """Mixed into a framework's graphed layer class (before the framework's module class): the
    engine it calls, ``engine``, ``reset_graphs()`` and ``undo()``. The class sets ``_engine``, and
    names the attribute holding the wrapped layer in ``_wraps``."""

    _engine: GraphedCallable
    _wraps: str

    def undo(self) -> Any:
        """Release this wrapper's graphs and return the layer it wraps, which graphing left
        unchanged; the wrapper refuses calls afterwards (wrap the layer again to graph it).

        Raises:
            GraphScheduleError: micro-batches are in flight (run their backwards first: undo
                between steps). Nothing is changed then.
            RuntimeError: undone already.
        """
        self._engine.retire(f"call the {type(getattr(self, self._wraps)).__name__} that undo() returned, "
                            f"or wrap it again")
        return getattr(self, self._wraps)

    def reset_graphs(self) -> None:
        """Forget this layer's graphs; they are captured anew after warmup, against the
        parameters and buffers it has now (see :func:`paddle_graphpp.reset_graphs`, which resets
        every graphed layer of a model at once)."""
        self._engine.reset()

    @property
    def engine(self) -> GraphedCallable:
        """The engine: ``replays``, ``captures``, ``in_flight`` and ``graph_count()`` for inspection."""
        return self._engine


def _engines_of(model: Any) -> list:
    """The engines of the graphed layers in ``model`` (``model`` itself included; a list or tuple
    of models: all of theirs; ``None``: every graphed layer alive in the process), each once."""
    if model is None:
        return [e for e in list(_LIVE_ENGINES) if e.in_flight]
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    found: dict = {}
    for m in models:
        tree = capabilities(runtime_for(m)).tree
        subs = tree.submodules(m) if tree is not None else [m]
        # Graphed layer classes expose their engine as ``engine`` (blocks graphed in place by
        # ``paddle_graphpp.torch.graph_layers`` hold theirs outside the module tree).
        found.update({id(e): e for e in (getattr(s, "engine", None) for s in subs) if isinstance(e, GraphedCallable)})
    return list(found.values())


_LIVE_ENGINES: "weakref.WeakSet[GraphedCallable]" = weakref.WeakSet()  # for drop_in_flight()


def _drop_engine_in_flight(engine: GraphedCallable) -> int:
    """Forget ``engine``'s micro-batches in flight (see :func:`drop_in_flight`): each leaves the
    FIFO, the process clock and its pool generation's count of micro-batches in flight, so that
    the next step may start the capture order again. Returns how many were dropped."""
    dropped = engine.queue.drop_all()
    for call in dropped:
        call.anchor = None
        call.end()  # it keeps no tensor (its outputs, if still held, keep their own memory)
        run, sig = call.run, engine.phases.get(call.key)
        if isinstance(run, Replayed):
            gen = run.position.generation
        elif isinstance(run, Launched):
            done = sig.positions.get(call.position) if sig is not None else None
            gen = run.live.generation if run.live is not None else (done.generation if done else None)
        else:
            gen = None  # ran eagerly: a recording keeps only complete positions
        engine.plan.note_dropped(gen)
        engine.process.clock.forward_done()
        if sig is not None:
            sig.busy.discard(call.position)
    if dropped:
        logger.warning("%s: %d micro-batch(es) in flight dropped; their backwards will not run", engine.name,
                       len(dropped))
    return len(dropped)


def drop_in_flight(model: Any = None) -> int:
    """Forget the micro-batches in flight in every graphed layer of ``model``: after a step
    that raised between forwards and their backwards (a batch skipped on an error, a schedule
    interrupted), before the next step. Without it the next backward raises
    ``GraphScheduleError`` (backwards must follow their forwards' order) and no graph is
    captured again, since a step never ends. Outputs of the dropped micro-batches may be
    overwritten by the next replays: do not use them. Backwards that ran before the error have
    added their gradients already: zero the gradients (``optimizer.zero_grad()``) to skip the
    step. Without ``model``, every graphed layer of the process forgets its micro-batches; with
    models (stages, chunks), a warning says when graphed layers outside them still hold some.

    Args:
        model: a ``torch.nn.Module`` or ``paddle.nn.Layer``, a list of them, or ``None`` (every
            graphed layer alive in this process).

    Returns:
        The number of micro-batches dropped.
    """
    engines = _engines_of(model)
    dropped = sum(_drop_engine_in_flight(engine) for engine in engines)
    for proc in {id(e.process): e.process for e in engines}.values():
        lending = proc.caps.lending
        if lending is not None:
            lending.end_borrowed_work()
        if proc.clock.in_flight:
            logger.warning("drop_in_flight: %d micro-batch(es) are still in flight in graphed layers outside the "
                           "models given; no graph is captured until they end. Pass those models too.",
                           proc.clock.in_flight)
        else:
            proc.plan.reset_flight()  # nothing in flight anywhere: every pool's capture order starts again
    return dropped


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
    engines = _engines_of(model)
    busy = [e.name for e in engines if e.in_flight]
    if busy:
        raise GraphScheduleError(f"reset_graphs: micro-batches are in flight in {busy[:4]}; run their "
                                 f"backwards first (reset between steps). Nothing was reset.")
    for engine in engines:
        engine.reset()
    return len(engines)
