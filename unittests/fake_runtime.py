"""A fake graph runtime over torch CPU tensors, for testing the engine's bookkeeping only.

"Capture" runs the code eagerly and "replay" only counts: values after a replay are stale.
It proves nothing about CUDA capture (that is what unittests/gpu/ is for); it lets CI check
which calls warm up, capture or replay, pool generations, order checks and error paths.
"""
import contextlib
import itertools

from paddle_graphpp.torch.runtime import TorchRuntime


class FakeGraph:
    def __init__(self):
        self.captured = False
        self.replays = 0


class FakeGraphRuntime(TorchRuntime):
    name = "fake"

    def __init__(self):
        super().__init__()
        self.capturing = False
        self.pools = itertools.count()
        self.released = 0
        self.aborted = 0

    def graphs_unavailable_reason(self, tensors):
        return None

    def create_graph(self):
        return FakeGraph()

    def new_pool(self):
        return ("fake-pool", next(self.pools))

    @contextlib.contextmanager
    def capture_to_graph(self, graph, pool=None, stream=None):
        self.capturing = True
        try:
            yield graph
        finally:
            self.capturing = False
        graph.captured = True

    def replay_graph(self, graph):
        assert graph.captured, "replay of a graph that was never captured"
        graph.replays += 1

    def is_capturing(self):
        return self.capturing

    def abort_capture(self):
        self.aborted += 1

    def async_allocator_active(self):
        return False

    def pool_memory(self, pools):
        return {"reserved_bytes": 0, "allocated_bytes": 0}

    def release_cached_memory(self):
        self.released += 1
