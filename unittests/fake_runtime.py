"""A fake graph runtime over torch CPU tensors, for testing the engine's bookkeeping only.

"Capture" runs the code eagerly and "replay" only counts: values after a replay are stale.
It proves nothing about CUDA capture (that is what unittests/gpu/ is for); it lets CI check
which calls warm up, capture or replay, pool generations, order checks and error paths.
"""
import contextlib
import itertools

import torch

from paddle_graphpp.core.engine import EngineOptions, GraphedCallable
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
        self.generators_registered = []  # per capture: the generators it was asked to register
        self.aborted = 0  # captures whose body raised (capture_to_graph ended them)
        self.modes = []  # the mode keys mode_context re-entered, in order

    def graphs_unavailable_reason(self, tensors):
        return None

    def create_graph(self):
        return FakeGraph()

    def new_pool(self):
        return ("fake-pool", next(self.pools))

    @contextlib.contextmanager
    def capture_to_graph(self, graph, pool=None, stream=None, generators=()):
        self.generators_registered.append(tuple(generators))
        self.capturing = True
        try:
            yield graph
        except BaseException:
            self.aborted += 1
            raise
        finally:
            self.capturing = False
        graph.captured = True

    def replay_graph(self, graph):
        assert graph.captured, "replay of a graph that was never captured"
        graph.replays += 1

    def is_capturing(self):
        return self.capturing

    @contextlib.contextmanager
    def mode_context(self, key):
        # CPU tensors: CUDA autocast cannot be entered here; only note what would be.
        self.modes.append(key)
        yield

    def async_allocator_active(self):
        return False

    def memory_stats(self, pools=None):
        return {"reserved_bytes": 0, "allocated_bytes": 0}

    def release_cached_memory(self):
        self.released += 1


class Graphed(torch.nn.Module):
    """The shape of CUDAGraphedModule over a runtime of the test's choosing (this fake one,
    usually): ``module`` behind a :class:`~paddle_graphpp.core.engine.GraphedCallable`."""

    def __init__(self, module, runtime, **opts):
        super().__init__()
        self.module = module
        self.engine = GraphedCallable(module, runtime, lambda: list(module.parameters()),
                                      name=f"test:{type(module).__name__}", options=EngineOptions(**opts))

    def forward(self, *args, **kwargs):
        return self.engine(args, kwargs)
