"""The framework-free half of the fake graph runtimes (unittests/fake_runtime.py for torch,
unittests/fake_paddle_runtime.py for Paddle): "capture" runs the code eagerly, "replay" only
counts. Bookkeeping only: values after a replay are stale."""
import contextlib
import itertools


class FakeGraph:
    def __init__(self):
        self.captured = False
        self.replays = 0


class ZeroedStaticBuffers:
    """Mixed into a fake runtime (before it): static buffers zeroed, not empty, since the fake
    "capture" runs the code on them (token ids must be valid indices)."""

    def static_buffers(self, specs):
        out = super().static_buffers(specs)
        for t in out:
            t.zero_()
        return out


class FakeGraphs:
    """Mixed into a framework's runtime (before it): graphs, pools, capture and replay faked."""

    def __init__(self):
        super().__init__()
        self.capturing = False
        self.pools = itertools.count()
        self.released = 0
        self.aborted = 0  # captures whose body raised (capture_to_graph ended them)
        # As PyTorch's allocators do after a capture the driver invalidated (a RuntimeError in
        # its body): the pool stays marked as recording, and a later capture into it fails.
        self.poisoned: list = []

    def graphs_unavailable_reason(self, tensors):
        return None

    def create_graph(self):
        return FakeGraph()

    def new_pool(self, shared=False):
        return ("fake-pool", next(self.pools))

    @contextlib.contextmanager
    def capture_to_graph(self, graph, pool=None, stream=None, generators=()):
        if pool is not None and pool in self.poisoned:
            raise RuntimeError(f"beginAllocateToPool: already recording to mempool_id {pool}")
        self.capturing = True
        try:
            with self.capture_checks():
                yield graph
        except BaseException as exc:
            self.aborted += 1
            if pool is not None and isinstance(exc, RuntimeError):
                self.poisoned.append(pool)
            raise
        finally:
            self.capturing = False
        graph.captured = True

    @contextlib.contextmanager
    def capture_checks(self):
        """Around each capture's body: what a real capture could not survive, checked."""
        yield

    def replay_graph(self, graph):
        assert graph.captured, "replay of a graph that was never captured"
        graph.replays += 1

    def is_capturing(self):
        return self.capturing

    def memory_stats(self, pools=None):
        return {"reserved_bytes": 0, "allocated_bytes": 0}

    def release_cached_memory(self):
        self.released += 1
