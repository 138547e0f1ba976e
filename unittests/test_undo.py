"""Every graphing front door can be undone, on CPU (PyTorch and Paddle runtimes).

Each door graphs a small model and runs forward/backward steps under a fake graph runtime
(unittests/fake_runtime.py: capture runs the code eagerly, replay only counts), so that graphs
are really held when it is undone. Undo must then leave exactly what was there before graphing:
module classes and instance attributes (no ``forward`` left on an instance), hooks, module
names, ``state_dict`` keys, parameter identity and values, fleet's lists and constructor,
optimizer settings; release the graphs (every engine empty and retired); compute what the model
computed before graphing, bit for bit; and allow graphing again. Misuse (undo twice, undo with a
micro-batch in flight, a call after undo) raises, naming the layer.
"""
import copy
import functools
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from fake_graphs import ZeroedStaticBuffers  # noqa: E402
from fake_runtime import FakeGraphRuntime, serving  # noqa: E402

from paddle_graphpp import graph_api  # noqa: E402
from paddle_graphpp.core.errors import GraphScheduleError  # noqa: E402
from paddle_graphpp.core.process import current_process  # noqa: E402

VOCAB, SEQ, HIDDEN = 64, 8, 16
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


class ZeroedFakeRuntime(ZeroedStaticBuffers, FakeGraphRuntime):
    """Static buffers zeroed, as the fake Paddle runtime's."""


@pytest.fixture
def fake():
    """Fake graph runtimes served as "torch" and, once imported, "paddle"; nothing left behind."""
    runtimes = {"torch": ZeroedFakeRuntime()}
    if "paddle" in sys.modules:
        from fake_paddle_runtime import FakePaddleRuntime

        runtimes["paddle"] = FakePaddleRuntime()

    def clear():
        for rt in runtimes.values():
            current_process().reset(rt.name)

    clear()
    with serving(runtimes["torch"], "torch"):
        if "paddle" in runtimes:
            with serving(runtimes["paddle"], "paddle"):
                yield runtimes
        else:
            yield runtimes
    clear()


@pytest.fixture
def capturable_on_cpu(monkeypatch):
    """torch's capturable Adam refuses CPU tensors; with the fake runtime making CPU tensors
    "graphable", the optimizers switched to their capturable mode must step them."""
    import torch.optim.adam as adam

    supported = adam._get_capturable_supported_devices
    monkeypatch.setattr(adam, "_get_capturable_supported_devices", lambda *a, **k: [*supported(*a, **k), "cpu"])


# ------------------------------------------------------------------------------ snapshots
def torch_state(model) -> dict:
    """What graphing must not leave changed in a torch model (values apart)."""
    return {
        "modules": [(n, type(m), sorted(vars(m))) for n, m in model.named_modules()],
        "hooks": [(n, list(m._forward_hooks.values()), list(m._forward_pre_hooks.values()),
                   list(m._backward_hooks.values())) for n, m in model.named_modules()],
        "params": [(n, id(p)) for n, p in model.named_parameters()],
        "keys": list(model.state_dict()),
    }


def paddle_state(model) -> dict:
    state = {
        "layers": [(n, type(m), sorted(vars(m))) for n, m in model.named_sublayers(include_self=True)],
        "hooks": [(n, list(m._forward_pre_hooks.values()), list(m._forward_post_hooks.values()))
                  for n, m in model.named_sublayers(include_self=True)],
        "params": [(p.name, id(p)) for p in model.parameters()],
        "keys": list(model.state_dict()),
    }
    if hasattr(model, "run_function"):  # a fleet pipeline model: its lists, as objects and entries
        lists = [c.run_function for c in model._model_chunks] if model._num_virtual_pipeline_stages > 1 \
            else [model.run_function]
        state["fleet"] = ([(id(entries), [id(f) for f in entries]) for entries in lists],
                          [id(f) for f in model._loss_fn], model._recompute_interval, model.use_cudagraph)
    return state


def values(params) -> list:
    return [p.detach().clone() if isinstance(p, torch.Tensor) else p.numpy().copy() for p in params]


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a.shape == b.shape and a.dtype == b.dtype and (a == b).all()


def groups(optimizer) -> list:
    """A torch optimizer's param-group settings, with each value's type (a float lr is not its tensor)."""
    return [{k: (type(v), v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


# ------------------------------------------------------------------------------ the doors
class Door:
    """One front door over one subject (what graphing changes). Subclasses define ``build()``,
    ``graph(subject) -> handle``, ``step(handle, subject)`` (one training step of micro-batches),
    ``undo(handle, subject)``, ``returns(subject)`` (what undo must return), ``loss(subject)``
    (an eager forward of the ungraphed subject) and ``engines(handle)``."""

    framework = "torch"
    captures = True  # its steps capture graphs under the fake runtime (graph_step: warmup only)
    lenient = False  # undoing twice is a no-op, not an error (ungraph_layers: blocks not graphed are left)
    twice = RuntimeError  # what undoing twice raises

    def state(self, subject) -> dict:
        return torch_state(subject)

    def params(self, subject) -> list:
        return list(subject.parameters())

    def compute(self, subject) -> list:
        """The loss and every gradient of one eager forward/backward, the random draws fixed."""
        params = self.params(subject)
        for p in params:
            p.grad = None
        torch.manual_seed(7)
        loss = self.loss(subject)
        loss.backward()
        out = [loss.detach().clone()] + [p.grad.clone() for p in params if p.grad is not None]
        for p in params:
            p.grad = None
        return out

    def fire(self, handle, engines) -> None:
        """Call the graphed thing once (a forward); undone, it must raise."""
        engines[0]((), {})


def tokens(seed: int):
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, use_cache=False))


def mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(HIDDEN, 4))
    model[0].register_forward_hook(lambda m, i, o: None)  # a hook: kept, and still there after undo
    return model


def features(seed: int):
    return torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(seed))


def micro_batches(forward, steps=4, n=2):
    """``steps`` steps of ``n`` micro-batches, forwards then backwards (warmup, record, capture, replay)."""
    for step in range(steps):
        losses = [forward(step * n + i) for i in range(n)]
        for loss in losses:
            loss.backward()


class GraphedModuleDoor(Door):
    name = "CUDAGraphedModule"

    def build(self):
        return mlp()

    def graph(self, model):
        from paddle_graphpp.torch import CUDAGraphedModule

        return CUDAGraphedModule(model, num_warmup_steps=1)

    def step(self, handle, model):
        micro_batches(lambda i: handle(features(i)).square().mean())

    def undo(self, handle, model):
        return handle.undo()

    def returns(self, model):
        return model

    def loss(self, model):
        return model(features(99)).square().mean()

    def engines(self, handle):
        return [handle.engine]

    def fire(self, handle, engines):
        handle(features(0))


class StageDoor(GraphedModuleDoor):
    name = "graph_stage_module"

    def build(self):
        model = mlp()
        return torch.nn.Sequential(*model, torch.nn.Tanh())

    def graph(self, stage):
        from paddle_graphpp.torch import graph_stage_module

        return graph_stage_module(stage, num_warmup_steps=1)

    def engines(self, handle):
        return [m.engine for m in handle.graphed_modules]


class LossDoor(Door):
    name = "graph_loss"

    def __init__(self):
        draw = torch.Generator().manual_seed(3)
        self.logits = torch.randn(6, VOCAB, generator=draw, requires_grad=True)
        self.labels = torch.randn(6, VOCAB, generator=draw)

    def build(self):
        loss = torch.nn.HuberLoss(delta=0.5)  # float targets: the fake runtime's buffers hold no valid labels
        loss.register_forward_pre_hook(lambda m, i: None)
        return loss

    def params(self, loss):
        return [self.logits]

    def graph(self, loss):
        from paddle_graphpp.torch import graph_loss

        return graph_loss(loss, num_warmup_steps=1)

    def step(self, handle, loss):
        # the last stage: each micro-batch's forward and backward before the next
        for _ in range(4):
            for i in range(2):
                handle(self.logits * (i + 1), self.labels).backward()

    def undo(self, handle, loss):
        return handle.undo()

    def returns(self, loss):
        return loss

    def loss(self, loss):
        return loss(self.logits, self.labels)

    def engines(self, handle):
        return [handle.engine]

    def fire(self, handle, engines):
        handle(self.logits, self.labels)


class LayersDoor(Door):
    name = "graph_layers"

    def build(self):
        model = llama()
        model.model.layers[1].register_forward_hook(lambda m, i, o: None)
        return model

    def graph(self, model):
        from paddle_graphpp.torch import graph_layers

        return graph_layers(model.model.layers, num_warmup_steps=1)

    def step(self, handle, model):
        micro_batches(lambda i: model(tokens(i), labels=tokens(i)).loss)

    def undo(self, handle, model):
        blocks = handle.undo()
        assert blocks == list(model.model.layers)
        return model

    def returns(self, model):
        return model

    def loss(self, model):
        x = tokens(99)
        return model(x, labels=x).loss

    def engines(self, handle):
        return [b.engine for b in handle]


class UngraphLayersDoor(LayersDoor):
    name = "ungraph_layers"
    lenient = True

    def undo(self, handle, model):
        from paddle_graphpp.torch import ungraph_layers

        assert ungraph_layers(model.model.layers) == list(model.model.layers)
        return model


class StageCutDoor(LayersDoor):
    """causal_lm_stage: a new stage, the model's blocks graphed in place (or one graph for the stage)."""

    def __init__(self, scope):
        self.scope = scope
        self.name = f"causal_lm_stage-{scope}"

    def graph(self, model):
        from paddle_graphpp.torch import causal_lm_stage

        return causal_lm_stage(model, 0, 1, num_warmup_steps=1, scope=self.scope)

    def step(self, stage, model):
        def forward(i):
            x = tokens(i)
            return torch.nn.functional.cross_entropy(stage(x).flatten(0, 1), x.flatten())

        micro_batches(forward)

    def undo(self, stage, model):
        return stage.undo()

    def engines(self, stage):
        return [stage._whole.engine] if self.scope == "stage" else [b.engine for b in stage.blocks]


class ModelDoor(LayersDoor):
    name = "graph_model"
    twice = TypeError  # ungraph_model on a model not graphed, as graph_model on one graphed

    def graph(self, model):
        from paddle_graphpp.torch import graph_model

        assert graph_model(model, num_warmup_steps=1) is model
        return model.__dict__["_graphpp_whole"]

    def undo(self, handle, model):
        from paddle_graphpp.torch import ungraph_model

        return ungraph_model(model)

    def engines(self, handle):
        return [handle.graphed.engine]


class OptimizerDoor(Door):
    """GraphedOptimizer(torch): the optimizer is switched to its capturable mode while wrapped."""

    name = "GraphedOptimizer-torch"

    def build(self):
        model = mlp()
        return types.SimpleNamespace(model=model, opt=torch.optim.AdamW(model.parameters(), lr=1e-3))

    def state(self, s):
        return {"model": torch_state(s.model), "groups": groups(s.opt)}

    def params(self, s):
        return list(s.model.parameters())

    def graph(self, s):
        import paddle_graphpp

        wrapped = paddle_graphpp.GraphedOptimizer(s.opt, clip_grad_norm=1.0)
        assert wrapped.graphed and isinstance(s.opt.param_groups[0]["lr"], torch.Tensor)  # changed in place
        return wrapped

    def step(self, wrapped, s):
        for i in range(3):
            s.model(features(i)).square().mean().backward()
            wrapped.step()
        assert graph_api._identity_slot(wrapped._sequence) in graph_api._cache()

    def undo(self, wrapped, s):
        got = wrapped.undo()
        assert graph_api._identity_slot(wrapped._sequence) not in graph_api._cache()  # its graph released
        return got

    def returns(self, s):
        return s.opt

    def compute(self, s):
        """One step of the optimizer from fixed parameters, gradients and an empty state."""
        params = self.params(s)
        start = values(params)
        torch.manual_seed(7)
        for p in params:
            p.grad = torch.randn_like(p)
        saved = copy.deepcopy(s.opt.state_dict())
        s.opt.load_state_dict({"state": {}, "param_groups": saved["param_groups"]})
        s.opt.step()
        out = values(params)
        with torch.no_grad():
            for p, v in zip(params, start):
                p.copy_(v)
                p.grad = None
        s.opt.load_state_dict(saved)
        return out

    def engines(self, wrapped):
        return []

    def fire(self, wrapped, engines):
        wrapped.step()


class StepDoor(OptimizerDoor):
    """graph_step: the optimizers are switched to their capturable mode (the fake runtime's steps
    stay in warmup: a capture needs CUDA's synchronize)."""

    name = "graph_step"
    captures = False

    def graph(self, s):
        from paddle_graphpp.torch import graph_step

        def train_step(x):
            s.model(x).square().mean().backward()
            s.opt.step()
            s.opt.zero_grad()

        self.fn = train_step
        step = graph_step(train_step, num_warmup_steps=100, optimizers=s.opt)
        assert isinstance(s.opt.param_groups[0]["lr"], torch.Tensor) and s.opt.param_groups[0]["capturable"]
        return step

    def step(self, step, s):
        for i in range(3):
            step(features(i))

    def undo(self, step, s):
        return step.undo()

    def returns(self, s):
        return self.fn

    def fire(self, step, engines):
        step(features(0))


# ------------------------------------------------------------------------------ Paddle doors
class PaddleDoor(Door):
    framework = "paddle"

    def state(self, model):
        return paddle_state(model)

    def compute(self, model):
        import paddle

        params = self.params(model)
        for p in params:
            p.clear_gradient(False)
        paddle.seed(7)
        loss = self.loss(model)
        loss.backward()
        out = [loss.numpy().copy()] + [p.grad.numpy().copy() for p in params if p.grad is not None]
        for p in params:
            p.clear_gradient(False)
        return out


def paddle_mlp():
    import paddle
    from paddle import nn

    paddle.seed(0)
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Dropout(0.1), nn.Linear(HIDDEN, 4))
    model[0].register_forward_post_hook(lambda m, i, o: None)
    return model


def paddle_features(seed: int):
    import paddle

    paddle.seed(1000 + seed)
    return paddle.randn([3, HIDDEN])


class GraphedLayerDoor(PaddleDoor):
    name = "CUDAGraphedLayer"

    def build(self):
        return paddle_mlp()

    def graph(self, model):
        from paddle_graphpp import CUDAGraphedLayer

        return CUDAGraphedLayer(model, num_warmup_steps=1)

    def step(self, handle, model):
        micro_batches(lambda i: handle(paddle_features(i)).square().mean())

    def undo(self, handle, model):
        return handle.undo()

    def returns(self, model):
        return model

    def loss(self, model):
        return model(paddle_features(99)).square().mean()

    def engines(self, handle):
        return [handle.engine]

    def fire(self, handle, engines):
        handle(paddle_features(0))


@functools.lru_cache(maxsize=None)
def block_class():
    """One class for every fleet model's blocks (models built graphed and eager compare by class)."""
    import paddle
    from paddle import nn

    class Block(nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(HIDDEN, HIDDEN)
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            return x + self.drop(paddle.tanh(self.fc(x)))

    return Block


def tied_head(embedding, hidden):
    import paddle

    return paddle.matmul(hidden, embedding.weight, transpose_y=True)


def fleet_model(vpp=None, cls=None, **kwargs):
    import paddle
    from paddle import nn
    from paddle.distributed.fleet.meta_parallel import LayerDesc, SharedLayerDesc
    from paddle.distributed.fleet.meta_parallel import PipelineLayer as FleetPipelineLayer

    layers = [SharedLayerDesc("embed", nn.Embedding, None, "weight", VOCAB, HIDDEN),
              *[LayerDesc(block_class()) for _ in range(4)],
              SharedLayerDesc("embed", nn.Embedding, tied_head, "weight", VOCAB, HIDDEN)]
    paddle.seed(5)
    return (cls or FleetPipelineLayer)(layers, num_stages=1, num_virtual_pipeline_stages=vpp, seg_method="layer:Block",
                                       loss_fn=cross_entropy, **kwargs)


def cross_entropy(logits, labels):
    import paddle

    return paddle.nn.functional.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1]))


def paddle_tokens(seed: int):
    import paddle

    paddle.seed(2000 + seed)
    return paddle.randint(0, VOCAB, [2, SEQ])


def fleet_forward(model, x):
    if model._num_virtual_pipeline_stages == 1:
        return model(x)
    for chunk_id in range(len(model._model_chunks)):
        x = model(x, chunk_id=chunk_id)
    return x


class PipelineDoor(PaddleDoor):
    """graph_pipeline on a fleet model (1F1B or interleaved chunks, the loss graphed or not)."""

    def __init__(self, vpp, graph_loss):
        self.vpp, self.graph_loss = vpp, graph_loss
        self.name = f"graph_pipeline-{'interleaved' if vpp else '1f1b'}{'-loss' if graph_loss else ''}"

    def build(self):
        return fleet_model(self.vpp)

    def graph(self, model):
        from paddle_graphpp import graph_pipeline

        return graph_pipeline(model, num_warmup_steps=1, graph_loss=self.graph_loss)

    def step(self, graphs, model):
        micro_batches(lambda i: self.loss(model, i))

    def undo(self, graphs, model):
        return graphs.undo()

    def returns(self, model):
        return model

    def loss(self, model, seed=99):
        x = paddle_tokens(seed)
        return model._loss_fn[0](fleet_forward(model, x), x)

    def engines(self, graphs):
        loss = [graphs.graphed_loss.graphed.engine] if graphs.graphed_loss is not None else []
        return [layer.engine for layer in graphs.graphed_layers()] + loss


class OursPipelineDoor(PipelineDoor):
    """paddle_graphpp.PipelineLayer(use_cudagraph=True): built graphed; compared with the same
    class built with use_cudagraph=False."""

    def __init__(self):
        super().__init__(None, False)
        self.name = "PipelineLayer"

    def build(self):
        import paddle_graphpp

        return fleet_model(cls=paddle_graphpp.PipelineLayer)

    def graph(self, model):
        import paddle_graphpp

        twin = fleet_model(cls=paddle_graphpp.PipelineLayer, use_cudagraph=True, num_warmup_steps=1)
        self.built = twin
        return paddle_graphpp.GraphedPipeline.of(twin)

    def step(self, graphs, model):
        micro_batches(lambda i: self.loss(self.built, i))

    def undo(self, graphs, model):
        got = graphs.undo()
        assert got is self.built
        # the model built graphed and undone is the model built eager
        mine, eager = paddle_state(got), paddle_state(model)
        assert [mine[k] for k in ("layers", "hooks", "keys")] == [eager[k] for k in ("layers", "hooks", "keys")]
        assert mine["fleet"][2:] == eager["fleet"][2:]  # _recompute_interval, use_cudagraph
        assert [type(f) for f in got.run_function] == [type(f) for f in model.run_function]
        assert all(equal(a, b) for a, b in zip(values(got.parameters()), values(model.parameters())))
        assert all(equal(a, b) for a, b in zip(self.compute(got), self.compute(model)))
        return model


class InstallDoor(OursPipelineDoor):
    """install(): fleet's own use_cudagraph flag builds our runs until its handle is undone."""

    def __init__(self):
        super().__init__()
        self.name = "install"

    def build(self):
        from paddle.distributed.fleet.meta_parallel import PipelineLayer as FleetPipelineLayer

        self.fleet_init = FleetPipelineLayer.__init__
        return fleet_model()

    def graph(self, model):
        import paddle_graphpp

        self.installed = paddle_graphpp.install(num_warmup_steps=1)
        self.built = fleet_model(use_cudagraph=True)
        return paddle_graphpp.GraphedPipeline.of(self.built)

    def undo(self, graphs, model):
        from paddle.distributed.fleet.meta_parallel import PipelineLayer as FleetPipelineLayer

        model = super().undo(graphs, model)
        assert self.installed.undo() is None
        assert FleetPipelineLayer.__init__ is self.fleet_init
        with pytest.raises(RuntimeError, match="not installed"):
            self.installed.undo()
        return model


class PaddleOptimizerDoor(PaddleDoor):
    name = "GraphedOptimizer-paddle"
    captures = False  # graph_process keeps its graph outside any engine

    def build(self):
        import paddle

        model = paddle_mlp()
        return types.SimpleNamespace(model=model, opt=paddle.optimizer.AdamW(1e-3, parameters=model.parameters()))

    def state(self, s):
        return {"model": paddle_state(s.model), "lr": (type(s.opt._learning_rate), s.opt._learning_rate)}

    def params(self, s):
        return list(s.model.parameters())

    def graph(self, s):
        import paddle_graphpp

        wrapped = paddle_graphpp.GraphedOptimizer(s.opt, clip_grad_norm=1.0)
        assert wrapped.graphed
        return wrapped

    def step(self, wrapped, s):
        for i in range(3):
            s.model(paddle_features(i)).square().mean().backward()
            wrapped.step()
        assert graph_api._identity_slot(wrapped._sequence) in graph_api._cache()

    def undo(self, wrapped, s):
        got = wrapped.undo()
        assert graph_api._identity_slot(wrapped._sequence) not in graph_api._cache()
        return got

    def returns(self, s):
        return s.opt

    def loss(self, s):
        return s.model(paddle_features(99)).square().mean()

    def engines(self, wrapped):
        return []

    def fire(self, wrapped, engines):
        wrapped.step()


TORCH_DOORS = [GraphedModuleDoor(), StageDoor(), LossDoor(), LayersDoor(), UngraphLayersDoor(), StageCutDoor("blocks"),
               StageCutDoor("stage"), ModelDoor(), OptimizerDoor(), StepDoor()]
PADDLE_DOORS = [GraphedLayerDoor(), PipelineDoor(None, False), PipelineDoor(None, True), PipelineDoor(2, False),
                OursPipelineDoor(), InstallDoor(), PaddleOptimizerDoor()]
HF_DOORS = (LayersDoor, StageCutDoor, ModelDoor)


@pytest.fixture
def door_env(request, monkeypatch):
    """What a door's framework needs: transformers for the Hugging Face doors; for Paddle, fleet
    built in one process (as unittests/test_paddle_graph_pipeline.py does), and fleet's own
    PipelineLayer constructor back afterwards."""
    door = request.param
    if isinstance(door, HF_DOORS):
        pytest.importorskip("transformers")
    if door.framework == "paddle":
        pytest.importorskip("paddle")
        from paddle.distributed import fleet
        from paddle.distributed.parallel import ParallelEnv

        from paddle_graphpp.paddle import upstream

        if not hasattr(ParallelEnv, "_device_id"):
            monkeypatch.setattr(ParallelEnv, "_device_id", 0, raising=False)
        monkeypatch.setattr(fleet.fleet, "_user_defined_strategy", fleet.DistributedStrategy(), raising=False)
        monkeypatch.setattr(fleet, "get_hybrid_communicate_group",
                            lambda: types.SimpleNamespace(get_pipe_parallel_world_size=lambda: 1))
        yield door
        upstream.uninstall()
        return
    yield door


DOORS = pytest.mark.parametrize("door_env", TORCH_DOORS + PADDLE_DOORS, indirect=True,
                                ids=[d.name for d in TORCH_DOORS + PADDLE_DOORS])


@DOORS
def test_undo_restores_the_model_releases_the_graphs_and_graphs_again(door_env, request, capturable_on_cpu):
    door = door_env
    subject = door.build()
    want = door.compute(subject)  # before graphing (and the attributes a first call sets exist now)
    before, start = door.state(subject), values(door.params(subject))
    request.getfixturevalue("fake")  # after the framework's import: its fake runtime is served
    for round in range(2):  # graphed, undone, graphed again, undone again
        handle = door.graph(subject)
        door.step(handle, subject)
        engines = door.engines(handle)
        if door.captures:
            assert all(e.graph_count() > 0 for e in engines), f"round {round}: no graphs to release"
        got = door.undo(handle, subject)
        assert got is door.returns(subject)
        assert all(e.graph_count() == 0 and e.retired is not None for e in engines)
        assert door.state(subject) == before, f"round {round}: graphing left something changed"
        params = door.params(subject)
        if isinstance(door, (OptimizerDoor, PaddleOptimizerDoor)):  # it trained: back to the same values
            for p, v in zip(params, start):
                p.set_value(v) if hasattr(p, "set_value") else p.data.copy_(v)
        assert all(equal(a, b) for a, b in zip(values(params), start)), f"round {round}: parameter values changed"
        again = door.compute(subject)
        assert len(again) == len(want) and all(equal(a, b) for a, b in zip(again, want)), f"round {round}"
        with pytest.raises(RuntimeError, match="undone|undo"):
            door.fire(handle, engines)
        if door.lenient:
            door.undo(handle, subject)
            assert door.state(subject) == before
            continue
        with pytest.raises(door.twice, match="undo|not installed|not graphed"):
            door.undo(handle, subject)


# ------------------------------------------------------------------------------ misuse
def test_undo_with_a_micro_batch_in_flight_names_the_layer_and_changes_nothing(fake):
    from paddle_graphpp.torch import CUDAGraphedModule, graph_stage_module

    model = mlp()
    graphed = CUDAGraphedModule(model, num_warmup_steps=1, name="block7")
    out = graphed(features(0)).sum()
    with pytest.raises(GraphScheduleError, match=r"block7: undo\(\) with 1 micro-batch\(es\) in flight.*backwards"):
        graphed.undo()
    out.backward()
    assert graphed.undo() is model

    stage = graph_stage_module(torch.nn.Sequential(mlp(), torch.nn.Tanh()), num_warmup_steps=1)
    out = stage(features(0)).sum()
    with pytest.raises(GraphScheduleError, match=r"stage\[0:2\]: undo\(\) with 1 micro"):
        stage.undo()
    assert all(m.engine.retired is None for m in stage.graphed_modules)  # nothing undone
    out.backward()
    stage.undo()


def test_graph_layers_undo_in_flight_or_twice_changes_nothing(fake):
    pytest.importorskip("transformers")
    from paddle_graphpp.torch import graph_layers, ungraph_layers
    from paddle_graphpp.torch.layers import is_graphed_layer

    model = llama()
    blocks = graph_layers(model.model.layers, num_warmup_steps=1)
    x = tokens(0)
    loss = model(x, labels=x).loss
    with pytest.raises(GraphScheduleError, match=r"LlamaDecoderLayer\[0\]: undo\(\) with 1 micro"):
        blocks.undo()
    assert all(is_graphed_layer(b) and b.engine.retired is None for b in blocks)
    loss.backward()
    blocks.undo()
    with pytest.raises(RuntimeError, match=r"block 0 \(LlamaDecoderLayer\) is not graphed \(undone already"):
        blocks.undo()
    assert ungraph_layers(model.model.layers) == list(blocks)  # lenient: nothing graphed, nothing done


def test_ungraph_model_puts_back_a_forward_set_on_the_instance(fake):
    pytest.importorskip("transformers")
    from paddle_graphpp.torch import graph_model, ungraph_model

    model = llama()
    own = model.forward

    def hooked(*args, **kwargs):  # what accelerate's hooks leave on an instance
        return own(*args, **kwargs)

    model.forward = hooked
    graph_model(model)
    assert model.forward is not hooked
    ungraph_model(model)
    assert model.__dict__["forward"] is hooked
    with pytest.raises(TypeError, match="not graphed by graph_model"):
        ungraph_model(model)


def test_graph_loss_of_a_function_gives_the_function_back(fake):
    from paddle_graphpp.torch import graph_loss

    fn = torch.nn.functional.mse_loss
    assert graph_loss(fn).undo() is fn


def test_graph_step_undo_puts_the_optimizers_lr_back_as_the_schedule_left_it(fake, capturable_on_cpu):
    from paddle_graphpp.torch import graph_step

    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 0.5 ** n)

    def train_step(x):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step = graph_step(train_step, num_warmup_steps=100, optimizers=opt)
    step(features(0))
    sched.step()  # fills the lr tensor in place: 5e-4 in fp32
    step.undo()
    lr = opt.param_groups[0]["lr"]
    assert type(lr) is float and lr == torch.tensor(5e-4, dtype=torch.float32).item()
    assert "capturable" in opt.param_groups[0] and opt.param_groups[0]["capturable"] is False


def test_install_handle_and_uninstall_agree():
    pytest.importorskip("paddle")
    import paddle_graphpp
    from paddle.distributed.fleet.meta_parallel import PipelineLayer as FleetPipelineLayer

    original = FleetPipelineLayer.__init__
    handle = paddle_graphpp.install()
    paddle_graphpp.uninstall()
    assert FleetPipelineLayer.__init__ is original
    with pytest.raises(RuntimeError, match=r"install\(...\).undo\(\): not installed.*uninstall\(\) was called"):
        handle.undo()
    paddle_graphpp.install().undo()
    assert FleetPipelineLayer.__init__ is original
