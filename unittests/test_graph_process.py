"""graph_process cache bookkeeping, with a fake runtime registered as "torch".

The fake "captures" by running the function eagerly and records, per graph, which function
was captured into it; a "replay" logs that graph's recording. That proves which graph a call
replays, when it re-captures and when it falls back; it proves nothing about CUDA capture
(unittests/gpu/test_optim_gpu.py does that).
"""
import gc
import logging

import pytest
import torch

from fake_runtime import FakeGraphRuntime
from paddle_graphpp import graph_api as gp
from paddle_graphpp.core import runtime as runtime_mod
from paddle_graphpp.core.errors import CaptureError


class RecordingRuntime(FakeGraphRuntime):
    def __init__(self):
        super().__init__()
        self.available = True
        self.captures = 0
        self.replayed = []  # the labels recorded into each replayed graph, in order
        self._graph = None

    def graphs_unavailable_reason(self, tensors):
        return None if self.available else "fake: no GPU"

    def capture_to_graph(self, graph, pool=None, stream=None, generators=()):
        self.captures += 1
        graph.labels = []
        self._graph = graph
        return super().capture_to_graph(graph, pool, stream)

    def record(self, label):
        """Called by test functions: inside a capture, the label goes into the graph."""
        if self.capturing:
            self._graph.labels.append(label)

    def replay_graph(self, graph):
        super().replay_graph(graph)
        self.replayed.append(tuple(graph.labels))


@pytest.fixture
def fake():
    rt = RecordingRuntime()
    runtime_mod.register_runtime("torch", lambda: rt)
    gp.clear_graph_cache()
    yield rt
    gp.clear_graph_cache()
    runtime_mod.unregister_runtime("torch")


def _adder(fake, label):
    def step(x, y):  # every closure made here has the same __name__
        fake.record(label)
        y.add_(x)
        return y * 1
    return step


def test_first_call_warms_up_and_captures_later_calls_replay(fake):
    x, y = torch.ones(3), torch.zeros(3)
    step = _adder(fake, "a")
    out1 = gp.graph_process(step, x, y)
    assert fake.captures == 1 and fake.replayed == []
    # warmup and capture both ran eagerly on the fake: y was incremented twice; the result
    # handed back is the warmup's (copied into the captured output buffer)
    assert torch.equal(out1, torch.ones(3))
    out2 = gp.graph_process(step, x, y)
    assert out2 is out1, "a replay hands back the captured output buffers"
    assert fake.captures == 1 and fake.replayed == [("a",)]


def test_replay_first_step_replays_right_after_capture(fake):
    step = _adder(fake, "a")
    gp.graph_process(step, torch.ones(2), torch.zeros(2), replay_first_step=True)
    assert fake.captures == 1 and fake.replayed == [("a",)]


def test_same_named_closures_do_not_share_a_graph(fake):
    x, y = torch.ones(3), torch.zeros(3)
    a, b = _adder(fake, "a"), _adder(fake, "b")
    assert a.__name__ == b.__name__ and a.__qualname__ == b.__qualname__
    gp.graph_process(a, x, y)
    gp.graph_process(b, x, y)
    assert fake.captures == 2
    gp.graph_process(a, x, y)
    gp.graph_process(b, x, y)
    gp.graph_process(a, x, y)
    assert fake.replayed == [("a",), ("b",), ("a",)]


def test_bound_methods_of_two_instances_get_two_graphs(fake):
    class Stepper:
        def __init__(self, label):
            self.label = label

        def step(self, y):
            fake.record(self.label)
            y.add_(1)

    s1, s2, y = Stepper("s1"), Stepper("s2"), torch.zeros(2)
    for _ in range(2):
        gp.graph_process(s1.step, y)  # a new bound-method object on each access
        gp.graph_process(s2.step, y)
    assert fake.captures == 2
    assert fake.replayed == [("s1",), ("s2",)]


def test_changed_address_recaptures_with_a_log_line(fake, caplog):
    step = _adder(fake, "a")
    x, y = torch.ones(3), torch.zeros(3)
    gp.graph_process(step, x, y)
    gp.graph_process(step, x, y)
    y2 = torch.zeros(3)  # same shape and dtype, new address
    with caplog.at_level(logging.WARNING, logger=gp.__name__):
        gp.graph_process(step, x, y2)
    assert fake.captures == 2, "a new address must be re-captured, not replayed into the old graph"
    assert fake.replayed == [("a",)]
    assert "address" in caplog.text and "re-capturing" in caplog.text
    gp.graph_process(step, x, y2)
    assert fake.replayed == [("a",), ("a",)]


def test_changed_shape_dtype_or_scalar_recaptures(fake, caplog):
    calls = []

    def scaled(t, factor):
        calls.append(factor)
        return t * factor

    t = torch.ones(4)
    gp.graph_process(scaled, t, 2.0)
    gp.graph_process(scaled, t, 2.0)
    assert fake.captures == 1
    with caplog.at_level(logging.WARNING, logger=gp.__name__):
        gp.graph_process(scaled, t, 3.0)
    assert fake.captures == 2 and "2.0 to 3.0" in caplog.text
    gp.graph_process(scaled, t.view(2, 2), 3.0)  # same address, new shape
    assert fake.captures == 3
    gp.graph_process(scaled, torch.ones(4, dtype=torch.float64), 3.0)
    assert fake.captures == 4


def test_in_place_updates_keep_replaying(fake):
    def step(xs, out):
        out["y"].add_(xs[0])

    x, y = torch.ones(3), torch.zeros(3)
    for _ in range(5):
        x.mul_(2)
        gp.graph_process(step, [x], {"y": y})  # nested containers are walked too
    assert fake.captures == 1 and len(fake.replayed) == 4


def test_explicit_key(fake):
    x, y = torch.ones(1), torch.zeros(1)
    a, b = _adder(fake, "a"), _adder(fake, "b")
    gp.graph_process(a, x, y, key="k1")
    gp.graph_process(a, x, y, key="k2")
    assert fake.captures == 2, "two keys, two graphs"
    gp.graph_process(a, x, y, key="k1")
    assert fake.replayed == [("a",)]
    gp.graph_process(b, x, y, key="k1")  # another function under the same key
    assert fake.captures == 3
    gp.graph_process(b, x, y, key="k1")
    assert fake.replayed == [("a",), ("b",)]


def test_forget_graph_drops_one_slot_and_the_next_call_captures_anew(fake):
    x, y = torch.ones(1), torch.zeros(1)
    a, b = _adder(fake, "a"), _adder(fake, "b")
    gp.graph_process(a, x, y)
    gp.graph_process(b, x, y, key="k")
    assert not gp.forget_graph(b)  # b's graph is under its key, not its identity
    assert gp.forget_graph(a) and not gp.forget_graph(a)
    assert len(gp._cache()) == 1
    assert gp.forget_graph(b, key="k") and len(gp._cache()) == 0
    gp.graph_process(a, x, y)
    assert fake.captures == 3 and fake.replayed == []


def test_dead_closure_releases_its_graph(fake):
    step = _adder(fake, "a")
    gp.graph_process(step, torch.ones(1), torch.zeros(1))
    assert len(gp._cache()) == 1
    del step
    gc.collect()
    assert len(gp._cache()) == 0


def test_without_graphs_the_function_simply_runs(fake):
    fake.available = False
    calls = []

    def f(t):
        calls.append(1)
        return t + 1

    for _ in range(3):
        assert torch.equal(gp.graph_process(f, torch.zeros(2)), torch.ones(2))
    assert len(calls) == 3 and fake.captures == 0 and fake.replayed == []


def test_failed_capture_raises_capture_error_and_caches_nothing(fake):
    def syncs(t):
        if fake.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")
        return t + 1

    with pytest.raises(CaptureError, match=r"graph_process\(.*syncs\).*\.item\(\)"):
        gp.graph_process(syncs, torch.zeros(1))
    assert fake.aborted == 1 and len(gp._cache()) == 0


def test_inside_an_outer_capture_the_function_runs_directly(fake):
    step = _adder(fake, "inner")
    g = gp.create_graph(framework="torch")
    with gp.capture_to_graph(g, framework="torch"):
        gp.graph_process(step, torch.ones(1), torch.zeros(1))
    assert fake.captures == 1 and g.labels == ["inner"]
    assert len(gp._cache()) == 0
    gp.replay_graph(g, framework="torch")
    assert fake.replayed == [("inner",)]


def test_real_torch_on_cpu_simply_runs():
    gp.clear_graph_cache()
    calls = []

    def f(t):
        calls.append(1)
        t.add_(1)
        return t

    t = torch.zeros(2)
    for _ in range(3):
        gp.graph_process(f, t)
    assert len(calls) == 3 and torch.equal(t, torch.full((2,), 3.0))
    gp.clear_graph_cache()


def test_real_paddle_on_cpu_simply_runs():
    paddle = pytest.importorskip("paddle")
    gp.clear_graph_cache()
    calls = []

    def f(t):
        calls.append(1)
        return t + 1

    t = paddle.zeros([2])
    outs = [gp.graph_process(f, t) for _ in range(3)]
    assert len(calls) == 3 and outs[0] is not outs[1]
    assert outs[2].numpy().tolist() == [1.0, 1.0]
    gp.clear_graph_cache()


def test_top_level_names_resolve():
    import paddle_graphpp
    assert paddle_graphpp.graph_process is gp.graph_process
    assert paddle_graphpp.create_graph is gp.create_graph
    assert paddle_graphpp.capture_to_graph is gp.capture_to_graph
    assert paddle_graphpp.replay_graph is gp.replay_graph
