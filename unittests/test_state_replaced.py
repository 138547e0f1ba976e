"""Replaced parameters and buffers are refused at replay (fake graph runtime over CPU tensors).

The fake runtime's replays compute nothing, so these tests check which calls are refused and
which replay; unittests/gpu/test_faults_gpu.py checks the numbers on a GPU.
"""
import pytest
import torch

import paddle_graphpp
from fake_runtime import FakeGraphRuntime, Graphed
from paddle_graphpp.core.engine import Phase
from paddle_graphpp.core.errors import GraphScheduleError, StateReplacedError
from paddle_graphpp.core.process import current_process
from paddle_graphpp.core.state import StateWatch


class Scaled(torch.nn.Module):
    """A linear layer and a buffer the forward reads."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        return self.fc(x) * self.scale


def step(model, n=2):
    """One step of ``n`` micro-batches (all forwards, then all backwards)."""
    outs = [model(torch.randn(3, 4, requires_grad=True)) for _ in range(n)]
    for o in outs:
        o.sum().backward()


def captured(rt):
    """Two graphed layers in a chain, warmed up, recorded, captured and replayed once."""
    model = torch.nn.Sequential(Graphed(Scaled(), rt, num_warmup_steps=1),
                                Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=1))
    for _ in range(3):
        step(model)
    assert all(m.engine.phase() is Phase.READY and m.engine.replays == 4 for m in model)
    return model


def replacements():
    def assign_data(model):
        model[0].module.fc.weight.data = torch.randn(4, 4)

    def dtype_round_trip(model):
        model.to(torch.float64).to(torch.float32)

    def new_parameter(model):
        model[0].module.fc.weight = torch.nn.Parameter(model[0].module.fc.weight.detach().clone())

    def new_buffer(model):
        model[0].module.scale = torch.full((4,), 3.0)

    def load_assigning(model):  # load_state_dict(assign=True) rebinds instead of copying
        fresh = Scaled()
        model[0].module.load_state_dict(fresh.state_dict(), assign=True)

    return [
        (assign_data, r"parameter 'fc\.weight' was given new storage"),
        (load_assigning, r"buffer 'scale' was replaced by another object"),
        # Module.to rebinds buffers and gives parameters new storage; the buffer comes first.
        (dtype_round_trip, r"buffer 'scale' was replaced by another object"),
        (new_parameter, r"parameter 'fc\.weight' was replaced by another object"),
        (new_buffer, r"buffer 'scale' was replaced by another object"),
    ]


@pytest.mark.parametrize("replace, what", replacements(), ids=lambda v: getattr(v, "__name__", ""))
def test_replaced_parameter_or_buffer_is_refused_at_replay(rt, replace, what):
    model = captured(rt)
    replace(model)
    before = model[0].engine.replays
    with pytest.raises(StateReplacedError, match=r"test:Scaled: " + what + r".*load_state_dict.*reset_graphs"):
        step(model)
    assert model[0].engine.replays == before  # nothing replayed into the old memory
    # The refused call left no micro-batch in flight: the layer can be reset right away.
    assert model[0].engine.in_flight == 0 and model[0].engine.process.clock.in_flight == 0
    with pytest.raises(StateReplacedError):  # and it keeps refusing, never replays stale
        step(model)


def test_a_parameter_replaced_between_warmup_and_capture_is_refused_at_capture(rt):
    module = Scaled()
    layer = Graphed(module, rt, num_warmup_steps=1)
    for _ in range(2):  # warmup (the parameters are fixed as it ends), recorded
        step(layer)
    module.fc.weight = torch.nn.Parameter(module.fc.weight.detach().clone())
    with pytest.raises(StateReplacedError, match=r"test:Scaled: 1 of the parameters it was warmed up with "
                                                 r"\(parameter 0\).*replaced after warmup.*reset_graphs"):
        step(layer)
    assert layer.engine.graph_count() == 0 and layer.engine.in_flight == 0
    assert paddle_graphpp.reset_graphs(layer) == 1
    for _ in range(3):  # captured anew against the new parameter, then replayed
        step(layer)
    assert layer.engine.replays > 0


def test_load_state_dict_copies_in_place_and_replays_go_on(rt):
    model = captured(rt)
    fresh = torch.nn.Sequential(Scaled(), torch.nn.Linear(4, 4))
    model.load_state_dict(_graphed_keys(fresh.state_dict()))
    torch.testing.assert_close(model[0].module.fc.weight, fresh[0].fc.weight, rtol=0, atol=0)
    step(model)
    assert [m.engine.replays for m in model] == [8, 8]


def _graphed_keys(state):
    """Keys of a plain Sequential(Scaled, Linear) as the graphed one names them."""
    return {f"{k.split('.', 1)[0]}.module.{k.split('.', 1)[1]}": v for k, v in state.items()}


def test_reset_graphs_captures_anew_against_the_new_tensors(rt):
    model = captured(rt)
    model.to(torch.float64).to(torch.float32)
    with pytest.raises(StateReplacedError):
        step(model)
    assert paddle_graphpp.reset_graphs(model) == 2
    assert all(m.engine.graph_count() == 0 for m in model)
    captures = [m.engine.captures for m in model]
    # Warmup runs eagerly with the new weights: the outputs are the plain modules' outputs.
    x = torch.randn(3, 4, requires_grad=True)
    y = model(x)
    ref = model[1].module(model[0].module(x))
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    y.sum().backward()
    for _ in range(3):  # warmup done, record, capture
        step(model)
    assert [m.engine.captures - c for m, c in zip(model, captures)] == [4, 4]
    assert all(m.engine.phase() is Phase.READY for m in model)
    watch = model[0].engine.signatures()[next(iter(model[0].engine.signatures()))].positions[0].state
    assert watch.changed() is None
    # Chained layers are linked again in the new capture: layer 1 replays, not eagerly.
    replays = model[1].engine.replays
    step(model)
    assert model[1].engine.replays == replays + 4  # forward and backward of 2 micro-batches


def test_reset_graphs_finds_blocks_graphed_in_place():
    from paddle_graphpp.torch import CUDAGraphedModule, graph_layers

    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), CUDAGraphedModule(torch.nn.Linear(4, 4)))
    model.add_module("blocks", blocks)
    graph_layers(blocks)  # in place: the blocks' engines are not submodules
    assert paddle_graphpp.reset_graphs(model) == 4


def test_reset_refuses_while_in_flight(rt):
    model = captured(rt)
    y = model(torch.randn(3, 4, requires_grad=True))
    with pytest.raises(GraphScheduleError, match="in flight.*Nothing was reset"):
        paddle_graphpp.reset_graphs(model)
    assert all(m.engine.graph_count() == 4 for m in model)
    y.sum().backward()


def test_reset_while_a_recording_waits_for_capture(rt):
    model = torch.nn.Sequential(Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0))
    step(model)  # recorded, to be captured at the next step's start
    paddle_graphpp.reset_graphs(model)
    step(model)  # nothing of the reset layer is captured: it records again
    assert model[0].engine.captures == 0 and model[0].engine.phase() is Phase.RECORD
    step(model)
    assert model[0].engine.captures == 4 and model[0].engine.replays == 4


def test_state_watch_costs_a_fraction_of_a_microsecond_per_tensor():
    from paddle_graphpp.torch.runtime import RUNTIME

    module = torch.nn.TransformerEncoderLayer(64, 4)
    watch = StateWatch(RUNTIME, RUNTIME.state_slots(module))
    assert len(watch) == 12
    import timeit

    n = 2000
    per_tensor = min(timeit.repeat(watch.changed, number=n, repeat=5)) / n / len(watch)
    assert per_tensor < 2e-6, per_tensor  # measured ~0.1 us; generous for loaded CI machines


def test_paddle_runtime_names_replaced_parameters():
    paddle = pytest.importorskip("paddle")
    from paddle_graphpp.paddle.runtime import RUNTIME

    layer = paddle.nn.Sequential(paddle.nn.Linear(2, 2))
    watch = StateWatch(RUNTIME, RUNTIME.state_slots(layer))
    assert watch.changed() is None
    with paddle.no_grad():
        layer[0].weight.set_value(paddle.ones([2, 2]))  # in place
    assert watch.changed() is None
    layer.to(dtype="float64")
    assert "parameter '0.weight' was given new storage" in watch.changed()


# --------------------------------------------------------------------- GraphedOptimizer
@pytest.fixture
def graphed_torch():
    """A fake graph runtime registered as "torch": GraphedOptimizer is "graphed" on CPU (its
    capture runs the step eagerly, its replay only counts; values are not checked here)."""
    from paddle_graphpp import graph_api as gp
    from paddle_graphpp.core import runtime as runtime_mod

    rt = FakeGraphRuntime()
    runtime_mod.register_runtime("torch", lambda: rt)
    gp.clear_graph_cache()
    try:
        yield gp
    finally:
        gp.clear_graph_cache()
        runtime_mod.unregister_runtime("torch")


def _graphed_opt(optimizer, **kwargs):
    gopt = paddle_graphpp.GraphedOptimizer(optimizer, **kwargs)
    assert gopt.graphed
    for group in gopt.param_groups:
        group["capturable"] = False  # torch refuses capturable steps of CPU tensors
    return gopt


def _opt_step(model, gopt):
    model(torch.randn(3, 4)).square().mean().backward()
    gopt.step()
    gopt.zero_grad()


def _graph_of(gp):
    (entry,) = gp._cache().values()
    return entry.graph


def test_optimizer_state_loaded_behind_the_wrapper_is_refused(graphed_torch):
    model = torch.nn.Linear(4, 4)
    gopt = _graphed_opt(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for _ in range(3):
        _opt_step(model, gopt)
    graph = _graph_of(graphed_torch)
    assert graph.replays == 2
    saved = gopt.state_dict()
    gopt.optimizer.load_state_dict(saved)  # the wrapped optimizer: new state tensors
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(StateReplacedError, match=r"GraphedOptimizer\(AdamW\): the optimizer's state \(optimizer\.state\) "
                                                 r"was replaced.*GraphedOptimizer\.load_state_dict"):
        gopt.step()
    assert graph.replays == 2
    gopt.load_state_dict(saved)  # through the wrapper: re-captured, then replayed
    for group in gopt.param_groups:
        group["capturable"] = False
    gopt.step()
    gopt.zero_grad()
    _opt_step(model, gopt)
    new = _graph_of(graphed_torch)
    assert new is not graph and new.replays == 1


def test_optimizer_state_tensor_replaced_is_refused_and_in_place_copies_pass(graphed_torch):
    model = torch.nn.Linear(4, 4)
    gopt = _graphed_opt(torch.optim.Adam(model.parameters(), lr=1e-2))
    for _ in range(2):
        _opt_step(model, gopt)
    state = gopt.optimizer.state[model.bias]
    with torch.no_grad():
        state["exp_avg"].copy_(torch.ones(4))  # in place: fine
    _opt_step(model, gopt)
    state["exp_avg_sq"] = torch.zeros(4)
    with pytest.raises(StateReplacedError, match=r"optimizer state 'exp_avg_sq' of parameter 1 was replaced"):
        _opt_step(model, gopt)


def test_parameter_storage_change_re_captures_the_optimizer_step(graphed_torch):
    model = torch.nn.Linear(4, 4)
    gopt = _graphed_opt(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for _ in range(2):
        _opt_step(model, gopt)
    graph = _graph_of(graphed_torch)
    model.weight.data = model.weight.detach().clone()  # an argument of the captured step: re-captured
    _opt_step(model, gopt)
    assert _graph_of(graphed_torch) is not graph


def test_master_weights_model_parameter_replaced_is_refused(graphed_torch):
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    from paddle_graphpp.torch.optim import MasterWeights

    mw = MasterWeights(model.parameters())
    gopt = _graphed_opt(torch.optim.AdamW(mw.master, lr=1e-2), master_weights=mw)

    def run():
        model(torch.randn(3, 4, dtype=torch.bfloat16)).float().square().mean().backward()
        gopt.step()
        gopt.zero_grad()

    for _ in range(2):
        run()
    model.weight.data = model.weight.detach().clone()
    with pytest.raises(StateReplacedError, match=r"model parameter 0 of master_weights was given new storage.*"
                                                 r"build a new MasterWeights"):
        run()


def test_zero_grad_after_a_skipped_step_zeroes_what_backward_graphs_wrote(graphed_torch):
    # A step skipped after backward (an overflow, a nan check) leaves gradients that backward
    # graphs added in-graph: a replay writes .grad without bumping its version counter, so
    # zero_grad must not take the gradients for clean.
    from paddle_graphpp.core.runtime import get_runtime

    rt = get_runtime("torch")  # the fake runtime: its replays write nothing; .data writes stand in
    current_process().reset(rt.name)
    lin = torch.nn.Linear(4, 4)
    layer = Graphed(lin, rt, num_warmup_steps=0)
    gopt = _graphed_opt(torch.optim.AdamW(lin.parameters(), lr=1e-2))
    for _ in range(3):  # recorded, captured and replayed, replayed
        layer(torch.randn(3, 4, requires_grad=True)).sum().backward()
        gopt.step()
        gopt.zero_grad()
    assert layer.engine.replays == 4 and all(torch.count_nonzero(p.grad) == 0 for p in lin.parameters())
    for p in lin.parameters():
        p.grad.data.fill_(1.0)  # written as a graph writes: no version bump
    gopt.zero_grad()
    assert all(torch.count_nonzero(p.grad) > 0 for p in lin.parameters()), "nothing wrote them: skipped"
    layer(torch.randn(3, 4, requires_grad=True)).sum().backward()  # a backward replay (step skipped)
    gopt.zero_grad()
    assert all(torch.count_nonzero(p.grad) == 0 for p in lin.parameters())
    current_process().reset(rt.name)
