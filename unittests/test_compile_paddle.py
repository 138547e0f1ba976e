"""``paddle.jit.to_static`` with the graphed layers (CPU): the ``to_static=`` option of
``CUDAGraphedLayer``, ``graph_pipeline`` and ``PipelineLayer``, and the graphed layer as a
boundary for SOT around it.

Without CUDA the graphed layers run eagerly (one warning). What is checked here: the layers
they wrap run converted (counted: the converted programs Paddle runs) and train as the same
layers eager; ``paddle.jit.to_static`` around a graphed layer leaves the engine untraced and the
code after it converted. SOT converts pieces of fewer than 10 operators as dygraph, so every
test runs with that threshold at 0. The pp=2 runs under fleet's launcher are at the end (slow).
"""

import os
import warnings

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from paddle import nn  # noqa: E402
from paddle.distributed.fleet.meta_parallel import LayerDesc  # noqa: E402
from paddle.distributed.fleet.meta_parallel import PipelineLayer as FleetPipelineLayer  # noqa: E402
from paddle.jit.dy2static.pir_partial_program import PartialProgramLayer  # noqa: E402
from paddle.jit.sot.opcode_translator.executor.executor_cache import OpcodeExecutorCache  # noqa: E402
from paddle.jit.sot.utils import min_graph_size_guard  # noqa: E402
from workers.fleet_ranks import launch_workers  # noqa: E402

import paddle_graphpp  # noqa: E402
from paddle_graphpp import CUDAGraphedLayer, GraphedPipeline, graph_pipeline  # noqa: E402
from paddle_graphpp.paddle import compile as to_static_mod  # noqa: E402
from paddle_graphpp.paddle.runtime import RUNTIME  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "unittests", "workers", "paddle_pipeline_worker.py")
SOT, AST = {}, {"full_graph": True}
MODES = pytest.mark.parametrize("options", [SOT, AST], ids=["sot", "ast"])


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.b(nn.functional.gelu(self.a(x)))


@pytest.fixture(autouse=True)
def small_pieces_converted():
    with min_graph_size_guard(0), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*running eagerly.*")  # CPU builds: the graphed layers' warning
        yield


@pytest.fixture
def program_runs(monkeypatch):
    """``{"n": ...}``: the converted programs (SOT's pieces, AST programs) run during the test."""
    counter = {"n": 0}
    for method in ("__call__", "sot_call"):
        original = getattr(PartialProgramLayer, method)

        def counted(self, *args, _original=original, **kwargs):
            counter["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(PartialProgramLayer, method, counted)
    return counter


def blocks(n=1, seed=0):
    paddle.seed(seed)
    return [Block() for _ in range(n)]


def train_pair(eager, other, steps=4, micro=2, params=None):
    """Train ``eager`` and ``other`` (same initial weights) on the same data with AdamW, ``micro``
    micro-batches a step with their gradients accumulated; compare losses and gradients."""
    params = params or (list(eager.parameters()), list(other.parameters()))
    opts = [paddle.optimizer.AdamW(1e-2, parameters=p) for p in params]
    paddle.seed(3)
    for _ in range(steps):
        losses = []
        xs = [paddle.randn([4, 8]) for _ in range(micro)]
        for model in (eager, other):
            outs = [model(x).square().mean() for x in xs]
            for out in outs:
                out.backward()
            losses.append(np.array([float(o) for o in outs]))
        np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6, atol=1e-7)
        for p, q in zip(*params):
            np.testing.assert_allclose(q.grad.numpy(), p.grad.numpy(), rtol=1e-5, atol=1e-7)
        for opt in opts:
            opt.step()
            opt.clear_grad()
    return losses


# ---------------------------------------------------------------- (a) the option's checks
@pytest.mark.parametrize("value, error, match", [
    ("yes", TypeError, r"to_static must be True, False or a dict .*got str"),
    ({"fullgraph": True}, ValueError, r"\['fullgraph'\], which a graphed layer does not pass.*use some of"),
    ({"property": True}, ValueError, r"\['property'\]"),
    ({"full_graph": 1}, TypeError, r"to_static\['full_graph'\] must be a bool"),
    ({"backend": "TVM"}, ValueError, r"'TVM' is no backend of paddle.jit.to_static; use 'CINN'"),
    ({"build_strategy": {}}, TypeError, r"must be a paddle.static.BuildStrategy, got dict"),
    ({"input_spec": [None]}, ValueError, r"input_spec'\] takes effect with full_graph=True only.*'full_graph': True"),
])
def test_option_errors_name_the_layer_and_the_fix(value, error, match):
    with pytest.raises(error, match=r"CUDAGraphedLayer\(Block\): .*" + match):
        CUDAGraphedLayer(Block(), to_static=value)
    with pytest.raises(error, match=r"^blk: "):
        CUDAGraphedLayer(Block(), to_static=value, name="blk")


def test_valid_options_and_off():
    spec = [paddle.static.InputSpec([4, 8], "float32")]
    for value in (True, {"full_graph": True, "input_spec": spec}, {"backend": None},
                  {"backend": "CINN", "build_strategy": paddle.static.BuildStrategy()}):
        layer = Block()
        graphed = CUDAGraphedLayer(layer, to_static=value)
        assert isinstance(graphed.engine.fn, to_static_mod.StaticLayer)
        assert not to_static_mod.is_converted(layer)  # the layer itself is left as it is
        assert list(graphed.state_dict()) == ["layer." + key for key in layer.state_dict()]
    for value in (False, None):
        layer = Block()
        assert CUDAGraphedLayer(layer, to_static=value).engine.fn is layer


def test_sot_without_pir_is_refused(monkeypatch):
    monkeypatch.setattr(paddle.framework, "use_pir_api", lambda: False)
    with pytest.raises(ValueError, match=r"CUDAGraphedLayer\(Block\): to_static with SOT.*FLAGS_enable_pir_api=0"):
        CUDAGraphedLayer(Block(), to_static=True)
    CUDAGraphedLayer(Block(), to_static=AST)


def test_converted_layers_are_refused_where_paddle_cannot_convert_around_them(program_runs):
    with pytest.raises(ValueError, match=r"the layer is converted already.*pass the plain layer"):
        CUDAGraphedLayer(paddle.jit.to_static(Block()), to_static=True)
    outer = nn.Sequential(Block(), paddle.jit.to_static(Block()))
    with pytest.raises(ValueError, match=r"Block \(1\) converted by paddle.jit.to_static already.*SOT cannot.*"
                                         r"to_static=False"):
        CUDAGraphedLayer(outer, to_static=True)
    # the AST converter handles a converted sublayer; without the option it runs converted anyway
    for value in (AST, False):
        program_runs["n"] = 0
        CUDAGraphedLayer(outer, to_static=value)(paddle.randn([4, 8])).sum().backward()
        assert program_runs["n"] == 1


# ---------------------------------------------------------------- (b) a graphed layer converted
@MODES
def test_converted_graphed_layer_trains_like_the_eager_layer(options, program_runs):
    (eager,), (inner,) = blocks(), blocks()
    graphed = CUDAGraphedLayer(inner, num_warmup_steps=1, to_static=options or True)
    train_pair(eager, graphed, steps=4, micro=2)
    assert program_runs["n"] == 4 * 2  # every forward ran the converted program
    assert not to_static_mod.is_converted(inner)


@MODES
def test_each_graphed_layer_converts_past_sots_cache_limit(options, program_runs):
    # SOT keeps 20 translations per code object and runs further callers of it unconverted;
    # each graphed layer calls through a code object of its own.
    count = OpcodeExecutorCache.MAX_CACHE_SIZE + 1
    layers = [CUDAGraphedLayer(b, num_warmup_steps=1, to_static=options or True) for b in blocks(count)]
    x = paddle.randn([4, 8])
    for layer in layers:
        layer(x).sum().backward()
    assert program_runs["n"] == count


@MODES
def test_conversion_inside_a_capture_raises(options, monkeypatch):
    (layer,) = blocks()
    static = to_static_mod.StaticLayer(layer, options, "blk")
    static(paddle.randn([4, 8]))  # the warmup converts
    monkeypatch.setattr(RUNTIME, "is_capturing", lambda: True)
    static(paddle.randn([4, 8]))  # what the warmup converted: fine
    with pytest.raises(RuntimeError, match=r"^blk: paddle.jit.to_static converted the layer anew inside the capture") \
            as raised:
        static(paddle.randn([3, 8]))
    # the engine reports it as a CaptureError; the runtime's hint replaces the general one
    assert "pass to_static=False for this layer" in RUNTIME.capture_failure_hint(raised.value, ())


# ---------------------------------------------------------------- (b) SOT around a graphed layer
class Model(nn.Layer):
    def __init__(self, middle):
        super().__init__()
        self.pre, self.post = Block(), Block()
        self.middle = middle

    def forward(self, x):
        return self.post(self.middle(self.pre(x) * 2.0))


def engine_code_traced():
    """Code objects of paddle_graphpp that SOT translated (a fallback entry has no code)."""
    package = os.path.dirname(paddle_graphpp.__file__)
    return [code.co_name for code, (entries, _) in OpcodeExecutorCache().cache.items()
            if code.co_filename.startswith(package) and any(custom.code is not None for custom, _ in entries)
            and not code.co_name.startswith("_call_layer")]  # a graphed layer's own converted call


@pytest.mark.parametrize("inner", [False, True], ids=["eager-inside", "converted-inside"])
def test_to_static_of_a_model_holding_a_graphed_layer_trains_like_eager(inner, program_runs):
    OpcodeExecutorCache().clear()
    paddle.seed(1)
    eager = Model(Block())
    paddle.seed(1)
    model = Model(CUDAGraphedLayer(Block(), num_warmup_steps=1, to_static=inner))
    static = paddle.jit.to_static(model)
    train_pair(eager, static, steps=4, micro=2, params=(list(eager.parameters()), list(model.parameters())))
    assert engine_code_traced() == []  # the graphed layer's call is a boundary: the engine ran untraced
    # the code after the graphed layer stays converted (SOT's hook is turned back on after it)
    assert static(paddle.randn([4, 8])).grad_fn.name() == "Dy2StGradNode"
    assert paddle.framework.core.set_eval_frame(None) is None  # and off once the model returned
    # pre and post (one piece each) on every forward, the inner layer's program too when converted
    assert program_runs["n"] == (4 * 2 + 1) * (3 if inner else 2)


def test_full_graph_around_a_graphed_layer_raises_with_the_fix():
    model = paddle.jit.to_static(Model(CUDAGraphedLayer(Block(), name="mid")), full_graph=True)
    with pytest.raises(RuntimeError, match=r"mid: a graphed layer runs in dynamic mode only.*full_graph=False"):
        model(paddle.randn([4, 8]))


# ---------------------------------------------------------------- graph_pipeline / PipelineLayer
@pytest.fixture
def one_stage_fleet(monkeypatch):
    from paddle.distributed.parallel import ParallelEnv

    if not hasattr(ParallelEnv, "_device_id"):
        monkeypatch.setattr(ParallelEnv, "_device_id", 0, raising=False)


def pipe(block=Block, seed=5):
    paddle.seed(seed)
    return FleetPipelineLayer([LayerDesc(block) for _ in range(3)], num_stages=1, seg_method="layer:Block")


class UserStaticBlock(Block):
    def __init__(self):
        super().__init__()
        paddle.jit.to_static(self)


@MODES
def test_graph_pipeline_to_static_computes_what_eager_does(options, one_stage_fleet, program_runs):
    eager, graphed = pipe(), pipe()
    graphs = graph_pipeline(graphed, num_warmup_steps=1, to_static=options or True)
    assert len(graphs.graphed_layers()) == 1
    train_pair(eager, graphed, steps=3, micro=2)
    assert program_runs["n"] == 3 * 2  # the run's three blocks, one converted program per forward


def test_graph_pipeline_to_static_errors_change_nothing(one_stage_fleet):
    model = pipe()
    before = list(model.run_function)
    with pytest.raises(TypeError, match=r"graph_pipeline\(PipelineLayer, to_static=...\): to_static must be"):
        graph_pipeline(model, to_static="sot")
    user = pipe(UserStaticBlock)
    user_before = list(user.run_function)
    with pytest.raises(ValueError, match=r"stage0.layers\[0:3\]: UserStaticBlock \(0\), UserStaticBlock \(1\)"):
        graph_pipeline(user, to_static=True)
    for m, entries in ((model, before), (user, user_before)):
        assert list(m.run_function) == entries and GraphedPipeline.of(m) is None
    graph_pipeline(user, to_static=AST)  # the AST converter handles converted layers


def test_pipeline_layer_to_static_needs_use_cudagraph():
    with pytest.raises(ValueError, match=r"PipelineLayer\(to_static=...\) converts the graphed runs' layers, but "
                                         r"use_cudagraph=False builds none: set use_cudagraph=True"):
        paddle_graphpp.PipelineLayer([LayerDesc(Block)], num_stages=1, to_static=True)
    with pytest.raises(TypeError, match=r"PipelineLayer\(to_static=...\): to_static must be"):
        paddle_graphpp.PipelineLayer([LayerDesc(Block)], num_stages=1, use_cudagraph=True, to_static=1)


# ---------------------------------------------------------------- (c) pp=2 under fleet's launcher
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["user", "option"])
def test_pp2_to_static_sublayers_in_the_graphed_pipeline_train_like_eager(mode, tmp_path):
    """``user``: the blocks converted by their user (``paddle.jit.to_static`` on each); ``option``:
    ``PipelineLayer(use_cudagraph=True, to_static=True)``. Dropout off; against the plain eager run."""
    steps, micro = 4, 4
    rc, seconds, logs, results = launch_workers(
        WORKER, 2, ["--pp", "2", "--steps", str(steps), "--micro-batches", str(micro), "--to-static", mode,
                    "--dropout", "0"], tmp_path, timeout=150)
    assert rc == 0, f"launch failed (rc={rc}, {seconds:.0f}s)\n{logs[-6000:]}"
    assert sorted(results) == [0, 1]
    for rank, data in results.items():
        eager, graphed = data["eager"]["losses"], data["graphed"]["losses"]
        assert len(eager) == steps and eager[-1] < eager[0], f"rank {rank}: the model did not train: {eager}"
        np.testing.assert_allclose(graphed, eager, rtol=1e-6, err_msg=f"rank {rank}, to_static {mode}")
        assert set(data["graphed"]["graphed_calls"].values()) == {steps * micro}
        # converted programs ran on every micro-batch of every graphed run (or block)
        assert data["graphed"]["converted_runs"] >= len(data["graphed"]["graphed_calls"]) * steps * micro
