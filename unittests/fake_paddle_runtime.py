"""A fake graph runtime over Paddle CPU tensors, for testing the engine's bookkeeping only.

As :mod:`fake_runtime` for torch: "capture" runs the code eagerly and "replay" only counts, so
values after a replay are stale. It proves nothing about CUDA capture; it lets CI check which
calls warm up, capture or replay under Paddle's own autograd and fleet's schedules.
"""
import contextlib
import sys

import paddle

from paddle_graphpp.core.engine import EngineOptions, graphed_engine, graphed_label
from paddle_graphpp.paddle.runtime import PaddleRuntime
from fake_graphs import FakeGraphs, ZeroedStaticBuffers


class FakePaddleRuntime(ZeroedStaticBuffers, FakeGraphs, PaddleRuntime):
    name = "fake-paddle"

    @contextlib.contextmanager
    def capture_checks(self):
        # fleet's weight-gradient closure running inside a capture (it rebinds .grad), or fleet's
        # store changed by one, would break a real capture
        zb = sys.modules.get("paddle.distributed.fleet.meta_parallel.zero_bubble_utils")
        if zb is None:
            yield
            return
        store = zb.WeightGradStore
        before = (id(store.cache), len(store.cache), store.funcs_queue.qsize(), store.enabled)
        original = zb.grad_weight_fn

        def refuse(*args, **kwargs):
            raise AssertionError("fleet's grad_weight_fn ran inside a capture (it rebinds .grad)")

        zb.grad_weight_fn = refuse
        try:
            yield
        finally:
            zb.grad_weight_fn = original
        after = (id(store.cache), len(store.cache), store.funcs_queue.qsize(), store.enabled)
        assert after == before, f"a capture changed fleet's WeightGradStore: {before} -> {after}"


class FakeGraphedLayer(paddle.nn.Layer):
    """The shape of ``CUDAGraphedLayer`` over a runtime of the test's choosing."""

    def __init__(self, layer, runtime, **options):
        super().__init__()
        self.layer = layer
        self.engine = graphed_engine(layer, runtime, lambda: [p for p in layer.parameters() if not p.stop_gradient],
                                     name=graphed_label("FakeGraphedLayer", layer, None),
                                     options=EngineOptions(**options))

    def forward(self, *args, **kwargs):
        return self.engine(args, kwargs)
