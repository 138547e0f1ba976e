"""A fake graph runtime over Paddle CPU tensors, for testing the engine's bookkeeping only.

As :mod:`fake_runtime` for torch: "capture" runs the code eagerly and "replay" only counts, so
values after a replay are stale. It proves nothing about CUDA capture; it lets CI check which
calls warm up, capture or replay under Paddle's own autograd and fleet's schedules.
"""
import contextlib
import itertools
import sys

import paddle

from paddle_graphpp.core.engine import graphed_engine
from paddle_graphpp.paddle.runtime import PaddleRuntime


class FakeGraph:
    def __init__(self):
        self.captured = False
        self.replays = 0


class FakePaddleRuntime(PaddleRuntime):
    name = "fake-paddle"

    def __init__(self):
        super().__init__()
        self.capturing = False
        self.pools = itertools.count()
        self.aborted = 0

    def graphs_unavailable_reason(self, tensors):
        return None

    def static_buffers(self, specs):
        # Zeroed, not empty: "capture" runs the code on them (token ids must be valid indices).
        out = []
        for s in specs:
            t = paddle.zeros(list(s.shape), dtype=s.dtype)
            t.stop_gradient = True
            out.append(t)
        return out

    def create_graph(self):
        return FakeGraph()

    def new_pool(self):
        return ("fake-pool", next(self.pools))

    @contextlib.contextmanager
    def capture_to_graph(self, graph, pool=None, stream=None, generators=()):
        # What a real capture could not survive, checked here: fleet's weight-gradient closure
        # running inside it (it rebinds .grad), or fleet's store changed by it.
        zb = sys.modules.get("paddle.distributed.fleet.meta_parallel.zero_bubble_utils")
        if zb is not None:
            store = zb.WeightGradStore
            before = (id(store.cache), len(store.cache), store.funcs_queue.qsize(), store.enabled)
            original = zb.grad_weight_fn

            def refuse(*args, **kwargs):
                raise AssertionError("fleet's grad_weight_fn ran inside a capture (it rebinds .grad)")

            zb.grad_weight_fn = refuse
        self.capturing = True
        try:
            yield graph
        except BaseException:
            self.aborted += 1
            raise
        finally:
            self.capturing = False
            if zb is not None:
                zb.grad_weight_fn = original
        if zb is not None:
            after = (id(store.cache), len(store.cache), store.funcs_queue.qsize(), store.enabled)
            assert after == before, f"a capture changed fleet's WeightGradStore: {before} -> {after}"
        graph.captured = True

    def replay_graph(self, graph):
        assert graph.captured, "replay of a graph that was never captured"
        graph.replays += 1

    def is_capturing(self):
        return self.capturing

    def memory_stats(self, pools=None):
        return {"reserved_bytes": 0, "allocated_bytes": 0}

    def release_cached_memory(self):
        pass


class FakeGraphedLayer(paddle.nn.Layer):
    """The shape of ``CUDAGraphedLayer`` over a runtime of the test's choosing."""

    def __init__(self, layer, runtime, **options):
        super().__init__()
        self.layer = layer
        self.engine = graphed_engine(layer, runtime, lambda: [p for p in layer.parameters() if not p.stop_gradient],
                                     kind="FakeGraphedLayer", name=None, **options)

    def forward(self, *args, **kwargs):
        return self.engine(args, kwargs)
