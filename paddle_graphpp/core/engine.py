"""The graph engine: one graphed layer's life, from warmup to replay (:class:`GraphedCallable`).

Calls are keyed by signature and go through the layer's :class:`~paddle_graphpp.core.lifecycle.Lifecycle`:
``num_warmup_steps`` eager forwards, one recorded episode, then every recorded position captured
at the next episode start, in the order the step ran them, into one pool generation, and
replayed from then on (under the stream-ordered allocator each position is captured in the step
it first runs in). Backwards pair with forwards through the layer's FIFO, so 1F1B, interleaved
and zero-bubble schedules (a backward in an input half and a weight half) work. Guarantees: a
signature is never replayed into another's graph; a position the captured step did not have
runs eagerly and is captured next; failures are reported as the lifecycle says
(:class:`~paddle_graphpp.CaptureError`, or ``fallback="eager"``). docs/architecture.md walks one
micro-batch through every object named here.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Optional, Sequence

from . import memory as _memory
from .backward import Backward
from .scope import layers_inlined
from .capture import EpisodeCapture, capture_for
from .errors import GraphScheduleError
from .grad_owners import GradPath
from .in_step import InStepCapture
from .layer_capture import LayerCapture
from .layer import EngineHooks, GradBuffers, Layer
from .lifecycle import Lifecycle, signature_key
from .options import GRAPHED_LAYER_DOC, EngineOptions, graphed_layer_doc
from .process import current_process
from .recompute import LayerRecompute
from .records import Call, CallShape, Launched, Phase, PositionRecord, RanEager, Replayed, Signature
from .runtime import GraphRuntime, capabilities, runtime_for
from .replay import Replays
from .schedule import InFlightQueue
from .state import LayerStateCheck
from .tree import flatten

__all__ = ["GraphedCallable", "EngineOptions", "Phase", "GRAPHED_LAYER_DOC", "graphed_layer_doc", "graphed_engine",
           "graphed_label", "HoldsEngine", "node_forward", "node_backward", "weight_pending", "EngineHooks",
           "reset_graphs", "drop_in_flight"]

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
        hooks: what the front door adds (:class:`~paddle_graphpp.core.layer.EngineHooks`).

    Its parts are made here and given what each uses: the layer (:class:`~paddle_graphpp.core.layer.Layer`),
    its lifecycle, FIFO, state check, gradient buffers and each other; none is given the engine.
    """

    def __init__(self, fn: Callable, runtime: GraphRuntime, params: Callable[[], list], *,
                 name: str, options: EngineOptions, hooks: Optional[EngineHooks] = None):
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
        current_process().engines.add(self)
        # Its signatures, the only code moving them, its capture and replay counts and warnings.
        self.phases = Lifecycle(name, max_signatures=options.max_signatures,
                                num_warmup_steps=options.num_warmup_steps, fallback=options.fallback)
        self.layer = layer = Layer(name=name, fn=fn, runtime=runtime, caps=self.caps, options=options,
                                   memory_mode=self.memory_mode, params=params, hooks=hooks or EngineHooks(),
                                   process=functools.partial(capture_for, runtime))
        self.buffers = GradBuffers(runtime)  # what the backward graphs write parameter gradients into
        self.state = LayerStateCheck(runtime, fn, name)  # replays refuse replaced parameters and buffers
        self.recomputing = LayerRecompute(layer)  # whether calls recompute; the RNG mirrors
        #: Set by :meth:`retire` (a front door's ``undo()``): what to call instead of this layer.
        self.retired: Optional[str] = None
        parts = dict(lifecycle=self.phases, state=self.state, recomputing=self.recomputing)
        self.capture = LayerCapture(layer, buffers=self.buffers, **parts)
        self.replay = Replays(layer, queue=self.queue, participant=self.capture, **parts)
        self.in_step = InStepCapture(layer, capture=self.capture, replay=self.replay)
        self.backward = Backward(layer, queue=self.queue, buffers=self.buffers, replay=self.replay,
                                 capture=self.capture, in_step=self.in_step, **parts)

    @property
    def process(self) -> EpisodeCapture:
        return capture_for(self.runtime)

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
        key, tensor_index, specs = signature_key(
            rt, leaves, spec, context=((getattr(self.fn, "training", None), self.caps.mode_key()),
                                       self.recomputing.when()))
        tensors = [leaves[i] for i in tensor_index]
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
            self.warn_once("unavailable", _unavailable_message(rt, self.name, reason))
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
        proc = self.process
        proc.poll_watches()
        clock = proc.clock
        sig = None if call.force_eager else self.phases.add(call.key, call.shape)
        episode = clock.forward_started()
        first_in_episode = self.queue.episode != episode
        try:
            if sig is not None and sig.phase is Phase.WARMUP and first_in_episode and self.phases.warmed(sig):
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
            outputs = self.in_step.forward(call, sig)
            return outputs if outputs is not None else self.run_eager(call)  # None: it fell back to eager
        outputs = self.run_eager(call)  # a position not captured yet: run it, record it
        self._record_forward(call, sig)
        return outputs

    def _leave_warmup(self, sig: Signature, call: Call) -> None:
        """Fix the signature's parameters and gradient path; record from this episode on
        (or capture in step under the stream-ordered allocator)."""
        params = tuple(call.params)
        if sig.key.recompute:
            self.recomputing.check()
        outside = self.layer.hooks.summed_outside()
        path = self.process.grad_owners.choose(self.capture, params, self.options.accumulate_grads,
                                               self.caps.accumulation, outside, self.buffers.path)
        self.buffers.follow(path, params)
        self.phases.leave_warmup(sig, params, path is not GradPath.AUTOGRAD, in_step=self.plan.async_allocator)

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
        self.buffers.reset()
        self.recomputing.reset()
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
        return self.layer.outputs_of(result)

    def generators(self) -> tuple:
        """The generators named by the ``generators`` option, read at each capture."""
        return self.layer.generators()

    def warn_once(self, key, message: str) -> None:
        self.phases.warn_once(key, message)

    @property
    def captures(self) -> int:
        """Graphs captured (forward and backward counted apart), as every scope counts them."""
        return self.phases.captures

    @property
    def replays(self) -> int:
        """Graph launches (forward and backward counted apart), as every scope counts them."""
        return self.phases.replays

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
        """The buffers the backward graphs write parameter gradients into (``None`` before a
        capture; a library's own, such as Megatron-Core's ``main_grad``, from warmup's end on)."""
        return self.buffers.params

    @property
    def weight_grad_buffers(self) -> Optional[list]:
        """The buffers split backwards' weight halves write into without accumulation (or ``None``)."""
        return self.buffers.weights

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
    outputs = call.engine.forward(call)
    ctx.call = call  # kept after backward: a second backward must reach the FIFO check and fail there
    frozen = [o for o, d in zip(outputs, call.differentiable) if not d]
    if frozen:
        ctx.mark_non_differentiable(*frozen)
    return tuple(outputs)


def node_backward(ctx: Any, grads: Sequence[Any], weights_wanted: bool = True) -> list:
    """Body of the matching backward: one gradient (or ``None``) per tensor input and parameter.
    ``weights_wanted=False`` (the runtime saw that autograd asks for no parameter gradient)
    runs the input half of a split backward; the next backward through ``ctx`` the weight half."""
    return ctx.call.engine.backward.run(ctx.call, list(grads), weights_wanted)


def weight_pending(call: Call) -> bool:
    """The input half of ``call``'s backward ran and its weight half has not."""
    return call.engine.queue.awaits_weight(call)


def graphed_label(kind: str, module: Any, name: Optional[str]) -> str:
    """The name a graphed layer goes by in errors and logs: ``name``, else ``Kind(ModuleClass)``
    (``kind`` names the framework's graphed layer class)."""
    return name or f"{kind}({type(module).__name__})"


def graphed_engine(wrapped: Any, runtime: GraphRuntime, trainable: Callable[[], list], *, name: str,
                   options: EngineOptions, hooks: Optional[EngineHooks] = None) -> GraphedCallable:
    """The engine behind a framework's graphed layer class, named ``name`` (:func:`graphed_label`),
    with the ``options`` its front door gathered (:func:`~paddle_graphpp.core.options.engine_options`)
    and the ``hooks`` it adds (:func:`~paddle_graphpp.core.layer.hooks_for`)."""
    return GraphedCallable(wrapped, runtime, trainable, name=name, options=options, hooks=hooks)


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
        return [e for e in list(current_process().engines) if e.in_flight]
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    found: dict = {}
    for m in models:
        tree = capabilities(runtime_for(m)).tree
        subs = tree.submodules(m) if tree is not None else [m]
        # Graphed layer classes expose their engine as ``engine`` (blocks graphed in place by
        # ``paddle_graphpp.torch.graph_layers`` hold theirs outside the module tree).
        found.update({id(e): e for e in (getattr(s, "engine", None) for s in subs) if isinstance(e, GraphedCallable)})
    return list(found.values())


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


def _unavailable_message(runtime: GraphRuntime, name: str, reason: str) -> str:
    """The warning of a layer whose calls run eagerly for ``reason``. A reason that holds without
    any input (no CUDA device, a framework build without CUDA) holds for every layer of the
    process: its text names no layer, so that Python's warning filter shows it once per calling
    line, not once per layer of the model."""
    if reason == runtime.graphs_unavailable_reason(()):
        return f"CUDA graphs are not used ({reason}); graphed layers are running eagerly."
    return f"{name}: CUDA graphs are not used ({reason}); running eagerly."
