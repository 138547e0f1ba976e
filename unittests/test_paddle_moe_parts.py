"""graph_pipeline(model) on a pipeline whose decoder layers hold a mixture of experts, as PaddleFormers
builds them: each such layer stays eager and is graphed in parts (CPU, fake graph runtime).

The decoder layer here has PaddleFormers 1.2.0's shape (``self_attn``, ``mlp.gate`` beside
``mlp.experts``, two norms) and claims its package, so the PaddleFormers adapter graphs it in parts;
its experts dispatch with host reads (``paddle.where``, ``numel() > 0``). The fake runtime
(fake_paddle_runtime.py) runs a "capture" eagerly and counts replays: the test checks that the
attention graphed in place warms up, captures and replays exactly as a graphed run does, that the
experts never run inside a capture, and that ``undo()`` gives every class back. The real
PaddleFormers classes train through the routes in test_paddleformers_zoo.py.
"""

import warnings

import pytest

paddle = pytest.importorskip("paddle")

from paddle import nn  # noqa: E402
from paddle.distributed.fleet.meta_parallel import LayerDesc  # noqa: E402
from paddle.distributed.fleet.meta_parallel import PipelineLayer as FleetPipelineLayer  # noqa: E402

from paddle_graphpp import GraphedPipeline, graph_pipeline  # noqa: E402
from paddle_graphpp.paddle.in_place import GraphedPart  # noqa: E402

VOCAB, HIDDEN, EXPERTS, SEQ = 11, 8, 4, 4
RUNTIME = {}  # the fake runtime serving the test, read by the experts
EXPERT_CALLS = {"eager": 0, "in_capture": 0}


class Attention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))

    def forward(self, hidden_states, attention_mask=None):
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        weights = nn.functional.softmax(paddle.matmul(q, k, transpose_y=True) / HIDDEN ** 0.5, axis=-1)
        return self.o_proj(paddle.matmul(weights, v)), None


class Experts(nn.LayerList):
    def __init__(self):
        super().__init__([nn.Linear(HIDDEN, HIDDEN) for _ in range(EXPERTS)])

    def dispatch(self, hidden_states, top):
        rt = RUNTIME.get("rt")
        EXPERT_CALLS["in_capture" if rt is not None and rt.is_capturing() else "eager"] += 1
        out = paddle.zeros_like(hidden_states)
        for idx, expert in enumerate(self):
            (tokens,) = paddle.where(top == idx)
            if tokens.numel() > 0:  # a host read: no capture can hold it
                tokens = tokens.reshape([-1])
                out = paddle.index_add(out, tokens, 0, expert(paddle.gather(hidden_states, tokens)))
        return out


class MoE(nn.Layer):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias_attr=False)
        self.experts = Experts()

    def forward(self, hidden_states):
        flat = hidden_states.reshape([-1, HIDDEN])
        logits = self.gate(flat)
        top = paddle.argmax(logits, axis=-1)
        scale = nn.functional.softmax(logits, axis=-1).max(axis=-1, keepdim=True)
        return (self.experts.dispatch(flat, top) * scale).reshape(hidden_states.shape)


class DecoderLayer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attn = Attention()
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = MoE()

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states))[0]
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class TopkGate(nn.Layer):
    """A router of its own (GLM-4-MoE's, DeepSeek-V3's, GPT-OSS's shape), not a lone linear layer."""

    def __init__(self):
        super().__init__()
        self.weight = self.create_parameter([HIDDEN, EXPERTS])

    def forward(self, hidden_states):
        scores = nn.functional.sigmoid(paddle.matmul(hidden_states.reshape([-1, HIDDEN]).cast("float32"), self.weight))
        with paddle.no_grad():
            top = paddle.argmax(scores, axis=-1)
        weights = scores.max(axis=-1, keepdim=True)
        return top, weights / (weights.sum(axis=-1, keepdim=True) + 1e-20) * 2.5


class RoutedMoE(nn.Layer):
    def __init__(self):
        super().__init__()
        self.gate = TopkGate()
        self.experts = Experts()
        self.shared_experts = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden_states):
        top, scale = self.gate(hidden_states)
        flat = hidden_states.reshape([-1, HIDDEN])
        routed = (self.experts.dispatch(flat, top) * scale).reshape(hidden_states.shape)
        return routed + self.shared_experts(hidden_states)


class RoutedDecoderLayer(DecoderLayer):
    def __init__(self):
        super().__init__()
        self.mlp = RoutedMoE()


# The adapter graphs in parts only the layers of PaddleFormers' package.
DecoderLayer.__module__ = RoutedDecoderLayer.__module__ = "paddleformers.transformers.fake_moe.modeling"


class Head(nn.Layer):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, VOCAB)

    def forward(self, hidden_states):
        return self.proj(hidden_states)


@pytest.fixture(autouse=True)
def single_process_fleet(monkeypatch):
    """What fleet_cpu.adjust_for_cpu gives a CPU build (fleet reads ParallelEnv().device_id)."""
    from paddle.distributed.parallel import ParallelEnv

    if not hasattr(ParallelEnv, "_device_id"):
        monkeypatch.setattr(ParallelEnv, "_device_id", 0, raising=False)
    warnings.filterwarnings("ignore", message=".*runs eagerly.*")
    EXPERT_CALLS.update(eager=0, in_capture=0)
    yield
    RUNTIME.clear()


def build(recompute_interval=0, decoder=DecoderLayer):
    paddle.seed(5)
    layers = [LayerDesc(nn.Embedding, VOCAB, HIDDEN), LayerDesc(decoder), LayerDesc(decoder),
              LayerDesc(Head)]
    model = FleetPipelineLayer(layers, num_stages=1, seg_method=f"layer:{decoder.__name__}")
    model._recompute_interval = recompute_interval  # as PaddleFormers' pipes are set (they build with 0)
    return model


def decoders(model):
    return [layer for layer in model.sublayers() if isinstance(layer, DecoderLayer)]


def test_the_attention_is_graphed_in_place_and_the_report_says_what_stays_eager_and_why():
    model = build()
    keys = list(model.state_dict().keys())
    names = [p.name for p in model.parameters()]
    graphs = graph_pipeline(model)
    report = graphs.segmentation_report()
    lines = [line.strip() for line in report.splitlines()]
    assert lines[1] == "graphed [0:1) Embedding#0", report
    assert lines[2] == ("eager   [1] DecoderLayer#1: graphed in parts: its own forward runs eagerly, calling the "
                        "parts graphed in place"), report
    assert lines[3] == "graphed in place: self_attn", report
    assert lines[4].startswith("eager: mlp.experts: the dispatch over the experts reads the host"), report
    assert lines[5].startswith("eager: mlp.gate: a lone linear layer"), report
    assert [line.split(":")[1].strip() for line in lines[6:8]] == ["input_layernorm", "post_attention_layernorm"]
    assert lines[-1] == "graphed [3:4) Head#3" and "mark_not_capturable" not in report
    for layer in decoders(model):
        assert type(layer) is DecoderLayer and type(layer.mlp.gate) is nn.Linear
        assert type(layer.self_attn).__name__ == "GraphedAttention" and isinstance(layer.self_attn, Attention)
    assert list(model.state_dict().keys()) == keys and [p.name for p in model.parameters()] == names
    assert not any(isinstance(layer, paddle.nn.Layer) and type(layer).__name__ == "CUDAGraphedLayer"
                   for layer in model.sublayers())  # the parts' graphed layers are no sublayers
    assert [layer.engine.name for layer in graphs.graphed_layers()] == [
        "stage0.layers[0:1]", "stage0.layers[1].self_attn", "stage0.layers[2].self_attn", "stage0.layers[3:4]"]

    graphs.undo()
    assert GraphedPipeline.of(model) is None
    for layer in decoders(model):
        assert type(layer.self_attn) is Attention and "_graphpp_graphed" not in layer.self_attn.__dict__
    assert graph_pipeline(model).segmentation_report() == report  # it can be graphed again


def test_under_fleet_recompute_a_mixture_stays_eager_whole():
    model = build(recompute_interval=1)
    report = graph_pipeline(model).segmentation_report()
    assert "eager   [1] DecoderLayer#1: eager whole: it cannot be captured whole, and under recompute_interval=1" \
           in report, report
    assert "graphed in place:" not in report
    assert not any(isinstance(layer, GraphedPart) for layer in model.sublayers())


def test_parts_capture_and_replay_while_the_experts_stay_outside_every_capture():
    from fake_paddle_runtime import FakePaddleRuntime
    from fake_runtime import serving
    from paddle_graphpp.core.process import current_process

    rt = FakePaddleRuntime()
    RUNTIME["rt"] = rt
    current_process().reset(rt.name)
    steps, micro = 4, 3
    try:
        with serving(rt, "paddle"):
            model = build()
            graphs = graph_pipeline(model, num_warmup_steps=1)
            opt = paddle.optimizer.SGD(1e-3, parameters=model.parameters())
            for _ in range(steps):
                for _ in range(micro):
                    tokens = paddle.randint(0, VOCAB, [2, SEQ])
                    model(tokens).mean().backward()
                opt.step()
                opt.clear_grad()
            counts = [(layer.engine.name, layer.engine.captures, layer.engine.replays)
                      for layer in graphs.graphed_layers()]
            graphs.undo()
    finally:
        current_process().reset(rt.name)
    # every graphed run and part: one position, warmed up, then its forward and backward captured
    # once and replayed for every later micro-batch
    assert counts == [(name, 2, 2 * (steps * micro - 2)) for name, _, _ in counts], counts
    assert len(counts) == 4
    assert EXPERT_CALLS == {"eager": 2 * steps * micro, "in_capture": 0}


def test_a_router_of_its_own_and_shared_experts_are_graphed_reading_copies_and_undo_takes_them_out():
    """A router that is more than a linear layer is graphed in place too, and the shared experts
    beside it, each reading its own copy of the mixture's input (test_paddle_own_input.py checks
    the sums bit for bit): eager for the first micro-batch, whose backward shows the order eager
    autograd adds their gradients in, graphed after."""
    from fake_paddle_runtime import FakePaddleRuntime
    from fake_runtime import serving
    from paddle_graphpp.core.process import current_process

    rt = FakePaddleRuntime()
    RUNTIME["rt"] = rt
    current_process().reset(rt.name)
    try:
        with serving(rt, "paddle"):
            model = build(decoder=RoutedDecoderLayer)
            graphs = graph_pipeline(model, num_warmup_steps=1)
            report = graphs.segmentation_report()
            gates = [layer.mlp.gate for layer in model.sublayers() if isinstance(layer, RoutedDecoderLayer)]
            assert [type(gate) for gate in gates] == [TopkGate, TopkGate]  # eager until judged
            for _ in range(4):
                model(paddle.randint(0, VOCAB, [2, SEQ])).mean().backward()
            states = [own.graphed_parts for own in graphs._own_inputs]
            after = graphs.segmentation_report()
            graphed = [isinstance(gate, GraphedPart) for gate in gates]
            counts = {layer.engine.name: layer.engine.captures for layer in graphs.graphed_layers()}
            graphs.undo()
    finally:
        current_process().reset(rt.name)
    assert "graphed in place: self_attn, mlp.gate, mlp.shared_experts" in report and "eager: mlp.gate" not in report
    assert report.splitlines()[-4:] == [
        f"stage0.layers[{i}].mlp.{part}: eager until the backward of a training micro-batch of its layer shows the "
        f"order its input's gradients are summed in" for i in (1, 2) for part in ("gate", "shared_experts")], report
    assert after.splitlines()[-1] == "  graphed [3:4) Head#3", after
    assert states == [(0, 1), (0, 1)] and graphed == [True, True]
    assert {name: n for name, n in counts.items() if ".mlp." in name} == {
        f"stage0.layers[{i}].mlp.{part}": 2 for i in (1, 2) for part in ("gate", "shared_experts")}, counts
    assert EXPERT_CALLS["in_capture"] == 0
    for gate in gates:
        assert type(gate) is TopkGate and not gate._forward_pre_hooks and not gate._forward_post_hooks
    assert not any(layer._forward_pre_hooks or layer._forward_post_hooks for layer in model.sublayers())
