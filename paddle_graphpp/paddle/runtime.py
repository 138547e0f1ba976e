"""PaddlePaddle adapter for the graph engine (see :mod:`paddle_graphpp.core.runtime`).

RNG: Paddle's random GPU kernels (dropout among them) read their seed and offset through the
generator, which, while a stream is capturing, registers a per-replay callback on the graph
(``CUDAGraph::RecordRandomSeedSetter`` in Paddle's C++), so each replay draws a fresh mask.
Nothing needs registering from Python; the torch runtime's counterpart is the default
generator registration that ``CUDAGraph.capture_begin`` performs.

This runtime is exercised on CPU only here (eager fallback): no Paddle wheel with GPU kernels
runs on the Hopper GPUs we test on. The graph code paths mirror the PyTorch runtime's.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

import paddle
from paddle.autograd import PyLayer

from ..core.engine import node_backward, node_forward
from ..core.runtime import GraphRuntime, TensorSpec

__all__ = ["PaddleRuntime", "RUNTIME"]


class _GraphedPyLayer(PyLayer):
    """Autograd node of one graphed call (the logic is the core's). Paddle wants one gradient
    per tensor input, ``None`` where the input has stop_gradient=True: that is what it gets."""

    @staticmethod
    def forward(ctx, call, *tensors_and_params):
        return node_forward(ctx, call)

    @staticmethod
    def backward(ctx, *grads):
        return tuple(node_backward(ctx, grads))


class PaddleRuntime(GraphRuntime):
    name = "paddle"

    def __init__(self):
        self._capture_stream = None

    # tensors
    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, paddle.Tensor)

    def spec(self, tensor) -> TensorSpec:
        return TensorSpec(tuple(tensor.shape), str(tensor.dtype).replace("paddle.", ""), str(tensor.place),
                          not tensor.stop_gradient)

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
        if paddle.amp.is_autocast_enabled():
            tracer = paddle.base.framework._dygraph_tracer()
            return ("amp", str(tracer._amp_level), str(tracer._amp_dtype))
        return None

    def static_like(self, tensor):
        out = paddle.empty_like(tensor)
        out.stop_gradient = True
        return out

    def copy_(self, dst, src) -> None:
        paddle.assign(src, output=dst)

    def copy_many(self, dsts, srcs) -> None:
        with paddle.no_grad():
            for d, s in zip(dsts, srcs):
                if d.data_ptr() != s.data_ptr():
                    paddle.assign(s, output=d)

    def detach(self, tensor, requires_grad: bool = False):
        out = tensor.detach()
        out.stop_gradient = not requires_grad
        return out

    def clone_many(self, tensors) -> list:
        with paddle.no_grad():
            return [t.clone() for t in tensors]

    # autograd
    def grad_enabled(self) -> bool:
        return paddle.is_grad_enabled()

    def enable_grad(self):
        return paddle.enable_grad()

    def call_with_param_aliases(self, fn, params, args, kwargs):
        # Paddle has no functional call over a layer's parameters; the inner graphs
        # differentiate against the parameters themselves (their hooks fire at capture too).
        return fn(*args, **kwargs), list(params)

    def autograd_grad(self, outputs, grad_outputs, inputs, retain_graph: bool = False) -> list:
        if not inputs:
            return []
        return list(paddle.grad(outputs, inputs, grad_outputs, retain_graph=retain_graph, allow_unused=True))

    # Paddle's gradient accumulation shares the first gradient it receives with ``.grad``.
    adopts_held_gradients = True

    def leaves_without_grad(self, tensors) -> list:
        return [i for i, t in enumerate(tensors) if t.grad is None and not t.stop_gradient and t.is_leaf]

    def apply_graphed_function(self, call, tensors, params) -> tuple:
        out = _GraphedPyLayer.apply(call, *tensors, *params)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    # graph operations
    def create_graph(self):
        from paddle.device.cuda.graphs import CUDAGraph

        return CUDAGraph(mode="thread_local")

    def new_pool(self):
        from paddle.base.core import CUDAGraph as CoreCUDAGraph

        return CoreCUDAGraph.gen_new_memory_pool_id()

    @contextlib.contextmanager
    def capture_to_graph(self, graph, pool=None, stream=None):
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
                with contextlib.suppress(Exception):
                    graph.capture_end()
                raise
            graph.capture_end()
        current.wait_stream(stream)

    def replay_graph(self, graph) -> None:
        graph.replay()

    def is_capturing(self) -> bool:
        from paddle.base import core

        return bool(getattr(core, "is_cuda_graph_capturing", lambda: False)())

    def abort_capture(self) -> None:
        self.synchronize()

    # memory
    def synchronize(self) -> None:
        if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count():
            paddle.device.cuda.synchronize()

    def memory_stats(self) -> dict:
        if not (paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count()):
            return {"reserved_bytes": 0, "allocated_bytes": 0}
        return {"reserved_bytes": int(paddle.device.cuda.memory_reserved()),
                "allocated_bytes": int(paddle.device.cuda.memory_allocated())}

    def pool_memory(self, pools) -> dict:
        # Paddle exposes no per-pool figures; the device totals are the closest honest answer.
        return self.memory_stats()

    def release_cached_memory(self) -> None:
        if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count():
            paddle.device.cuda.empty_cache()


RUNTIME = PaddleRuntime()
