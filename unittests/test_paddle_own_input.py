"""A mixture of experts' router graphed in place under Paddle, reading its own copy of the
mixture's input (paddle_graphpp/paddle/own_input.py), on CPU with the fake runtime.

Paddle's backward sums the gradient of a tensor read by several operations in the order its
readers run; a graphed router is one node that runs sooner than eager's chain of operations. The
mixture's first training call runs the router eagerly and records the order; the router is then
graphed reading a copy whose gradient is added last, where that equals eager's sum. The fake
runtime's capture runs the code for real (its replays only count), so the call that captures the
router is compared with eager bit for bit: through the split and through the graphed node. The
real PaddleFormers routers and shared experts (GLM-4-MoE, DeepSeek-V3, GPT-OSS) are checked the same way by
unittests/workers/own_input_worker.py in a process of its own (importing PaddleFormers switches
transformers' PyTorch support off).
"""

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from paddle import nn  # noqa: E402
from paddle.nn import functional as F  # noqa: E402

from installs import skip_without_paddleformers  # noqa: E402

from paddle_graphpp.paddle.own_input import Judgement  # noqa: E402

HIDDEN, EXPERTS, TOKENS = 8, 4, 12
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TopkRouter(nn.Layer):
    """GLM-4-MoE's shape: a linear layer, a sigmoid, the top-k, normalised and scaled weights."""

    def __init__(self):
        super().__init__()
        self.weight = self.create_parameter([HIDDEN, EXPERTS])

    def forward(self, hidden_states):
        scores = F.sigmoid(paddle.matmul(hidden_states.reshape([-1, HIDDEN]), self.weight))
        index = paddle.topk(scores, 2, axis=-1)[1]
        weights = paddle.take_along_axis(scores, index, axis=1)
        weights = weights / (weights.sum(axis=-1, keepdim=True) + 1e-20)
        return index, weights * 2.5


class ShortRouter(nn.Layer):
    """A router whose chain is shorter than the experts': eagerly its gradient reaches the input first."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, 1)

    def forward(self, hidden_states):
        return F.sigmoid(self.proj(hidden_states))


def mlp(width=16):
    return nn.Sequential(nn.Linear(HIDDEN, width), nn.Silu(), nn.Linear(width, HIDDEN))


class Mixture(nn.Layer):
    """Experts dispatched by a host-reading loop, a shared expert; all three read the input."""

    def __init__(self):
        super().__init__()
        self.gate = TopkRouter()
        self.experts = nn.LayerList([mlp() for _ in range(EXPERTS)])
        self.shared_experts = mlp()

    def forward(self, hidden_states):
        index, weights = self.gate(hidden_states)
        flat = hidden_states.reshape([-1, HIDDEN])
        out = paddle.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tokens, slots = paddle.where(index == e)
            if tokens.numel() > 0:  # a host read: no capture can hold it
                picked = expert(flat[tokens]) * weights[tokens, slots].unsqueeze(-1)
                out = paddle.index_add(out, tokens, 0, picked)
        return out.reshape(hidden_states.shape) + self.shared_experts(hidden_states)


class DeepExperts(nn.Layer):
    """Its router's gradient reaches the input before the experts' and the shared expert's."""

    def __init__(self):
        super().__init__()
        self.gate = ShortRouter()
        self.experts = nn.Sequential(mlp(), nn.Silu(), mlp(), nn.Silu(), mlp())
        self.shared_experts = nn.Sequential(mlp(), nn.Silu(), mlp())

    def forward(self, hidden_states):
        return self.experts(hidden_states) * self.gate(hidden_states) + self.shared_experts(hidden_states)


@pytest.fixture
def fake_runtime():
    from fake_paddle_runtime import FakePaddleRuntime
    from fake_runtime import serving

    from paddle_graphpp.core.process import current_process

    rt = FakePaddleRuntime()
    current_process().reset(rt.name)
    with serving(rt, "paddle"):
        yield rt
    current_process().reset(rt.name)


def train(block, steps, inputs, by_keyword=False):
    """Per call: the input's gradient, then every parameter's, as numpy arrays."""
    got = []
    for x0 in inputs[:steps]:
        x = x0.clone()
        x.stop_gradient = False
        h = paddle.tanh(x)  # the input has a producer, as a norm's output has
        out = block(hidden_states=h) if by_keyword else block(h)
        (out * out).mean().backward()
        got.append([x.grad.numpy().copy()] + [p.grad.numpy().copy() for p in block.parameters()])
        block.clear_gradients()
    return got


def graph_parts(block, names=("gate",)):
    """``block``'s sublayers ``names`` graphed in place, reading their own copies of its input: the
    parts' graphed layers and the OwnInput."""
    from paddle_graphpp.core.options import EngineOptions
    from paddle_graphpp.paddle.in_place import graphed_forward, swap_in
    from paddle_graphpp.paddle.own_input import OwnInput

    parts = []
    for name in names:
        part = getattr(block, name)
        layer = graphed_forward(f"mixture.{name}", part, options=EngineOptions(num_warmup_steps=0))
        swap_in(part, layer)
        parts.append((f"mixture.{name}", part, layer))
    return [layer for _, _, layer in parts], OwnInput(block, block, parts)


def graph_router(block):
    (layer,), own = graph_parts(block)
    return layer, own


def inputs(n=3):
    paddle.seed(11)
    return [paddle.randn([2, TOKENS // 2, HIDDEN]) for _ in range(n)]


def same(a, b) -> bool:
    return all(np.array_equal(u, v) for u, v in zip(a, b))


def twins(cls, seed):
    """Two instances of ``cls`` with the same initial parameters: one to train eagerly, one to graph."""
    paddle.seed(seed)
    eager = cls()
    paddle.seed(seed)
    return eager, cls()


def test_a_router_read_last_by_eager_autograd_is_graphed_and_sums_as_eagerly(fake_runtime):
    from paddle_graphpp.paddle.in_place import GraphedPart

    eager, block = twins(Mixture, 3)
    layer, own = graph_router(block)
    assert type(block.gate) is TopkRouter and own.state is Judgement.WATCHING  # eager until judged
    xs = inputs()
    want = train(eager, 3, xs)
    got = train(block, 1, xs)  # watched: the router eager and unsplit
    assert same(want[0], got[0]) and type(block.gate) is TopkRouter
    # judged: split and graphed. The router's first call is its engine's recorded step: one node
    # of the graphed layer's in autograd, computed for real (the fake runtime's captures and
    # replays leave stale values), which is what changes the order the input's gradient sums in
    got += train(block, 1, xs[1:])
    assert own.state is Judgement.JUDGED and own.graphed_parts == (0,)
    assert isinstance(block.gate, GraphedPart) and isinstance(block.gate, TopkRouter)
    assert same(want[1], got[1]), "the graphed router's call differs from eager"
    train(block, 1, xs[2:])
    assert layer.engine.captures == 2 and layer.engine.replays == 2


def test_without_the_copy_the_graphed_router_would_not_sum_as_eagerly(fake_runtime):
    """The check above can fail: the same router graphed in place, reading the mixture's input."""
    from paddle_graphpp.core.options import EngineOptions
    from paddle_graphpp.paddle.in_place import graphed_forward, swap_in

    eager, block = twins(Mixture, 3)
    swap_in(block.gate, graphed_forward("mixture.gate", block.gate, options=EngineOptions(num_warmup_steps=0)))
    xs = inputs()
    (want,), (got,) = train(eager, 1, xs), train(block, 1, xs)  # the router's recorded step
    assert same(want[1:], got[1:])  # every parameter's gradient as eagerly
    assert not np.array_equal(want[0], got[0])  # the input's: summed in another order


def test_a_router_eager_autograd_reads_first_stays_eager_with_one_warning(fake_runtime):
    eager, block = twins(DeepExperts, 4)
    layer, own = graph_router(block)
    xs = inputs()
    want = train(eager, 3, xs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train(block, 3, xs)
    messages = [str(w.message) for w in caught if "stays eager" in str(w.message)]
    assert len(messages) == 1 and "mixture.gate stays eager: eager autograd adds its gradient" in messages[0], messages
    assert own.state is Judgement.JUDGED and own.graphed_parts == () and type(block.gate) is ShortRouter
    assert own.describe() == [f"mixture.gate: eager: {own.eager_parts[0]}"]
    assert own.eager_parts[0].startswith("eager autograd adds its gradient to its input's between other readers'")
    assert layer.engine.captures == 0
    assert all(same(w, g) for w, g in zip(want, got))


def test_undo_takes_the_copy_out(fake_runtime):
    eager, block = twins(Mixture, 3)
    layer, own = graph_router(block)
    xs = inputs()
    train(block, 2, xs)
    assert own.graphed_parts == (0,)
    own.remove()
    from paddle_graphpp.paddle.in_place import ungraph_in_place

    ungraph_in_place([block.gate])
    assert type(block.gate) is TopkRouter  # no optimizer step ran: the twins' parameters are alike
    assert all(same(w, g) for w, g in zip(train(eager, 1, xs[2:]), train(block, 1, xs[2:])))


@pytest.mark.timeout(300)
def test_paddleformers_routers_graphed_in_place_sum_as_eagerly():
    skip_without_paddleformers()
    out = subprocess.run([sys.executable, os.path.join(REPO, "unittests", "workers", "own_input_worker.py")],
                         capture_output=True, text=True, timeout=280, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(results) == {"glm4_moe", "deepseek_v3", "gpt_oss"}
    for name, result in results.items():
        # without the copy: GLM-4-MoE's and DeepSeek-V3's inputs have three readers (router, experts,
        # shared experts), GPT-OSS's two, whose sum is the same in either order
        parts = ["router"] if name == "gpt_oss" else ["gate", "shared_experts"]
        assert result == {"graphed": parts, "captures": [2] * len(parts), "watched_equal": True,
                          "graphed_equal": True, "without_copy_equal": name == "gpt_oss"}, (name, result)


def test_a_first_forward_without_backward_is_not_the_one_judged(fake_runtime):
    """A forward whose backward never runs (a look at the loss, an evaluation pass with gradients
    on) leaves the router eager and watching: the next training call's backward judges it."""
    eager, block = twins(Mixture, 3)
    layer, own = graph_router(block)
    xs = inputs(4)
    block(_requiring_grad(xs[3]))  # no backward
    block.eval()
    block(_requiring_grad(xs[3]))  # an evaluation pass: not watched
    block.train()
    want, got = train(eager, 2, xs), train(block, 2, xs)
    assert own.graphed_parts == (0,) and same(want[1], got[1])
    assert own.describe() == []


def test_a_block_called_by_keyword_reads_its_copy_too(fake_runtime):
    eager, block = twins(Mixture, 3)
    layer, own = graph_router(block)
    xs = inputs()
    want, got = train(eager, 2, xs), train(block, 2, xs, by_keyword=True)
    assert own.graphed_parts == (0,) and all(same(w, g) for w, g in zip(want, got))


def _requiring_grad(t):
    """``tanh(t)`` of a copy of ``t`` that requires a gradient: an input with a producer."""
    t = t.clone()
    t.stop_gradient = False
    return paddle.tanh(t)


def test_a_router_and_a_shared_expert_each_read_a_copy_added_in_eagers_order(fake_runtime):
    """Eager autograd adds the shared expert's gradient first, the experts' next, the router's last:
    three copies, added up in that order."""
    eager, block = twins(Mixture, 3)
    layers, own = graph_parts(block, ("gate", "shared_experts"))
    xs = inputs()
    want = train(eager, 3, xs)
    got = train(block, 2, xs)  # watched, then both graphed: their recorded steps
    assert own.graphed_parts == (0, 1) and own.eager_parts == {}
    assert same(want[1], got[1]), "the graphed parts' call differs from eager"
    train(block, 1, xs[2:])
    assert [layer.engine.captures for layer in layers] == [2, 2]


def test_the_groups_copies_can_stand_for():
    from paddle_graphpp.paddle.own_input import _groups

    rest, router, shared = None, 0, 1
    # eager's terms in order: (part or None for the other readers, terms)
    assert _groups([(shared, 1), (rest, 1), (router, 1)], (router, shared)) == [[shared, 1], [rest, 1], [router, 1]]
    assert _groups([(shared, 1), (shared, 1), (rest, 1), (router, 1)], (router, shared)) is not None  # 2 in one
    assert _groups([(rest, 1), (rest, 1), (router, 1)], (router,)) == [[rest, 2], [router, 1]]  # a prefix
    assert _groups([(router, 1), (rest, 1), (rest, 1)], (router,)) is None  # the rest after a part
    assert _groups([(rest, 1), (router, 1), (rest, 1)], (router,)) is None  # the rest in two runs
    assert _groups([(router, 1), (rest, 1)], (router,)) == [[router, 1], [rest, 1]]  # two terms: any order
    assert _groups([(rest, 1), (shared, 1), (rest, 1), (router, 1)], (router, shared)) is None  # rest in two runs
    assert _groups([(rest, 1), (shared, 1), (rest, 1), (router, 1)], (router,)) == [[rest, 3], [router, 1]]
    assert _groups([(shared, 1), (rest, 1), (router, 1)], (router,)) == [[rest, 2], [router, 1]]
    assert _groups([(shared, 1), (router, 1)], (router, shared)) is None  # no other reader: its copy adds a zero


class Outer(nn.Layer):
    """A layer that reads its mixture's input outside the mixture too."""

    def __init__(self):
        super().__init__()
        self.mlp = Mixture()

    def forward(self, hidden_states):
        return self.mlp(hidden_states) + hidden_states * 2.0


def test_an_input_read_outside_its_block_too_keeps_the_parts_eager(fake_runtime):
    from paddle_graphpp.core.options import EngineOptions
    from paddle_graphpp.paddle.in_place import graphed_forward, swap_in
    from paddle_graphpp.paddle.own_input import OwnInput

    eager, outer = twins(Outer, 3)
    layer = graphed_forward("outer.mlp.gate", outer.mlp.gate, options=EngineOptions(num_warmup_steps=0))
    swap_in(outer.mlp.gate, layer)
    own = OwnInput(outer, outer.mlp, [("outer.mlp.gate", outer.mlp.gate, layer)])
    xs = inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want, got = train(eager, 3, xs), train(outer, 3, xs)
    assert own.graphed_parts == () and "read outside its block too" in own.eager_parts[0]
    assert sum("stays eager" in str(w.message) for w in caught) == 1
    assert all(same(w, g) for w, g in zip(want, got)) and layer.engine.captures == 0


def test_after_judgement_an_evaluation_pass_with_gradients_reads_the_copies(fake_runtime):
    eager, block = twins(Mixture, 3)
    layer, own = graph_router(block)
    xs = inputs()
    train(eager, 1, xs)
    train(block, 1, xs)  # watched
    eager.eval()
    block.eval()  # dropout off, gradients on: the copies are made all the same
    want, got = train(eager, 1, xs[1:]), train(block, 1, xs[1:])
    assert own.graphed_parts == (0,) and same(want[0], got[0])


def test_hooks_registered_after_it_survive_its_judgement(fake_runtime):
    """The judgement ends its hooks' work from inside one of them, where Paddle forbids removing."""
    eager, block = twins(DeepExperts, 4)
    layer, own = graph_router(block)
    seen = []
    block.register_forward_pre_hook(lambda layer, args: seen.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(block, 3, inputs())
    assert own.eager_parts and len(seen) == 3


def test_a_watch_whose_block_output_goes_unused_still_judges(fake_runtime):
    """GPT-OSS's mixture returns its router's scores beside its output; a loss that leaves them
    out never runs some nodes the watch found, and the input's producer says when it is done."""

    class WithScores(Mixture):
        def forward(self, hidden_states):
            return super().forward(hidden_states), hidden_states * 3.0

    eager, block = twins(WithScores, 3)
    layer, own = graph_router(block)
    xs = inputs()

    def train_first(b, x0):
        x = x0.clone()
        x.stop_gradient = False
        out, _ = b(paddle.tanh(x))
        (out * out).mean().backward()
        grads = [x.grad.numpy().copy()] + [p.grad.numpy().copy() for p in b.parameters()]
        b.clear_gradients()
        return grads

    want = [train_first(eager, x) for x in xs[:2]]
    got = [train_first(block, x) for x in xs[:2]]  # watched, then the router's recorded step
    assert own.graphed_parts == (0,) and same(want[1], got[1])
