"""Activation checkpointing with the Paddle runtime (``recompute=True``), in one CPU process.

* The runtime's ``call_checkpointed`` runs the layer again in the backward (a forward pre-hook
  counts twice) and gives the plain call's gradients, dropout included.
* ``CUDAGraphedLayer(recompute=True)`` on CPU (eager there) runs every call so, micro-batches in
  flight, and trains as the plain layer does.
* The random-number mirrors of :mod:`paddle_graphpp.paddle.recompute`, over the CPU generator
  (the same state API as a CUDA generator; CPU dropout draws from its current state): a draw under
  ``swapped()`` after ``restore(note())`` repeats the noted draw, for the generator's current state
  and for a named state of fleet's RNG tracker; the source states advance by their own draws only;
  a replay puts back the state index the graph's RNG setters switch to.
* With a fake graph runtime (capture runs the code, replay only counts): a recomputing layer's
  positions are captured recomputing, its backward capture runs the forward again under the
  mirrors, and its replays note and restore them. Values after fake replays are stale, so only the
  bookkeeping is checked; what a CUDA capture does with the mirrors is not tested here (no Paddle
  GPU build runs on this project's machines).
"""
import warnings

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from paddle import nn  # noqa: E402
from paddle.base import core  # noqa: E402

from paddle_graphpp import CUDAGraphedLayer  # noqa: E402
from paddle_graphpp.paddle import recompute as rc  # noqa: E402
from paddle_graphpp.paddle.runtime import RUNTIME  # noqa: E402


class Block(nn.Layer):
    def __init__(self, p=0.3):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.drop = nn.Dropout(p)
        self.calls = 0
        self.fc1.register_forward_pre_hook(self._count)

    def _count(self, layer, inputs):
        self.calls += 1

    def forward(self, x, scale=1.0):
        return x + self.drop(self.fc2(nn.functional.gelu(self.fc1(x)))) * scale


def grads_of(block, fn, x):
    paddle.seed(9)  # the same dropout masks in each run
    xi = x.detach()
    xi.stop_gradient = False
    params = list(block.parameters())
    out, aliases = fn(block, params, (xi,), {"scale": 2.0})
    forwards = block.calls
    got = paddle.grad([out], [xi] + aliases, [paddle.ones_like(out)])
    return forwards, block.calls, [g.numpy() for g in got]


def test_call_checkpointed_recomputes_in_the_backward_and_gives_the_plain_calls_gradients():
    paddle.seed(1)
    block, x = Block(), paddle.randn([4, 8])
    plain = grads_of(block, RUNTIME.call_with_param_aliases, x)
    block.calls = 0
    checkpointed = grads_of(block, RUNTIME.call_checkpointed, x)
    assert plain[:2] == (1, 1)
    assert checkpointed[:2] == (1, 2), "the checkpointed call did not run the layer again in the backward"
    assert all((a == b).all() for a, b in zip(plain[2], checkpointed[2]))


@pytest.mark.parametrize("recompute", [False, True])
def test_a_recomputing_graphed_layer_trains_as_the_plain_layer(recompute):
    warnings.filterwarnings("ignore", message=".*CUDA graphs are not used.*")
    paddle.seed(3)
    plain = Block()
    graphed_block = Block()
    graphed_block.set_state_dict(plain.state_dict())
    graphed = CUDAGraphedLayer(graphed_block, num_warmup_steps=1, recompute=recompute)
    results = []
    for model, block in ((plain, plain), (graphed, graphed_block)):
        paddle.seed(4)
        xs = [paddle.randn([4, 8]) for _ in range(3)]
        outs = [model(x) for x in xs]  # three micro-batches in flight, backwards in FIFO order
        for out in outs:
            out.square().mean().backward()
        results.append((block.calls, [p.grad.numpy() for p in block.parameters()]))
    (plain_calls, plain_grads), (graphed_calls, graphed_grads) = results
    assert plain_calls == 3 and graphed_calls == (6 if recompute else 3)
    assert all((a == b).all() for a, b in zip(plain_grads, graphed_grads))


# ---------------------------------------------------------------- the mirrors, on the CPU generator
def draw():
    return paddle.nn.functional.dropout(paddle.ones([64]), 0.5).numpy()


def test_mirrors_repeat_the_noted_draws_and_leave_the_source_to_its_own():
    generator = core.default_cpu_generator()
    paddle.seed(21)
    reference = [draw() for _ in range(3)]  # what the source state draws, without mirrors

    paddle.seed(21)
    start = generator.get_state_index()
    mirrors = rc.Mirrors()
    assert generator.get_state_index() == start and mirrors.sources == [start]
    noted = mirrors.note()
    first = draw()  # "the forward graph's replay", from the source state
    mirrors.restore(noted)
    with mirrors.swapped():
        assert generator.get_state_index() == mirrors.mirrors[0]
        again = draw()  # "the recomputation", from the mirror
    assert generator.get_state_index() == start
    assert (first == reference[0]).all() and (again == first).all()
    assert (draw() == reference[1]).all(), "the mirror's draws moved the source state"
    noted = mirrors.note()
    mirrors.restore(noted)
    with mirrors.swapped():
        assert (draw() == reference[2]).all()


def test_mirrors_cover_fleets_rng_tracker_states():
    from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

    tracker = get_rng_state_tracker()
    saved = (dict(tracker.states_), set(tracker.seeds_))
    try:
        tracker.add("graphpp_test_rng", 4321)
        before = dict(tracker.states_)
        mirrors = rc.Mirrors()
        assert mirrors.names == list(before) and len(mirrors.mirrors) == 1 + len(before)
        noted = mirrors.note()
        with tracker.rng_state("graphpp_test_rng"):
            first = draw()
        mirrors.restore(noted)
        with mirrors.swapped():
            with tracker.rng_state("graphpp_test_rng"):
                again = draw()
        assert (again == first).all()
        assert tracker.states_ == before  # the tracker hands out its own states again
        tracker.add("graphpp_test_rng_late", 4322)
        with pytest.raises(RuntimeError, match=r"\['graphpp_test_rng_late'\].*reset_graphs"):
            with mirrors.swapped():
                pass
    finally:
        tracker.states_, tracker.seeds_ = saved


def test_a_replay_puts_back_the_state_index_its_rng_setters_switched_to():
    generator = core.default_cpu_generator()
    start = generator.get_state_index()
    other = rc.Mirrors().mirrors[0]

    class SwitchingGraph:  # what a captured dropout's parameter setter does at replay (see .recompute)
        def replay(self):
            generator.set_state_index(other)

    RUNTIME.replay_graph(SwitchingGraph())
    assert generator.get_state_index() == start


# ---------------------------------------------------------------- the capture path, faked
@pytest.fixture
def fake_rt():
    from fake_paddle_runtime import FakePaddleRuntime
    from paddle_graphpp.core.process import current_process

    runtime = FakePaddleRuntime()
    current_process().reset(runtime.name)
    yield runtime
    current_process().reset(runtime.name)


def test_recomputing_positions_capture_the_forward_again_and_replay_with_the_mirrors(fake_rt, monkeypatch):
    from fake_paddle_runtime import FakeGraphedLayer

    calls = {"note": 0, "restore": 0, "swapped": 0}
    for method in calls:
        def counted(self, *args, _original=getattr(rc.Mirrors, method), _name=method):
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(rc.Mirrors, method, counted)
    block = Block()
    layer = FakeGraphedLayer(block, fake_rt, num_warmup_steps=1, recompute=True)

    def step():
        outs = [layer(paddle.randn([4, 8])) for _ in range(2)]
        for out in outs:
            out.sum().backward()

    step()  # warmup: eager, checkpointed
    step()  # recorded: eager, checkpointed
    assert block.calls == 8 and layer.engine.captures == 0
    block.calls = 0
    step()  # captured (2 positions: forward, then backward with the forward again), then replayed
    engine = layer.engine
    assert engine.captures == 4 and engine.replays == 4
    assert [p.recomputes for p in engine.positions()] == [True, True]
    assert block.calls == 4, "the backward captures did not run the forward again"
    assert calls == {"note": 2, "restore": 2, "swapped": 2}
    step()
    assert block.calls == 4 and engine.replays == 8 and calls["note"] == calls["restore"] == 4
    assert np.isfinite(block.fc1.weight.grad.numpy()).all()
