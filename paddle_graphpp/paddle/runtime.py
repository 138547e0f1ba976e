"""PaddlePaddle adapter for the graph engine: :class:`PaddleRuntime` implements
:class:`~paddle_graphpp.core.runtime.GraphRuntime` (each member's contract is there) and the
capabilities it declares.

Random numbers need no registration from Python: Paddle's dropout kernel registers its generator
state with the capturing graph, and each replay puts back the state that was current before it.
There is no :class:`~paddle_graphpp.core.runtime.OutputRelease`: a handed-out output still held
when a replay overwrites its memory is named in a warning and reads the new values (clone what
you keep). Exercised on CPU only, where graphed calls run eagerly (docs/paddle.md).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional, Sequence

import paddle
from paddle.autograd import PyLayer

from .. import support as _support
from ..core.engine import node_backward, node_forward, weight_pending
from ..core.process import current_process
from ..core.runtime import (AutocastModes, CaptureHints, GraphRuntime, MemoryTelemetry, ModelTree, Recompute,
                            SplitBackward, StateSlots, StreamOrderedAllocator, TensorSpec, get_runtime)
from ..core.state import module_state_slots
from . import recompute as _recompute
from . import split_backward as _split
from .memory.allocator import async_allocator_active as _async_allocator_active

__all__ = ["PaddleRuntime", "RUNTIME", "active_runtime"]


_INTEGRAL = frozenset({"bool", "uint8", "int8", "int16", "int32", "int64"})  # dtypes without gradients


class _GraphedPyLayer(PyLayer):
    """Autograd node of one graphed call (the logic is the core's). Paddle wants one gradient
    per tensor input, ``None`` where the input has stop_gradient=True: that is what it gets.

    During a zero-bubble backward of fleet's DualPipeV (``WeightGradStore.enabled``) it runs the
    input half and queues the weight half into the store (see :mod:`.split_backward`)."""

    @staticmethod
    def forward(ctx, call, *tensors_and_params):
        return node_forward(ctx, call)

    @staticmethod
    def backward(ctx, *grads):
        if not _split.split_requested():
            return tuple(node_backward(ctx, grads))
        got = node_backward(ctx, grads, weights_wanted=False)
        if weight_pending(ctx.call):  # the engine split it (a layer without parameters does not)
            _split.queue_weight_pass(functools.partial(_weight_pass, ctx))
        return tuple(got)


def _weight_pass(ctx) -> None:
    """The weight half of a graphed call, run by fleet's ``WeightGradStore.pop()``: the deferred
    parameter gradients go into ``.grad`` (``main_grad``), as fleet's own closures put theirs."""
    call = ctx.call
    got = node_backward(ctx, [])
    _split.accumulate(call.params, got[len(call.shape.specs):])


class PaddleRuntime(GraphRuntime, StateSlots, AutocastModes, SplitBackward, StreamOrderedAllocator, MemoryTelemetry,
                    CaptureHints, ModelTree, Recompute):
    name = "paddle"

    def __init__(self):
        self._capture_stream = None

    # tensors
    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, paddle.Tensor)

    def spec(self, tensor) -> TensorSpec:
        # Paddle leaves stop_gradient False on integer results of differentiable inputs (top-k
        # indices); they carry no gradient, and asking autograd for one crashes topk_grad
        dtype = str(tensor.dtype).replace("paddle.", "")
        return TensorSpec(tuple(tensor.shape), dtype, str(tensor.place),
                          not tensor.stop_gradient and dtype not in _INTEGRAL)

    def static_like(self, tensor):
        out = paddle.empty_like(tensor)
        out.stop_gradient = True
        return out

    def alias_key(self, tensor):
        return (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.strides), str(tensor.dtype), str(tensor.place))

    def static_buffers(self, specs) -> list:
        # Paddle tensors are made on the current place, where the layer runs and captures.
        out = []
        for s in specs:
            t = paddle.empty(list(s.shape), dtype=s.dtype)
            t.stop_gradient = True
            out.append(t)
        return out

    def copy_many(self, dsts, srcs) -> None:
        with paddle.no_grad():
            for d, s in zip(dsts, srcs):
                if d.data_ptr() != s.data_ptr():
                    paddle.assign(s, output=d)

    def detach(self, tensor, requires_grad: bool = False):
        out = tensor.detach()
        out.stop_gradient = not requires_grad
        return out

    def graphs_unavailable_reason(self, tensors: Sequence[Any]) -> Optional[str]:
        if not paddle.is_compiled_with_cuda():
            return "this Paddle build has no CUDA"
        if paddle.device.cuda.device_count() == 0:
            return "Paddle sees no CUDA device"
        for t in tensors:
            if not t.place.is_gpu_place():
                return f"an input is on {t.place}"
        return None

    def mode_key(self):
        # The tracer's whole AMP state (what paddle.amp.auto_cast sets), so that mode_context
        # can put it back as it was, custom op lists included.
        if paddle.amp.is_autocast_enabled():
            tracer = paddle.base.framework._dygraph_tracer()
            white, black = tracer._get_amp_op_list()
            return ("amp", tracer._amp_level, str(tracer._amp_dtype), frozenset(white), frozenset(black),
                    bool(tracer._use_promote))
        return None

    @contextlib.contextmanager
    def mode_context(self, key):
        tracer = paddle.base.framework._dygraph_tracer()
        if key == self.mode_key() or tracer is None:
            yield
            return
        saved = (tracer._amp_level, tracer._amp_dtype, tracer._get_amp_op_list(), tracer._use_promote)
        if key is None:
            tracer._amp_level = paddle.base.core.AmpLevel.O0
        else:
            _, level, dtype, white, black, promote = key
            tracer._amp_level, tracer._amp_dtype, tracer._use_promote = level, dtype, promote
            tracer._set_amp_op_list(set(white), set(black))
        try:
            yield
        finally:
            level, dtype, (white, black), promote = saved
            tracer._amp_level, tracer._amp_dtype, tracer._use_promote = level, dtype, promote
            tracer._set_amp_op_list(white, black)

    def state_slots(self, layer) -> list:
        if not isinstance(layer, paddle.nn.Layer):
            return []
        return module_state_slots(layer.named_sublayers(include_self=True))

    def storage_addresses(self, tensors) -> list:
        return [t.data_ptr() for t in tensors]

    def submodules(self, model) -> list:
        return model.sublayers(include_self=True) if isinstance(model, paddle.nn.Layer) else [model]

    # autograd
    def grad_enabled(self) -> bool:
        return paddle.is_grad_enabled()

    def enable_grad(self):
        return paddle.enable_grad()

    # call_with_param_aliases: the seam's default (Paddle has no functional call over a
    # layer's parameters; the inner graphs differentiate against the parameters themselves)

    # recompute (activation checkpointing, see .recompute)
    def no_grad(self):
        return paddle.no_grad()

    def call_checkpointed(self, fn, params, args, kwargs):
        # as call_with_param_aliases: the parameters are their own aliases, and the engine's
        # paddle.grad reaches them through the recompute's saved-tensor hooks
        return _recompute.checkpointed(fn, args, kwargs), list(params)

    def rng_mirror(self, generators):
        # ``generators`` is always empty: the Paddle front doors refuse the option (every state a
        # kernel draws from is a state of the place's generator, mirrored by Mirrors)
        return _recompute.Mirrors()

    def autograd_grad(self, outputs, grad_outputs, inputs, retain_graph: bool = False) -> list:
        if not inputs:
            return []
        # SplitBWLinear layers inside hand their weight gradients back here, never to .grad.
        with _split.own_weight_closures() as closures:
            got = list(paddle.grad(outputs, inputs, grad_outputs, retain_graph=retain_graph, allow_unused=True))
        if closures:
            _split.add_foreign(closures, inputs, got, self.is_capturing())
        return got

    # fleet's DualPipeV: the store's signal, SplitBWLinear's deferred products (split_backward.py)

    def backward_input(self, outputs, grad_outputs, inputs, params):
        return _split.input_half(outputs, grad_outputs, inputs, params, capturing=self.is_capturing())

    def backward_weight(self, state, params):
        return _split.weight_half(state, params)

    def weight_pass_refills_grad(self) -> bool:
        return False  # fleet's weight pass (WeightGradStore) adds what it gets; it never refills

    # Paddle's gradient accumulation shares the first gradient it receives with ``.grad``.
    adopts_held_gradients = True

    def leaves_without_grad(self, tensors) -> list:
        return [i for i, t in enumerate(tensors) if t.grad is None and not t.stop_gradient and t.is_leaf]

    def apply_graphed_function(self, call, tensors, params) -> tuple:
        out = _GraphedPyLayer.apply(call, *tensors, *params)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def add_many(self, dsts, srcs) -> None:
        with paddle.no_grad():
            for d, s in zip(dsts, srcs):
                d.add_(s)

    # graph operations
    def create_graph(self):
        from paddle.device.cuda.graphs import CUDAGraph

        return CUDAGraph(mode="thread_local")

    def new_pool(self, shared=False):
        from paddle.base.core import CUDAGraph as CoreCUDAGraph

        return CoreCUDAGraph.gen_new_memory_pool_id()

    @contextlib.contextmanager
    def capture_to_graph(self, graph, pool=None, stream=None, generators=()):
        # ``generators`` need no registration: every Paddle generator a kernel draws from while
        # the stream captures registers itself with the graph (docs/paddle.md#recompute).
        if self._capture_stream is None:
            self._capture_stream = paddle.device.Stream()
        stream = stream if stream is not None else self._capture_stream
        current = paddle.device.current_stream()
        stream.wait_stream(current)
        with paddle.device.stream_guard(stream):
            graph._pool_id = pool
            graph.capture_begin()
            try:
                yield graph
            except BaseException:
                # End the broken capture here, so the stream and the pool can be used again.
                with contextlib.suppress(Exception):
                    graph.capture_end()
                with contextlib.suppress(Exception):
                    if _has_gpu():
                        paddle.device.cuda.synchronize()
                raise
            graph.capture_end()
        current.wait_stream(stream)

    def replay_graph(self, graph) -> None:
        with _recompute.keeping_state_index():  # the graph's RNG setters switch the generator's state
            graph.replay()

    def is_capture_failure(self, error) -> bool:
        # Paddle raises CUDA's errors as OSError ("(External) ...") and running out of memory as
        # MemoryError ("(ResourceExhausted) ..."); its own checks as RuntimeError.
        return isinstance(error, (RuntimeError, OSError, MemoryError))

    def capture_failure_hint(self, error, generators):
        if "converted the layer anew inside the capture" in str(error):  # raised by .to_static.StaticLayer
            return ("paddle.jit.to_static converts where a call's inputs or modes differ from the warmup's: keep them "
                    "as the warmup calls had them, or pass to_static=False for this layer.")
        return None

    def is_capturing(self) -> bool:
        from paddle.base import core

        return bool(getattr(core, "is_cuda_graph_capturing", lambda: False)())

    # memory
    def memory_stats(self, pools=None) -> dict:
        """Device totals, also when ``pools`` are given: Paddle exposes no per-pool figures, and
        the device totals are the closest honest answer."""
        if not _has_gpu():
            return {"reserved_bytes": 0, "allocated_bytes": 0}
        return {"reserved_bytes": int(paddle.device.cuda.memory_reserved()),
                "allocated_bytes": int(paddle.device.cuda.memory_allocated())}

    def async_allocator_active(self) -> bool:
        return _async_allocator_active()

    def release_cached_memory(self) -> None:
        if _has_gpu():
            paddle.device.cuda.empty_cache()


def _has_gpu() -> bool:
    return paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


_support.require("paddle", paddle.__version__)


def __getattr__(name: str) -> Any:
    # RUNTIME: the process's PaddleRuntime, a part of its paddle section (made on first use; it
    # holds the capture stream).
    if name == "RUNTIME":
        return current_process().section(PaddleRuntime.name).part(PaddleRuntime)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def active_runtime() -> GraphRuntime:
    """The runtime paddle's adapters use: :data:`RUNTIME`, or one registered in its place under
    the name ``"paddle"`` (tests plug fake graph runtimes in with ``core.runtime.register_runtime``)."""
    return get_runtime(PaddleRuntime.name)
