"""A fake graph runtime over torch CPU tensors, for testing the engine's bookkeeping only.

"Capture" runs the code eagerly and "replay" only counts: values after a replay are stale.
It proves nothing about CUDA capture (that is what unittests/gpu/ is for); it lets CI check
which calls warm up, capture or replay, pool generations, order checks and error paths.
"""
import contextlib

import torch

from paddle_graphpp.core import runtime as runtime_mod
from paddle_graphpp.core.engine import EngineOptions, GraphedCallable
from paddle_graphpp.torch.memory.capabilities import storage_watches
from paddle_graphpp.torch.runtime import TorchRuntime
from fake_graphs import FakeGraphs


@contextlib.contextmanager
def serving(rt, framework: str = "torch"):
    """Inside the block ``rt`` is the framework's runtime (``active_runtime()``: what graphed
    modules, optimizers and collectives built there use)."""
    runtime_mod.register_runtime(framework, lambda: rt)
    try:
        yield rt
    finally:
        runtime_mod.unregister_runtime(framework)


class FakeGraphRuntime(FakeGraphs, TorchRuntime):
    name = "fake"

    def __init__(self):
        super().__init__()
        self.generators_registered = []  # per capture: the generators it was asked to register
        self.modes = []  # the mode keys mode_context re-entered, in order

    @contextlib.contextmanager
    def capture_to_graph(self, graph, pool=None, stream=None, generators=()):
        self.generators_registered.append(tuple(generators))
        with super().capture_to_graph(graph, pool, stream, generators):
            yield graph

    @contextlib.contextmanager
    def mode_context(self, key):
        # CPU tensors: CUDA autocast cannot be entered here; only note what would be.
        self.modes.append(key)
        yield

    def async_allocator_active(self):
        return False

    # CPU tensors: the outputs' lifetimes are watched as on a GPU; "giving memory back" is
    # bookkeeping only (the alias owns its memory here, as nothing is overwritten by a replay).
    def memory_watches(self, tensors, others):
        return storage_watches(tensors, others) if tensors else None

    def weak_alias(self, tensor):
        return tensor.detach()


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
