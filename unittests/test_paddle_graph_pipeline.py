"""graph_pipeline(model) and install() on fleet pipeline models built in one process (CPU).

Fleet's ``PipelineLayer`` builds in a single process with ``num_stages=1`` (the pipe group has
one rank, so no communication): enough to check what graphing does to a built model — entry
lists, names, checkpoints, modes, errors — and the upstream-flag hook. Training over real
ranks is in test_paddle_pipeline.py and test_paddleformers_pipe.py.
"""

import functools
import os
import types
import warnings

import pytest

paddle = pytest.importorskip("paddle")

from paddle import nn  # noqa: E402
from paddle.distributed.fleet.meta_parallel import LayerDesc, SharedLayerDesc  # noqa: E402
from paddle.distributed.fleet.meta_parallel import PipelineLayer as FleetPipelineLayer  # noqa: E402

import paddle_graphpp  # noqa: E402
from paddle_graphpp import GraphedPipeline, graph_pipeline  # noqa: E402
from paddle_graphpp.paddle import upstream  # noqa: E402
from paddle_graphpp.paddle.integrations import fleet as fleet_adapter  # noqa: E402

VOCAB, HIDDEN = 11, 8


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(paddle.tanh(self.fc(x)))


@paddle_graphpp.mark_not_capturable
class HostProbe(nn.Layer):
    def forward(self, x):
        return x


def tied_head(embedding, hidden):
    return paddle.matmul(hidden, embedding.weight, transpose_y=True)


def halve(x):
    return x * 0.5


class WeightedProbe(HostProbe):
    """An eager layer (marked, as HostProbe) with a weight: fleet's recompute recomputes it."""

    def __init__(self):
        super().__init__()
        self.scale = self.create_parameter([HIDDEN], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x):
        return x * self.scale


def descs(blocks=4, probe=False, callable_at=None):
    layers = [SharedLayerDesc("embed", nn.Embedding, None, "weight", VOCAB, HIDDEN)]
    for i in range(blocks):
        layers.append(LayerDesc(Block))
        if i == callable_at:
            layers.append(halve)
        if probe and i == blocks // 2 - 1:
            layers.append(LayerDesc(probe if isinstance(probe, type) else HostProbe))
    layers.append(SharedLayerDesc("embed", nn.Embedding, tied_head, "weight", VOCAB, HIDDEN))
    return layers


@pytest.fixture(autouse=True)
def single_process_fleet(monkeypatch):
    """What fleet_cpu.adjust_for_cpu gives a CPU build (fleet reads ParallelEnv().device_id);
    and no patch of fleet's class left behind by a test."""
    from paddle.distributed.parallel import ParallelEnv

    if not hasattr(ParallelEnv, "_device_id"):
        monkeypatch.setattr(ParallelEnv, "_device_id", 0, raising=False)
    warnings.filterwarnings("ignore", message=".*runs eagerly.*")
    yield
    upstream.uninstall()


@pytest.fixture
def fleet_state(monkeypatch):
    """What fleet.init(is_collective=True, strategy=...) leaves for paddle_graphpp.PipelineLayer
    (fleet.init itself needs a launched job): the strategy and a one-stage pipe group."""
    from paddle.distributed import fleet

    monkeypatch.setattr(fleet.fleet, "_user_defined_strategy", fleet.DistributedStrategy(), raising=False)
    one_stage = types.SimpleNamespace(get_pipe_parallel_world_size=lambda: 1)
    monkeypatch.setattr(fleet, "get_hybrid_communicate_group", lambda: one_stage)


def build(vpp=None, cls=FleetPipelineLayer, **kwargs):
    paddle.seed(5)
    return cls(kwargs.pop("layers", None) or descs(), num_stages=1, num_virtual_pipeline_stages=vpp,
               seg_method="layer:Block", **kwargs)


def entries(model):
    if model._num_virtual_pipeline_stages > 1:
        return [f for chunk in model._model_chunks for f in chunk.run_function]
    return list(model.run_function)


def run(model, tokens):
    if model._num_virtual_pipeline_stages == 1:
        return model(tokens)
    x = tokens
    for chunk_id in range(len(model._model_chunks)):
        x = model(x, chunk_id=chunk_id)
    return x


def upstream_graphed(model):
    from paddle.device.cuda.cuda_graphed_layer import CUDAGraphedLayer as Upstream

    return any(isinstance(f, Upstream) for f in entries(model))


# ---------------------------------------------------------------- graph_pipeline
@pytest.mark.parametrize("vpp", [None, 2], ids=["1f1b", "interleaved"])
def test_names_keys_and_optimizer_parameters_unchanged(vpp):
    model = build(vpp)
    keys = list(model.state_dict().keys())
    names = [p.name for p in model.parameters()]
    sublayers = [name for name, _ in model.named_sublayers()]
    opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
    params = list(opt._parameter_list)

    graphs = graph_pipeline(model)  # after the optimizer: fine, nothing is created or replaced

    assert list(model.state_dict().keys()) == keys
    assert [p.name for p in model.parameters()] == names
    assert [name for name, _ in model.named_sublayers()] == sublayers
    assert all(a is b for a, b in zip(model.parameters(), params)) and len(params) == len(names)
    assert GraphedPipeline.of(model) is graphs and model.use_cudagraph is True
    assert sum(type(f).__name__ == "_GraphedRunCall" for f in entries(model)) == len(graphs.graphed_layers())


@pytest.mark.parametrize("vpp", [None, 2], ids=["1f1b", "interleaved"])
def test_graphed_model_computes_what_the_eager_one_does(vpp):
    eager, graphed = build(vpp), build(vpp)
    graph_pipeline(graphed)
    tokens = paddle.to_tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    results = []
    for model in (eager, graphed):
        paddle.seed(11)  # the same dropout masks
        out = run(model, tokens)
        out.sum().backward()
        results.append((out.numpy(), [p.grad.numpy() for p in model.parameters()]))
    (out_e, grads_e), (out_g, grads_g) = results
    assert (out_e == out_g).all()
    assert len(grads_e) == len(grads_g) and all((a == b).all() for a, b in zip(grads_e, grads_g))


def test_segmentation_keeps_shared_callables_and_opted_out_layers_eager():
    model = build(layers=descs(blocks=4, probe=True, callable_at=2))
    report = graph_pipeline(model).segmentation_report()
    lines = [line.strip() for line in report.splitlines()]
    assert lines == [
        "stage 0:",
        "eager   [0] shared:embed: shared weights (gradients synced across stages)",
        "graphed [1:3) Block#1, Block#2",
        "eager   [3] HostProbe#3: marked with mark_not_capturable",
        "graphed [4:5) Block#4",
        "eager   [5] halve#5: plain callable",
        "graphed [6:7) Block#6",
        "eager   [7] shared:embed: shared weights (gradients synced across stages)",
    ], report


def test_runs_follow_the_models_train_and_eval_mode():
    model = build()
    graphs = graph_pipeline(model)
    bodies = [layer.layer for layer in graphs.graphed_layers()]
    model.eval()
    assert [body.training for body in bodies] == [False]
    model.train()
    assert [body.training for body in bodies] == [True]


@pytest.mark.parametrize("vpp", [None, 2], ids=["1f1b", "interleaved"])
def test_checkpoint_files_are_fleets_per_layer_files(vpp, tmp_path):
    eager, graphed = build(vpp), build(vpp)
    graph_pipeline(graphed)
    before = entries(graphed)
    eager.save_state_dict(str(tmp_path / "eager"))
    graphed.save_state_dict(str(tmp_path / "graphed"))
    assert sorted(os.listdir(tmp_path / "graphed")) == sorted(os.listdir(tmp_path / "eager"))
    assert entries(graphed) == before  # the graphed runs are back after the save

    for p in graphed.parameters():
        p.set_value(paddle.zeros_like(p))
    graphed.set_state_dir(str(tmp_path / "eager"))
    assert all((a.numpy() == b.numpy()).all() for a, b in zip(eager.parameters(), graphed.parameters()))
    assert entries(graphed) == before


def test_eager_view_shows_fleets_lists():
    model = build()
    eager = entries(model)
    graphs = graph_pipeline(model)
    with graphs.eager_view():
        assert entries(model) == eager
    assert entries(model) != eager


def test_distributed_model_wrapper_is_unwrapped():
    model = build()
    wrapper = types.SimpleNamespace(_layers=model)  # what fleet.distributed_model returns holds it so
    graphs = graph_pipeline(wrapper)
    assert graphs.model is model and GraphedPipeline.of(wrapper) is graphs


def test_errors_name_the_model_and_the_fix():
    with pytest.raises(TypeError, match=r"got Linear; wrap a single layer with paddle_graphpp.CUDAGraphedLayer"):
        graph_pipeline(nn.Linear(2, 2))
    model = build()
    graph_pipeline(model)
    with pytest.raises(RuntimeError, match=r"graph_pipeline\(PipelineLayer\): the model is graphed already"):
        graph_pipeline(model)
    with pytest.raises(ValueError, match="built with use_cudagraph=True.*paddle_graphpp.install"):
        graph_pipeline(build(use_cudagraph=True))
    offloading = build(recompute_interval=1, recompute_ctx={"mp_group": object(), "offload": True, "partition": False})
    before = entries(offloading)
    with pytest.raises(ValueError, match=r"graph_pipeline\(PipelineLayer\): recompute_ctx offload=True moves or splits "
                                         r".*static buffers.*Set offload to False in recompute_ctx, or set "
                                         r"use_cudagraph=False"):
        graph_pipeline(offloading)
    assert GraphedPipeline.of(offloading) is None and entries(offloading) == before
    assert offloading._recompute_interval == 1


def test_unknown_layout_names_the_paddle_version():
    model = build()
    del model.run_function
    with pytest.raises(RuntimeError, match=f"Paddle {paddle.__version__} does not keep its layers"):
        graph_pipeline(model)


# ---------------------------------------------------------------- no graph inside a graph
def autocudagraph_stand_in(func):
    """A stand-in for PaddleFormers' ``paddleformers.fleet.cudagraph.autocudagraph(...)`` decorator
    (not in PaddleFormers 1.2.0, and it captures CUDA graphs, which a CPU build cannot): it runs
    ``func`` eagerly and leaves on its wrapper what autocudagraph leaves there, a ``state_registry``
    dict of graphs by dispatch key and a ``clear_cache()`` that empties it. That marker is what
    graph_pipeline recognises."""
    registry = {}

    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    wrapper.state_registry = registry
    wrapper.clear_cache = registry.clear
    return wrapper


class AutoGraphedBlock(Block):
    forward = autocudagraph_stand_in(Block.forward)  # what `@autocudagraph()` over `def forward` gives


class Pair(nn.Layer):
    def __init__(self):
        super().__init__()
        self.inner = Block()
        self.outer = Block()

    def forward(self, x):
        return self.outer(self.inner(x))


def with_layer(desc, at=2):
    layers = descs()
    layers[at] = desc
    return layers


def test_a_model_graphed_by_autocudagraph_is_refused_and_left_unchanged():
    model = build(layers=with_layer(LayerDesc(AutoGraphedBlock)))
    before = list(model.run_function)
    with pytest.raises(ValueError, match=r"graph_pipeline\(PipelineLayer\): layers\[2\] \(AutoGraphedBlock\) is "
                                         r"already CUDA-graphed by PaddleFormers' autocudagraph.*forward of "
                                         r"AutoGraphedBlock.*remove @autocudagraph"):
        graph_pipeline(model)
    assert list(model.run_function) == before and GraphedPipeline.of(model) is None
    assert model(paddle.to_tensor([[1, 2, 3]])).shape == [1, 3, VOCAB]  # still trains eagerly


def test_autocudagraph_on_a_sublayers_instance_method_is_refused():
    model = build(layers=with_layer(LayerDesc(Pair), at=3))
    pair = model.run_function[3]
    pair.inner.forward = autocudagraph_stand_in(pair.inner.forward)  # decorating one instance
    with pytest.raises(ValueError, match=r"layers\[3\] \(Pair\).*inner\.forward of Block"):
        graph_pipeline(model)
    plain = build(layers=with_layer(LayerDesc(Pair), at=3))
    plain.run_function[3].inner.forward.__func__.state_registry = None  # not the decorator's marker
    assert GraphedPipeline.of(plain) is None and graph_pipeline(plain) is not None


def test_install_refuses_autocudagraph_layers_too(fleet_state):
    paddle_graphpp.install(default_use_cudagraph=True)
    with pytest.raises(ValueError, match=r"AutoGraphedBlock\) is already CUDA-graphed by PaddleFormers' autocudagraph"):
        build(layers=with_layer(LayerDesc(AutoGraphedBlock)))


def test_a_paddleformers_config_that_recomputes_is_refused():
    # PaddleFormers' pipe models recompute inside their layers when config.recompute_granularity
    # is set (fleet's recompute_interval stays 0); the Trainer's argument of that name sets it too
    model = build()
    model.config = types.SimpleNamespace(recompute_granularity="full")
    with pytest.raises(ValueError, match=r"graph_pipeline\(PipelineLayer\) cannot take over "
                                         r"config.recompute_granularity='full': PaddleFormers recomputes inside each "
                                         r"decoder layer's forward.*Set recompute_granularity=None.*"
                                         r"model._recompute_interval = 1 before graph_pipeline"):
        graph_pipeline(model)
    assert GraphedPipeline.of(model) is None
    model.config.recompute_granularity = None
    assert graph_pipeline(model) is not None


# ---------------------------------------------------------------- recompute_interval
RECOMPUTE_CTX = {"mp_group": object(), "offload": False, "partition": False}  # fleet asserts an mp_group


def counting_forwards(model):
    """``{sublayer name: forwards}`` of the model's Blocks and weighted probes, counted by forward pre-hooks."""
    counts = {}
    for name, layer in model.named_sublayers():
        if isinstance(layer, (Block, WeightedProbe)):
            counts[name] = 0
            layer.register_forward_pre_hook(lambda _l, _i, name=name: counts.__setitem__(name, counts[name] + 1))
    return counts


@pytest.mark.parametrize("vpp", [None, 2], ids=["1f1b", "interleaved"])
@pytest.mark.parametrize("interval", [1, 2])
def test_recompute_interval_recomputes_what_fleet_does_with_each_run_called_once(fleet_state, interval, vpp):
    from paddle_graphpp.paddle import fleet_cpu

    fleet_cpu.adjust_for_cpu()  # fleet's recompute_hybrid asserts a device; on CPU fleet's generic recompute
    layers = descs(blocks=4, probe=WeightedProbe, callable_at=2)  # an eager layer that fleet recomputes
    eager = build(vpp, layers=layers, recompute_interval=interval, recompute_ctx=RECOMPUTE_CTX)
    graphed = build(vpp, layers=layers, recompute_interval=interval, recompute_ctx=RECOMPUTE_CTX)
    graphs = graph_pipeline(graphed)
    runs = [layer for layer in graphs.graphed_layers()]
    run_calls = {id(layer): 0 for layer in runs}
    for layer in runs:
        layer.register_forward_pre_hook(lambda _l, _i, key=id(layer): run_calls.__setitem__(key, run_calls[key] + 1))
    # no graphed run spans two of fleet's groups; fleet's own interval shows in the eager view only
    assert all(len({(e.index - c.runs[0].start) // interval for e in run.entries}) == 1
               for c in graphs._chunks for run in c.runs if run.graphed)
    assert graphed._recompute_interval == 0
    with graphs.eager_view():
        assert graphed._recompute_interval == interval
    report = graphs.segmentation_report()
    assert f"recompute_interval={interval}: graphed runs recompute inside their own graphs" in report

    tokens = paddle.to_tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    results = []
    for model in (eager, graphed):
        forwards = counting_forwards(model)
        paddle.seed(11)
        for _ in range(2):
            out = run(model, tokens)
            out.sum().backward()
        results.append((out.numpy(), [p.grad.numpy() for p in model.parameters()], forwards))
    (out_e, grads_e, fwd_e), (out_g, grads_g, fwd_g) = results
    assert (out_e == out_g).all() and all((a == b).all() for a, b in zip(grads_e, grads_g))
    assert fwd_g == fwd_e, "the graphed model recomputed other layers than fleet does"
    assert 4 in fwd_e.values(), "nothing was recomputed"  # 2 forwards, each recomputed once
    probe = [name for name, layer in eager.named_sublayers() if isinstance(layer, WeightedProbe)]
    assert [fwd_e[name] for name in probe] == [4], "fleet did not recompute the eager layer"
    assert set(run_calls.values()) == {2}, "a graphed run was called other than once per forward"


def test_fleets_own_recompute_on_cpu_ranks_refuses_offload_naming_the_fix(fleet_state):
    from paddle_graphpp.paddle import fleet_cpu

    fleet_cpu.adjust_for_cpu()
    model = build(recompute_interval=1, recompute_ctx={"mp_group": object(), "offload": True, "partition": False})
    with pytest.raises(ValueError, match=r"offload=True or partition=True needs a device.*set both to False on CPU"):
        model(paddle.to_tensor([[1, 2, 3]]))


def test_recompute_interval_with_dualpipev_is_refused_before_building():
    with pytest.raises(ValueError, match=r"recompute_interval=1 with use_dualpipev=True: DualPipeV splits backwards "
                                         r"into input and weight halves.*Set recompute_interval=0, or use the 1F1B"):
        fleet_adapter.check_graphable("PipelineLayer(use_cudagraph=True)", recompute_interval=1,
                                      recompute_ctx=RECOMPUTE_CTX, use_dualpipev=True)


# ---------------------------------------------------------------- fleet_cpu in the caller's order
def test_cpu_adjustment_before_fleet_init_names_the_call_and_where_it_goes(monkeypatch):
    from paddle.distributed import fleet
    from paddle.distributed.parallel import ParallelEnv

    from paddle_graphpp.paddle import fleet_cpu

    monkeypatch.setattr(fleet.fleet, "_user_defined_strategy", None, raising=False)  # no fleet.init yet
    monkeypatch.delattr(ParallelEnv, "_device_id", raising=False)
    with pytest.raises(RuntimeError, match=r"^paddle_graphpp\.paddle\.fleet_cpu\.adjust_for_cpu\(\) was called before "
                                           r"fleet\.init.*after TrainingArguments\(\.\.\.\), whose __post_init__ calls "
                                           r"fleet\.init"):
        fleet_cpu.adjust_for_cpu()
    assert not hasattr(ParallelEnv, "_device_id")  # nothing changed
    with pytest.raises(RuntimeError, match=r"^paddle_graphpp\.PipelineLayer\(\.\.\.\) was called before fleet\.init"):
        build(cls=paddle_graphpp.PipelineLayer)
    strategy = fleet.DistributedStrategy()
    monkeypatch.setattr(fleet.fleet, "_user_defined_strategy", strategy)
    assert strategy.hybrid_configs["pp_configs"].use_batch_p2p_comm
    assert fleet_cpu.adjust_for_cpu() is True  # after fleet.init: what fleet's pipeline needs on CPU
    assert not strategy.hybrid_configs["pp_configs"].use_batch_p2p_comm and ParallelEnv._device_id == 0


def test_paddle_graphpp_pipeline_layer_is_graph_pipeline(fleet_state):
    model = build(cls=paddle_graphpp.PipelineLayer, use_cudagraph=True)
    graphs = GraphedPipeline.of(model)
    assert graphs is not None and model.graphed_layers() == graphs.graphed_layers()
    assert model.segmentation_report() == graphs.segmentation_report()
    eager = build(cls=paddle_graphpp.PipelineLayer)
    assert GraphedPipeline.of(eager) is None and eager.graphed_layers() == []
    assert list(model.state_dict().keys()) == list(eager.state_dict().keys())


# ---------------------------------------------------------------- install(): upstream's flag
class LibraryPipe(FleetPipelineLayer):
    """Like PaddleFormers' ...Pipe models: calls fleet's constructor itself, without use_cudagraph."""

    def __init__(self, **kwargs):
        paddle.seed(5)
        FleetPipelineLayer.__init__(self, layers=descs(), num_stages=1, seg_method="layer:Block", **kwargs)


def test_install_makes_the_upstream_flag_build_our_runs():
    eager = build()
    paddle_graphpp.install()
    model = build(use_cudagraph=True)
    assert GraphedPipeline.of(model) is not None and not upstream_graphed(model)
    assert list(model.state_dict().keys()) == list(eager.state_dict().keys())
    assert GraphedPipeline.of(build()) is None  # no flag, no default: eager
    assert GraphedPipeline.of(LibraryPipe()) is None
    interleaved = build(2, use_cudagraph=True)
    assert "stage 0 chunk 1:" in GraphedPipeline.of(interleaved).segmentation_report()


def test_install_default_graphs_classes_that_never_pass_the_flag(fleet_state):
    paddle_graphpp.install(default_use_cudagraph=True, num_warmup_steps=5)
    model = LibraryPipe()
    graphs = GraphedPipeline.of(model)
    assert graphs is not None and not upstream_graphed(model)
    assert "graphed [1:5) Block#1, Block#2, Block#3, Block#4" in graphs.segmentation_report()
    assert GraphedPipeline.of(LibraryPipe(use_cudagraph=False)) is None  # an explicit False is kept
    ours = build(cls=paddle_graphpp.PipelineLayer, use_cudagraph=True)  # graphed once, by itself
    assert GraphedPipeline.of(ours) is not None


def test_install_checks_before_building_and_uninstall_restores():
    original = FleetPipelineLayer.__init__
    paddle_graphpp.install()
    paddle_graphpp.install()  # again: settings only, one wrapper
    assert FleetPipelineLayer.__init__.__wrapped__ is original
    with pytest.raises(ValueError, match=r"PipelineLayer\(use_cudagraph=True\): recompute_ctx partition=True"):
        build(use_cudagraph=True, recompute_interval=1, recompute_ctx={"mp_group": object(), "partition": True})
    assert GraphedPipeline.of(build(use_cudagraph=True, recompute_interval=1, recompute_ctx=RECOMPUTE_CTX)) is not None
    paddle_graphpp.uninstall()
    assert FleetPipelineLayer.__init__ is original
    assert upstream_graphed(build(use_cudagraph=True))  # upstream's own path again
    paddle_graphpp.uninstall()  # not installed: nothing to do


def test_install_refuses_a_paddle_without_the_hook(monkeypatch):
    def old_init(self, layers, num_stages=None, topology=None, loss_fn=None, seg_method="uniform"):
        raise AssertionError("not called")

    monkeypatch.setattr(FleetPipelineLayer, "__init__", old_init)
    with pytest.raises(RuntimeError, match=f"Paddle {paddle.__version__} has no use_cudagraph argument.*"
                                           r"graph_pipeline\(model\)"):
        paddle_graphpp.install()
    assert FleetPipelineLayer.__init__ is old_init


def test_uninstall_refuses_to_drop_a_later_patch(monkeypatch):
    paddle_graphpp.install()
    ours = FleetPipelineLayer.__init__
    monkeypatch.setattr(FleetPipelineLayer, "__init__", functools.wraps(ours)(lambda *a, **k: ours(*a, **k)))
    with pytest.raises(RuntimeError, match="replaced after paddle_graphpp.install"):
        paddle_graphpp.uninstall()
    monkeypatch.undo()


# ---------------------------------------------------------------- graph_loss
def cross_entropy(logits, labels):
    return paddle.nn.functional.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1]))


def test_graph_loss_replaces_the_loss_keeps_names_and_computes_eagers_loss():
    eager, graphed = build(loss_fn=cross_entropy), build(loss_fn=cross_entropy)
    graphs = graph_pipeline(graphed, graph_loss=True)
    assert graphed._loss_fn[0] is graphs.graphed_loss and graphs.graphed_loss.__name__ == "cross_entropy"
    assert graphs.segmentation_report().splitlines()[-1] == "loss: graphed (stage0.loss)"
    assert [n for n, _ in graphed.named_parameters()] == [n for n, _ in eager.named_parameters()]
    tokens = paddle.to_tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    labels = paddle.to_tensor([[2, 3, 4, 5], [6, 7, 8, 9]])
    results = []
    for model in (eager, graphed):
        paddle.seed(11)
        loss = model._loss_fn[0](run(model, tokens), labels)
        loss.backward()
        results.append((float(loss), [p.grad.numpy() for p in model.parameters()]))
    assert results[0][0] == results[1][0]
    assert all((a == b).all() for a, b in zip(results[0][1], results[1][1]))


def test_graph_loss_refuses_several_losses_and_trainable_ones_and_changes_nothing():
    several = build(loss_fn=[cross_entropy, cross_entropy])
    with pytest.raises(ValueError, match=r"graph_loss=True\) graphs one loss function, the model has 2.*"
                                         r"Pass graph_loss=False"):
        graph_pipeline(several, graph_loss=True)
    trainable = build(loss_fn=nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"the loss Linear has trainable parameters \['weight', 'bias'\]"):
        graph_pipeline(trainable, graph_loss=True)
    for model in (several, trainable):
        assert GraphedPipeline.of(model) is None
        assert not any(type(f).__name__ == "_GraphedRunCall" for f in entries(model))


def test_each_micro_batch_gets_its_own_graphed_loss_tensor_and_undo_gives_the_loss_back():
    # graph_loss as in the PyTorch runtime: the last stage runs each micro-batch's forward and
    # backward before the next, so every micro-batch replays the loss's one position.
    from fake_paddle_runtime import FakePaddleRuntime
    from fake_runtime import serving
    from paddle_graphpp import GraphedLoss, graph_loss
    from paddle_graphpp.core.process import current_process

    rt = FakePaddleRuntime()
    current_process().reset(rt.name)
    try:
        with serving(rt, "paddle"):
            loss_fn = graph_loss(cross_entropy, num_warmup_steps=1)
            assert isinstance(loss_fn, GraphedLoss) and loss_fn.loss_fn is cross_entropy
            for step in range(4):
                losses = []
                for _ in range(3):
                    logits = paddle.randn([2, 4, VOCAB])
                    logits.stop_gradient = False
                    loss = loss_fn(logits, paddle.randint(0, VOCAB, [2, 4]))
                    losses.append(loss)
                    loss.backward()
                assert len({t.data_ptr() for t in losses}) == 3, f"step {step}: the losses share storage"
            # one position: warmup, record, then the (forward, backward) pair replayed 10 times
            assert (loss_fn.engine.captures, loss_fn.engine.replays) == (2, 2 * (4 * 3 - 2))
            assert loss_fn.undo() is cross_entropy
            with pytest.raises(RuntimeError, match="undo"):
                loss_fn(paddle.randn([2, 4, VOCAB]), paddle.randint(0, VOCAB, [2, 4]))
    finally:
        current_process().reset(rt.name)


def test_graph_loss_refuses_what_it_cannot_graph():
    from paddle_graphpp import graph_loss

    with pytest.raises(TypeError, match=r"graph_loss\(loss\): loss_fn must be callable"):
        graph_loss(3)
    with pytest.raises(TypeError, match=r"the loss Linear has trainable parameters \['weight', 'bias'\]"):
        graph_loss(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="graphed already"):
        graph_loss(graph_loss(cross_entropy))
    with pytest.raises(TypeError, match="accumulate_grads"):
        graph_loss(cross_entropy, accumulate_grads=True)
