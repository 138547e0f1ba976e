"""The graph engine: warmup, capture of forward and backward, replay, FIFO pairing.

One :class:`GraphedCallable` serves one wrapped layer. Its life, per input signature:

1. **Warmup.** The first ``num_warmup_steps`` forwards (and until no micro-batch is in flight
   in any graphed layer, so that capture starts at the beginning of an episode) run eagerly
   inside the autograd function.
2. **Capture.** In the next episode, the forward at each position runs eagerly for its
   results and is captured into a graph on the side; its backward likewise. Capture does not
   execute, and nothing is replayed right after capture: the eager run's results are the
   call's results. Graphs are captured in execution order into the shared pool.
3. **Replay.** Later episodes copy inputs into the position's static buffers and replay;
   backward copies incoming gradients in and replays the backward graph.

A new signature (shape, dtype, device, requires-grad, or a non-tensor argument) is warmed up
and captured anew, up to ``max_signatures``; past that it runs eagerly with one warning.
A signature is never replayed into another's graph.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from . import collectives as _collectives
from . import guards as _guards
from . import memory as _memory
from .errors import CaptureError, SignatureError
from .runtime import GraphRuntime, TensorSpec
from .schedule import InFlightQueue
from .tree import flatten, unflatten

__all__ = ["GraphedCallable", "EngineOptions", "GRAPHED_LAYER_DOC", "graphed_engine", "node_forward",
           "node_backward"]

logger = logging.getLogger("paddle_graphpp")

_FALLBACKS = ("error", "eager")


@dataclass(kw_only=True, slots=True)
class EngineOptions:
    """Settings of one graphed layer (validated on construction)."""

    num_warmup_steps: int = 3
    """Eager forwards per signature before capture (capture also waits for an empty FIFO)."""
    fallback: str = "error"
    """``"error"``: a failed capture raises :class:`CaptureError`. ``"eager"``: warn once and
    keep running this layer eagerly."""
    memory: str = "shared"
    """``"shared"``, ``"shared_reuse"`` or ``"per_graph"``; see :mod:`paddle_graphpp.core.memory`."""
    max_in_flight: int = 64
    """Forwards that may wait for their backward before that is an error."""
    max_signatures: int = 4
    """Input signatures captured per layer; further ones run eagerly with a warning."""
    accumulate_grads: bool = False
    """Accumulate parameter gradients into ``.grad`` inside the backward graph (one in-graph
    add per parameter) instead of copying them into a shared buffer that autograd then adds
    to ``.grad``. Saves a pass over the weight gradients and the eager accumulation launches
    per micro-batch; ``.grad`` becomes a buffer the layer owns. Autograd's accumulation
    hooks on these parameters do not run (refused where they are registered)."""

    def validate(self, owner: str) -> "_memory.MemoryMode":
        if not isinstance(self.num_warmup_steps, int) or self.num_warmup_steps < 0:
            raise ValueError(f"{owner}: num_warmup_steps must be an int >= 0, got {self.num_warmup_steps!r}")
        if self.fallback not in _FALLBACKS:
            raise ValueError(f"{owner}: fallback must be one of {_FALLBACKS}, got {self.fallback!r}")
        if not isinstance(self.max_signatures, int) or self.max_signatures < 1:
            raise ValueError(f"{owner}: max_signatures must be an int >= 1, got {self.max_signatures!r}")
        if not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise ValueError(f"{owner}: max_in_flight must be an int >= 1, got {self.max_in_flight!r}")
        if not isinstance(self.accumulate_grads, bool):
            raise ValueError(f"{owner}: accumulate_grads must be a bool, got {self.accumulate_grads!r}")
        return _memory.MemoryMode.parse(self.memory, owner)


@dataclass(slots=True)
class _GraphPair:
    """Forward and backward graphs of one (signature, position), with their static buffers."""

    generation: Any
    fwd_graph: Any
    static_inputs: list  # one per tensor input
    static_outputs: list  # detached aliases of the forward graph's outputs
    capture_inputs: Optional[list] = None  # autograd-tracked views used at capture, until bwd capture
    capture_params: Optional[list] = None  # parameter aliases the capture differentiated against
    capture_outputs: Optional[list] = None
    bwd_graph: Any = None
    static_grad_outputs: list = field(default_factory=list)
    static_grad_inputs: list = field(default_factory=list)  # one per tensor input (None if no grad)
    param_grad_used: list = field(default_factory=list)  # per parameter: does this graph produce a grad
    differentiable: list = field(default_factory=list)  # per output tensor
    out_template: tuple = ()  # (output leaves, spec, tensor positions) of the captured call


class _Signature:
    __slots__ = ("warm", "armed", "pairs", "describe", "busy", "params")

    def __init__(self, describe: str):
        self.warm = 0
        self.armed = False
        self.params: Optional[list] = None  # the parameters the graphs were captured against
        self.pairs: dict[int, _GraphPair] = {}
        self.describe = describe
        self.busy: set = set()  # per_graph mode: slots whose backward has not run

    def free_slot(self) -> int:
        """Lowest slot not in flight: ``per_graph`` recycles a pair once its backward ran."""
        slot = 0
        while slot in self.busy:
            slot += 1
        return slot


EAGER, CAPTURE, REPLAY, CAPTURE_REPLAY = "eager", "capture", "replay", "capture_replay"


class _Call:
    """One forward call and, later, its backward. Created per call; lives in the FIFO."""

    __slots__ = ("engine", "key", "leaves", "spec", "tensor_index", "tensors", "params", "specs",
                 "force_eager", "kind", "pair", "position", "differentiable", "out_spec",
                 "out_leaves", "out_tensor_index", "inner_inputs", "inner_outputs", "inner_params")

    def __init__(self, engine, key, leaves, spec, tensor_index, tensors, params, specs, force_eager):
        self.engine = engine
        self.key = key
        self.leaves = leaves
        self.spec = spec
        self.tensor_index = tensor_index
        self.tensors = tensors
        self.params = params
        self.specs = specs
        self.force_eager = force_eager
        self.kind = EAGER
        self.pair = None
        self.position = -1
        self.differentiable: list = []
        self.inner_outputs = None

    def forward(self) -> list:
        return self.engine._forward(self)

    def backward(self, grads: Sequence[Any]) -> list:
        return self.engine._backward(self, grads)


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
        if options.accumulate_grads and not runtime.accumulates_grads_in_graph:
            raise ValueError(f"{name}: accumulate_grads=True is not supported by the {runtime.name} runtime; "
                             "leave it False (gradients then reach .grad through autograd).")
        self.queue = InFlightQueue(name, options.max_in_flight)
        self.plan = _memory.plan_for(runtime)
        self._signatures: dict[Any, _Signature] = {}
        self._param_grad_buffers: Optional[list] = None
        self._disabled_reason: Optional[str] = None
        self._warned: set = set()
        self.replays = 0  # forward + backward graph replays, for tests and telemetry
        self.captures = 0

    # ------------------------------------------------------------------ entry
    def __call__(self, args: tuple, kwargs: dict) -> Any:
        rt = self.runtime
        leaves, spec = flatten((args, kwargs))
        tensor_index = [i for i, x in enumerate(leaves) if rt.is_tensor(x)]
        tensors = [leaves[i] for i in tensor_index]
        if not rt.grad_enabled():
            return self.fn(*args, **kwargs)  # inference: no backward will pair with it
        specs = [rt.spec(t) for t in tensors]
        key = self._signature_key(leaves, tensor_index, specs, spec)
        sig = self._signatures.get(key)
        # Parameters are read while a signature warms up; its graphs keep the list they were
        # captured against (walking module.parameters() on every replay would cost more than
        # the replay itself).
        params = sig.params if sig is not None and sig.params is not None else list(self.params())
        if not params and not any(s.requires_grad for s in specs):
            return self.fn(*args, **kwargs)  # nothing to differentiate
        reason = self._disabled_reason or rt.graphs_unavailable_reason(tensors)
        if reason is not None:
            self._warn_once("unavailable", f"{self.name}: CUDA graphs are not used ({reason}); running eagerly.")
        call = _Call(self, key, leaves, spec, tensor_index, tensors, params, specs, reason is not None)
        outputs = rt.apply_graphed_function(call, tensors, params)
        out_leaves = list(call.out_leaves)
        for i, t in zip(call.out_tensor_index, outputs):
            out_leaves[i] = t
        return unflatten(call.out_spec, out_leaves)

    # --------------------------------------------------------------- forward
    def _forward(self, call: _Call) -> list:
        sig = None if call.force_eager else self._signature_for(call)
        if self.plan.in_flight == 0:  # no micro-batch in flight in any graphed layer: a new episode
            self.plan.episode += 1
        first_in_episode = self.queue.episode != self.plan.episode
        if sig is not None and not sig.armed and sig.warm >= self.options.num_warmup_steps and first_in_episode:
            sig.armed = True
            sig.params = list(call.params)
        call.position = self.queue.push(call, call.key, episode=self.plan.episode)
        self.plan.in_flight += 1
        if sig is not None and self.memory_mode is _memory.MemoryMode.PER_GRAPH:
            # Upstream semantics: one pair per in-flight slot, safe because no pool is shared.
            call.position = sig.free_slot()
            sig.busy.add(call.position)
        try:
            if sig is None or not sig.armed:
                if sig is not None:
                    sig.warm += 1
                return self._run_eager(call)
            pair = sig.pairs.get(call.position)
            if pair is not None and pair.bwd_graph is not None:
                return self._replay_forward(call, pair)
            if self.plan.async_allocator:
                # Graph memory of the stream-ordered allocator exists only once its graph has run:
                # nothing allocated in a capture may be freed before a launch. So here the
                # capture's own launch gives the results (no eager run beside it).
                self._capture_forward(call, sig, fill_inputs=True)
                if call.kind == CAPTURE:
                    out = self._replay_forward(call, call.pair, copy_inputs=False)
                    call.kind = CAPTURE_REPLAY
                    return out
                return self._run_eager(call)  # capture failed, fallback="eager"
            outputs = self._run_eager(call)
            self._capture_forward(call, sig)
            return outputs
        except BaseException:
            self.queue.discard(call)
            self.plan.in_flight -= 1
            if sig is not None:
                sig.busy.discard(call.position)
            raise

    def _run_eager(self, call: _Call) -> list:
        rt = self.runtime
        call.kind = EAGER
        with rt.enable_grad():
            inner = [rt.detach(t, s.requires_grad) for t, s in zip(call.tensors, call.specs)]
            args, kwargs = self._rebuild(call, inner)
            result, call.inner_params = rt.call_with_param_aliases(self.fn, call.params, args, kwargs)
        out_leaves, out_spec = flatten(result)
        self._set_outputs(call, out_leaves, out_spec)
        call.inner_inputs = inner
        call.inner_outputs = [out_leaves[i] for i in call.out_tensor_index]
        call.differentiable = [rt.spec(o).requires_grad for o in call.inner_outputs]
        return [rt.detach(o) for o in call.inner_outputs]

    def _capture_forward(self, call: _Call, sig: _Signature, fill_inputs: bool = False) -> None:
        """Capture the forward at ``call.position``. With ``fill_inputs`` the static inputs get
        the call's values first (the capture is launched right after; copying later would bump
        the version of tensors the capture saved for backward)."""
        rt, plan = self.runtime, self.plan
        gen = plan.generation_for_capture(self.memory_mode)
        reuse = self.memory_mode is _memory.MemoryMode.SHARED_REUSE
        static_inputs = []
        for t, s in zip(call.tensors, call.specs):
            buf = plan.take_buffer(gen, _buffer_key(s)) if reuse else None
            static_inputs.append(buf if buf is not None else rt.static_like(t))
        if fill_inputs:
            rt.copy_many(static_inputs, call.tensors)
        pool = plan.pool_for(gen)
        graph = rt.create_graph()
        start = _memory.now()
        try:
            with _capture_guard(graph, self.name), rt.capture_to_graph(graph, pool):
                with rt.enable_grad():
                    cap_in = [rt.detach(b, s.requires_grad) for b, s in zip(static_inputs, call.specs)]
                    args, kwargs = self._rebuild(call, cap_in)
                    result, cap_params = rt.call_with_param_aliases(self.fn, call.params, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure inside capture is reported the same way
            del graph, static_inputs
            self._capture_failed(call, gen, "forward", exc)
            return
        cap_leaves, cap_spec = flatten(result)
        if call.inner_outputs is None:  # no eager run beside the capture: its outputs define the call's
            self._set_outputs(call, cap_leaves, cap_spec)
            call.differentiable = [rt.spec(cap_leaves[i]).requires_grad for i in call.out_tensor_index]
        elif cap_spec != call.out_spec or len(cap_leaves) != len(call.out_leaves):
            raise CaptureError(f"{self.name}: the captured forward returned a different structure than the "
                               f"eager run; a graphed layer must return the same structure every call.")
        cap_out = [cap_leaves[i] for i in call.out_tensor_index]
        plan.note_capture(gen, id(graph), _memory.now() - start, forward=True)
        self.captures += 1
        sig.pairs[call.position] = _GraphPair(
            generation=gen, fwd_graph=graph, static_inputs=static_inputs,
            static_outputs=[rt.detach(o) for o in cap_out], capture_inputs=cap_in, capture_outputs=cap_out,
            capture_params=cap_params, differentiable=list(call.differentiable),
            out_template=(list(call.out_leaves), call.out_spec, list(call.out_tensor_index)))
        call.kind = CAPTURE
        call.pair = sig.pairs[call.position]

    def _replay_forward(self, call: _Call, pair: _GraphPair, copy_inputs: bool = True) -> list:
        rt = self.runtime
        self.plan.note_replay(pair.generation, id(pair.fwd_graph), True, self.name)
        _collectives.check_replay(pair.fwd_graph)
        if copy_inputs:
            rt.copy_many(pair.static_inputs, call.tensors)
        rt.replay_graph(pair.fwd_graph)
        self.replays += 1
        call.kind, call.pair = REPLAY, pair
        self._set_outputs(call, *pair.out_template)
        call.differentiable = list(pair.differentiable)
        return [rt.detach(o) for o in pair.static_outputs]

    # -------------------------------------------------------------- backward
    def _backward(self, call: _Call, grads: Sequence[Any]) -> list:
        self.queue.pop(call)
        self.plan.in_flight -= 1
        sig = self._signatures.get(call.key)
        if sig is not None:
            sig.busy.discard(call.position)
        diff_grads = [g for g, d in zip(grads, call.differentiable) if d]
        if call.kind == REPLAY:
            return self._replay_backward(call, diff_grads)
        if call.kind == CAPTURE_REPLAY:  # stream-ordered allocator: capture, then run the capture
            self._capture_backward(call, diff_grads)
            if call.pair.bwd_graph is None:  # failed with fallback="eager": no eager graph to use here
                raise CaptureError(f"{self.name}: capturing the backward failed under the stream-ordered "
                                   f"allocator, where no eager run stands beside the capture; the layer "
                                   f"runs eagerly from the next call on.")
            return self._replay_backward(call, diff_grads)
        result = self._eager_backward(call, diff_grads)
        if call.kind == CAPTURE:
            self._capture_backward(call, diff_grads)
            if self.options.accumulate_grads and call.pair.bwd_graph is not None:
                result = self._accumulate_eagerly(call, result)
        call.inner_inputs = call.inner_outputs = call.inner_params = None
        return result

    def _eager_backward(self, call: _Call, diff_grads: list) -> list:
        rt = self.runtime
        outs = [o for o, d in zip(call.inner_outputs, call.differentiable) if d]
        wrt = [x for x, s in zip(call.inner_inputs, call.specs) if s.requires_grad] + call.inner_params
        got = iter(rt.autograd_grad(outs, diff_grads, wrt) if outs else [None] * len(wrt))
        input_grads = [next(got) if s.requires_grad else None for s in call.specs]
        return input_grads + list(got)

    def _accumulate_eagerly(self, call: _Call, result: list) -> list:
        """The capture step under ``accumulate_grads``: add the eager run's parameter gradients
        into the buffers the replays will accumulate into, and bind those as ``.grad`` now, so
        ``.grad`` keeps one address from the first graphed step on."""
        n_in = len(call.specs)
        used = [(p, b, g) for p, b, g in zip(call.params, self._param_grad_buffers, result[n_in:]) if g is not None]
        if used:
            self._bind_grads([p for p, _, _ in used], [b for _, b, _ in used])
            self.runtime.add_many([b for _, b, _ in used], [g for _, _, g in used])
        return result[:n_in] + [None] * len(call.params)

    def _capture_backward(self, call: _Call, diff_grads: list) -> None:
        rt, plan, pair = self.runtime, self.plan, call.pair
        gen = pair.generation
        reuse = self.memory_mode is _memory.MemoryMode.SHARED_REUSE
        static_grads = []
        for g in diff_grads:
            buf = plan.take_buffer(gen, _buffer_key(rt.spec(g))) if reuse else None
            static_grads.append(buf if buf is not None else rt.static_like(g))
        param_buffers = self._param_buffers(call.params)
        accumulate = self.options.accumulate_grads
        hooked = rt.params_with_grad_hooks(call.params) if accumulate else []
        outs = [o for o, d in zip(pair.capture_outputs, call.differentiable) if d]
        wrt = [x for x, s in zip(pair.capture_inputs, call.specs) if s.requires_grad] + pair.capture_params
        pool = plan.pool_for(gen)
        graph = rt.create_graph()
        start = _memory.now()
        try:
            if hooked:
                raise ValueError(
                    f"accumulate_grads=True bypasses autograd's gradient accumulation, but parameters "
                    f"{hooked[:4]} have accumulation hooks (e.g. DistributedDataParallel's); leave "
                    f"accumulate_grads False for this layer")
            with _capture_guard(graph, self.name), rt.capture_to_graph(graph, pool):
                # Under the stream-ordered allocator, freeing the forward graph's saved tensors
                # inside this capture would put another graph's allocations into this one;
                # they are released after the capture instead.
                got = (rt.autograd_grad(outs, static_grads, wrt, retain_graph=plan.async_allocator)
                       if outs else [None] * len(wrt))
                n_in = len(wrt) - len(call.params)
                input_grads = got[:n_in]
                param_used = [g is not None for g in got[n_in:]]
                used = [(b, g) for b, g in zip(param_buffers, got[n_in:]) if g is not None]
                if used:
                    # accumulate: the buffers are the parameters' .grad at replay (_bind_grads)
                    (rt.add_many if accumulate else rt.copy_many)([b for b, _ in used], [g for _, g in used])
                # The parameter gradients now live in the shared buffers; free the graph's own
                # copies inside the capture (a capture's allocation freed before its graph first
                # runs is an error under the stream-ordered allocator).
                del got, used
        except Exception as exc:  # noqa: BLE001
            del graph
            pair.capture_inputs = pair.capture_outputs = pair.capture_params = None
            self._drop_pair(call)
            self._capture_failed(call, gen, "backward", exc)
            return
        plan.note_capture(gen, id(graph), _memory.now() - start, forward=False)
        self.captures += 1
        it = iter(input_grads)
        pair.static_grad_inputs = [next(it) if s.requires_grad else None for s in call.specs]
        pair.param_grad_used = param_used
        pair.static_grad_outputs = static_grads
        pair.bwd_graph = graph
        if not plan.async_allocator:  # the capture's autograd graph is spent: let its memory go
            pair.capture_inputs = pair.capture_outputs = pair.capture_params = None
        if reuse:
            for buf, s in zip(pair.static_inputs, call.specs):
                plan.release_buffer(gen, _buffer_key(s), buf)
            for buf in static_grads:
                plan.release_buffer(gen, _buffer_key(rt.spec(buf)), buf)

    def _replay_backward(self, call: _Call, diff_grads: list) -> list:
        rt, pair = self.runtime, call.pair
        self.plan.note_replay(pair.generation, id(pair.bwd_graph), False, self.name)
        _collectives.check_replay(pair.bwd_graph)
        if pair.static_grad_outputs:
            rt.copy_many(pair.static_grad_outputs, diff_grads)
        accumulate = self.options.accumulate_grads
        if accumulate:  # the graph adds into the buffers: make them the parameters' .grad first
            used = [(p, b) for p, b, u in zip(call.params, self._param_grad_buffers, pair.param_grad_used) if u]
            self._bind_grads([p for p, _ in used], [b for _, b in used])
        rt.replay_graph(pair.bwd_graph)
        self.replays += 1
        if accumulate:
            param_grads = [None] * len(call.params)
        else:
            param_grads = [b if used else None for b, used in zip(self._param_grad_buffers, pair.param_grad_used)]
        return self._hand_off(call.tensors + call.params, list(pair.static_grad_inputs) + param_grads)

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

    # ----------------------------------------------------------------- helpers
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

    def _param_buffers(self, params: list) -> list:
        if self._param_grad_buffers is None or len(self._param_grad_buffers) != len(params):
            self._param_grad_buffers = [self.runtime.static_like(p) for p in params]
        return self._param_grad_buffers

    def _signature_key(self, leaves, tensor_index, specs, spec):
        """Everything a capture bakes in: tensor specs, non-tensor arguments, the argument
        structure, train/eval mode (dropout on or off) and mixed precision."""
        tensor_pos = set(tensor_index)
        consts = tuple(_const_key(x) for i, x in enumerate(leaves) if i not in tensor_pos)
        mode = (getattr(self.fn, "training", None), self.runtime.mode_key())
        return (tuple(specs), consts, _hashable_spec(spec), mode)

    def _signature_for(self, call: _Call) -> Optional[_Signature]:
        sig = self._signatures.get(call.key)
        if sig is not None:
            return sig
        if len(self._signatures) >= self.options.max_signatures:
            self._warn_once(("full", call.key),
                            f"{self.name}: input signature {_describe(call.specs)} is new and "
                            f"{self.options.max_signatures} signatures are already captured "
                            f"(max_signatures); it runs eagerly. Pad inputs to a few fixed shapes, or "
                            f"raise max_signatures.")
            return None
        if self._signatures:
            logger.info("%s: new input signature %s; it will be warmed up and captured anew",
                        self.name, _describe(call.specs))
        sig = self._signatures[call.key] = _Signature(_describe(call.specs))
        return sig

    def _rebuild(self, call: _Call, tensors: list) -> tuple:
        leaves = list(call.leaves)
        for i, t in zip(call.tensor_index, tensors):
            leaves[i] = t
        return unflatten(call.spec, leaves)

    def _set_outputs(self, call: _Call, out_leaves: list, out_spec: Any, tensor_index=None) -> None:
        rt = self.runtime
        if tensor_index is None:
            tensor_index = [i for i, x in enumerate(out_leaves) if rt.is_tensor(x)]
            if not tensor_index:
                raise SignatureError(f"{self.name}: the wrapped layer returned no tensor; a graphed layer "
                                     f"must return at least one tensor.")
        call.out_leaves = out_leaves
        call.out_spec = out_spec
        call.out_tensor_index = tensor_index

    def _drop_pair(self, call: _Call) -> None:
        sig = self._signatures.get(call.key)
        if sig is not None:
            sig.pairs.pop(call.position, None)

    def _capture_failed(self, call: _Call, gen, phase: str, exc: BaseException) -> None:
        rt = self.runtime
        cause = f"{type(exc).__name__}: {exc}"
        try:
            rt.abort_capture()
        finally:
            self.plan.note_aborted(gen)
            self._drop_pair(call)
            exc = None  # drop the traceback's frames: they hold the capture's tensors
            gc.collect()
            rt.release_cached_memory()
        hint = ("Graphs cannot contain host synchronisation (.item(), .numpy(), printing a tensor, "
                "data-dependent shapes such as nonzero/masked_select) or CPU work. Move it out of the "
                "layer, mark the layer not capturable, or pass fallback='eager'.")
        if self.options.fallback == "eager":
            self._disabled_reason = f"capturing the {phase} failed: {cause}"
            self._warn_once("fallback", f"{self.name}: capturing the {phase} failed ({cause}); the layer "
                                        f"runs eagerly from now on (fallback='eager'). {hint}")
            call.kind = EAGER
            return
        raise CaptureError(f"{self.name}: capturing the {phase} failed: {cause}. The capture's memory was "
                           f"released. {hint}") from None

    def _warn_once(self, key, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    # ------------------------------------------------------------ inspection
    @property
    def in_flight(self) -> int:
        return len(self.queue)

    def graph_count(self) -> int:
        return sum(int(p.fwd_graph is not None) + int(p.bwd_graph is not None)
                   for s in self._signatures.values() for p in s.pairs.values())


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


def _describe(specs: list) -> str:
    return "(" + "; ".join(s.describe() for s in specs) + ")"


@contextlib.contextmanager
def _capture_guard(graph: Any, owner: str):
    """Around every capture: compiled code traces the branch that will be captured
    (core.guards), and custom all-reduce buffers reserved inside belong to ``graph``
    (core.collectives), so they are unregistered when the graph is freed."""
    with _guards.sot_warmup_guard(True), _collectives.capturing_graph(graph, owner):
        yield


def node_forward(ctx: Any, call: _Call) -> tuple:
    """Body of a runtime's custom autograd function forward: run the call, keep it on ``ctx``,
    and mark the outputs that carry no gradient."""
    outputs = call.forward()
    ctx.call = call  # kept after backward: a second backward must reach the FIFO check and fail there
    frozen = [o for o, d in zip(outputs, call.differentiable) if not d]
    if frozen:
        ctx.mark_non_differentiable(*frozen)
    return tuple(outputs)


def node_backward(ctx: Any, grads: Sequence[Any]) -> list:
    """Body of the matching backward: one gradient (or ``None``) per tensor input and parameter."""
    return ctx.call.backward(list(grads))


#: The documentation of both frameworks' graphed layer classes (formatted per framework).
GRAPHED_LAYER_DOC = """Wrap ``{arg}`` so that, after warmup, its forward and backward replay CUDA graphs.

    Calls ``1..num_warmup_steps`` run eagerly; capture starts at the next moment no
    micro-batch is in flight and runs during a real step (the eager run gives that step's
    results; nothing is replayed right after capture). Each micro-batch position of the
    schedule gets its own forward/backward graph pair; backwards pair with forwards in FIFO
    order, so 1F1B and interleaved schedules work. All graphs share one memory pool.

    Args:
        {arg}: the {base} to graph. Its parameters must stay on the GPU at fixed addresses.
        num_warmup_steps: eager calls per input signature before capture.
        fallback: ``"error"`` (default) raises :class:`paddle_graphpp.CaptureError` when capture
            fails; ``"eager"`` warns once and keeps running eagerly.
        memory: ``"shared"`` (default), ``"shared_reuse"`` or ``"per_graph"``.
        max_in_flight: forwards that may await their backward before that is an error.
        max_signatures: input signatures captured; later new ones run eagerly with a warning.
        accumulate_grads: add parameter gradients into ``.grad`` inside the backward graph
            (``.grad`` becomes a buffer the layer owns; PyTorch only; not with accumulation
            hooks such as DDP's on these parameters). Default ``False``.
        name: the name used in messages (default: the class name of ``{arg}``).

    Without CUDA (or with CPU inputs) it runs eagerly and warns once. Under ``{no_grad}`` it
    always runs eagerly.

    .. warning:: Outputs alias graph memory: they are valid until the same micro-batch position
       is replayed again (the next step). Clone an output you keep across steps (a logged loss).
    .. warning:: Do not modify outputs in place, and do not replace parameters (assigning new
       storage to them): graphs read fixed addresses. In-place optimizer updates are fine.
    .. warning:: Code inside must not synchronise with the host (``.item()``, printing tensors,
       data-dependent shapes); capture fails with a :class:`paddle_graphpp.CaptureError`.
    .. warning:: Gradient hooks on tensors inside the wrapped {base} run at capture only; hooks
       on its inputs, outputs and parameters work as usual.
    .. warning:: The schedule must repeat every step: graphs are replayed in capture order, and a
       different order raises :class:`paddle_graphpp.GraphScheduleError` (use ``memory="per_graph"``).
    """


def graphed_engine(wrapped: Any, runtime: GraphRuntime, trainable: Callable[[], list], *, kind: str,
                   name: Optional[str], **options: Any) -> GraphedCallable:
    """The engine behind a framework's graphed layer class (``kind`` names that class)."""
    return GraphedCallable(wrapped, runtime, trainable, name=name or f"{kind}({type(wrapped).__name__})",
                           options=EngineOptions(**options))
