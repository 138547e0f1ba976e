"""paddle_graphpp.torch.pipeline: stage segmentation, and torch.distributed.pipelining on gloo ranks.

On CPU the graphed runs compute eagerly, so the distributed cases check the wiring (losses
identical with and without graph_stage_module under Schedule1F1B and ScheduleInterleaved1F1B),
and, with the fake graph runtime, that each schedule's forward/backward order pairs up in every
graphed run's FIFO. Capture and replay numbers are checked on GPUs (tools/bench_pipeline.py).
"""
import warnings

import pytest
import torch
from torch import nn

import paddle_graphpp
from paddle_graphpp.torch.graphed import CUDAGraphedModule
from paddle_graphpp.torch.pipeline import GraphedStage, graph_stage_module
from pipeline_ranks import assert_captured_once_and_replayed, run_pipeline_ranks


@pytest.fixture(autouse=True)
def _quiet_cpu_fallback():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA graphs are not used.*")
        yield


def mlp():
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh())


def double(x):
    return x * 2


class Pair(nn.Module):
    """Returns two tensors; the next entry takes them as two arguments."""

    def forward(self, x):
        return x, x + 1


class Join(nn.Module):
    def forward(self, a, b):
        return a * b


def test_runs_split_around_shared_callables_and_opt_outs():
    torch.manual_seed(0)
    embed, head = nn.Linear(8, 8), nn.Linear(8, 8)
    marked = paddle_graphpp.mark_not_capturable(mlp())
    entries = [embed, mlp(), mlp(), double, mlp(), marked, mlp(), mlp(), head]
    stage = graph_stage_module(entries, shared=[embed, head])
    assert isinstance(stage, GraphedStage)
    assert [(r.graphed, r.start, r.stop) for r in stage.runs] == [
        (False, 0, 1), (True, 1, 3), (False, 3, 4), (True, 4, 5), (False, 5, 6), (True, 6, 8), (False, 8, 9)]
    assert len(stage.graphed_modules) == 3
    assert all(isinstance(m, CUDAGraphedModule) for m in stage.graphed_modules)
    assert stage.steps[0] is embed and stage.steps[4] is marked and stage.steps[6] is head  # one step per run
    report = stage.describe()
    assert "double: plain callable" in report and "shared weights" in report and "mark_not_capturable" in report


def test_forward_and_gradients_match_the_original_stage():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 8), mlp(), mlp(), nn.Linear(8, 8))
    stage = graph_stage_module(seq, shared=[seq[0]])
    # Same parameter objects, not copies: one optimizer serves both views.
    assert {id(p) for p in stage.parameters()} == {id(p) for p in seq.parameters()}
    x = torch.randn(4, 8, requires_grad=True)
    ref = seq(x)
    ref.sum().backward()
    ref_grads = [p.grad.clone() for p in seq.parameters()] + [x.grad.clone()]
    seq.zero_grad()
    x.grad = None
    out = stage(x)
    out.sum().backward()
    assert torch.equal(out, ref)
    for got, want in zip([p.grad for p in seq.parameters()] + [x.grad], ref_grads):
        assert torch.equal(got, want)


def test_tuple_outputs_are_unpacked_into_the_next_entry():
    stage = graph_stage_module([nn.Linear(8, 8), Pair(), Join(), double])
    x = torch.randn(2, 8)
    lin = stage.runs[0].entries[0].obj
    y = lin(x)
    assert torch.equal(stage(x), y * (y + 1) * 2)
    assert [r.graphed for r in stage.runs] == [True, False]  # Linear, Pair, Join graphed together


def test_weight_tied_inside_one_stage_is_kept_eager():
    a, b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
    b.weight = a.weight
    stage = graph_stage_module([a, mlp(), b])
    assert [r.graphed for r in stage.runs] == [False, True, False]


def test_marked_sublayer_keeps_its_entry_eager():
    block = mlp()
    paddle_graphpp.mark_not_capturable(block[1], reason="host sync")
    stage = graph_stage_module([mlp(), block, mlp()])
    assert [r.graphed for r in stage.runs] == [True, False, True]
    assert "host sync" in stage.describe()


def test_bad_stages_are_rejected_with_the_fix():
    with pytest.raises(TypeError, match="nn.Sequential"):
        graph_stage_module(nn.Linear(8, 8))
    with pytest.raises(ValueError, match="empty"):
        graph_stage_module(nn.Sequential())
    with pytest.raises(ValueError, match="not part of this stage"):
        graph_stage_module([mlp()], shared=[nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="already graphed"):
        graph_stage_module(graph_stage_module([mlp()]))
    with pytest.raises(TypeError, match="already a CUDAGraphedModule"):
        graph_stage_module([CUDAGraphedModule(mlp())])
    with pytest.raises(TypeError, match="neither a module nor a callable"):
        graph_stage_module([mlp(), 3])


# ------------------------------------------------------------------------- distributed
run_ranks = run_pipeline_ranks


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("vpp", [1, 2], ids=["Schedule1F1B", "ScheduleInterleaved1F1B"])
def test_graphed_stages_train_like_plain_stages(vpp, tmp_path):
    results = run_ranks(["--vpp", str(vpp), "--steps", "5"], tmp_path)
    last = results[1]
    eager, graphed = last["eager"]["losses"], last["graphed"]["losses"]
    assert len(eager) == 5 and all(v == v for v in eager)
    assert graphed == eager
    for rank, data in results.items():
        for chunk, report in data["graphed"]["segmentation"].items():
            assert "scale: plain callable" in report and "Probe: marked with mark_not_capturable" in report


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("vpp,memory", [(1, "shared"), (2, "shared")],
                         ids=["Schedule1F1B", "ScheduleInterleaved1F1B"])
def test_schedules_pair_forwards_and_backwards_in_every_graphed_run(vpp, memory, tmp_path):
    # Fake runtime: capture and replay are bookkeeping only (values after a replay are stale).
    results = run_ranks(["--vpp", str(vpp), "--steps", "5", "--runtime", "fake", "--memory", memory], tmp_path)
    # Interleaved pp=2 x vpp=2: a chunk's FIFO empties mid-step (F F B B F F B B) while the other
    # chunk still has micro-batches in flight; one shared pool must still see one capture order.
    for rank, data in results.items():
        assert len(data["graphed"]["graphed_runs"]) == 2 * vpp
    assert_captured_once_and_replayed({r: d["graphed"]["graphed_runs"] for r, d in results.items()}, [5])


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("vpp", [1, 2], ids=["Schedule1F1B", "ScheduleInterleaved1F1B"])
def test_shorter_sequences_are_captured_anew_beside_the_first_graphs(vpp, tmp_path):
    # Fake runtime: bookkeeping only. New stages and schedule around the same graphed modules
    # from step 3 on: every graphed run captures a second signature and keeps the first.
    results = run_ranks(["--vpp", str(vpp), "--steps", "6", "--runtime", "fake", "--shorten-at", "3"], tmp_path)
    assert_captured_once_and_replayed({r: d["graphed"]["graphed_runs"] for r, d in results.items()}, [3, 3])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_capture_that_fails_on_one_rank_leaves_that_run_eager_and_training_goes_on(tmp_path):
    # Fake runtime: rank 1's last run holds a layer that fails while captured; with
    # fallback="eager" that run stays eager (no graphs, no replays), every other run on both ranks
    # replays, and all steps complete.
    results = run_ranks(["--steps", "6", "--runtime", "fake", "--fail-capture-rank", "1"], tmp_path)
    failed = [run for run in results[1]["graphed"]["graphed_runs"] if run["captures"] == 0]
    assert len(failed) == 1 and failed[0]["replays"] == 0 and failed[0]["graphs"] == 0
    others = {0: results[0]["graphed"]["graphed_runs"],
              1: [r for r in results[1]["graphed"]["graphed_runs"] if r["captures"] > 0]}
    assert [len(rs) for rs in others.values()] == [2, 1]
    assert_captured_once_and_replayed(others, [6], dropped=True)
    assert len(results[1]["graphed"]["losses"]) == 6
    assert "FailsInCapture" in results[1]["graphed"]["segmentation"]["1"]


def test_graph_loss_computes_the_loss_and_its_gradient_and_rejects_bad_input():
    from paddle_graphpp.torch import graph_loss
    from paddle_graphpp.torch.pipeline import GraphedLoss

    def mse(out, target, weight=1.0):
        return (out - target).square().mean() * weight

    loss_fn = graph_loss(mse, 1)
    assert isinstance(loss_fn, GraphedLoss) and isinstance(loss_fn.graphed, CUDAGraphedModule)
    assert loss_fn.engine.name == "loss"
    for _ in range(3):  # eager on CPU: warmup, recorded, eager
        out = torch.randn(4, 8, requires_grad=True)
        target = torch.randn(4, 8)
        got = loss_fn(out, target, weight=0.5)  # keyword arguments reach the loss
        got.backward()
        ref_out = out.detach().clone().requires_grad_()
        mse(ref_out, target, weight=0.5).backward()
        assert torch.equal(got.detach(), mse(out.detach(), target, 0.5)) and torch.equal(out.grad, ref_out.grad)
    assert loss_fn.engine.in_flight == 0
    module_loss = graph_loss(nn.MSELoss(), name="mse")
    assert isinstance(module_loss.graphed.module, nn.MSELoss) and module_loss.engine.name == "mse"
    with pytest.raises(TypeError, match="needs the loss function"):
        graph_loss(3)
    with pytest.raises(TypeError, match="graphed already"):
        graph_loss(loss_fn)
    with pytest.raises(TypeError, match=r"Linear has trainable parameters \['weight', 'bias'\].*Keep this loss eager"):
        graph_loss(nn.Linear(2, 1))


def test_graph_loss_compiles_the_loss_and_refuses_bad_compile_options():
    """``compile=`` compiles the loss (here aot_eager: dynamo and AOTAutograd with eager kernels,
    so the values match bit for bit; on CPU the graphed layer runs it eagerly); a setting that
    would record Inductor's own CUDA graphs is refused naming the loss."""
    import torch._dynamo

    from paddle_graphpp.torch import graph_loss

    def xent(logits, labels):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    torch._dynamo.reset()
    loss_fn = graph_loss(xent, 1, compile={"backend": "aot_eager"})
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(3):
        logits = torch.randn(2, 5, 11, requires_grad=True)
        labels = torch.randint(0, 11, (2, 5))
        got = loss_fn(logits, labels)
        got.backward()
        ref = logits.detach().clone().requires_grad_()
        want = xent(ref, labels)
        want.backward()
        assert torch.equal(got.detach(), want.detach()) and torch.equal(logits.grad, ref.grad)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > compiled  # dynamo compiled the loss
    with pytest.raises(ValueError, match=r"loss.*reduce-overhead"):
        graph_loss(xent, compile={"mode": "reduce-overhead"})
    with pytest.raises(TypeError, match="loss"):
        graph_loss(xent, compile="inductor")
    with pytest.raises(ValueError, match=r"graph_loss\(loss\).*reduce-overhead"):
        graph_loss(torch.compile(xent, mode="reduce-overhead"))  # compiled by the user, with Inductor's graphs
    with pytest.raises(ValueError, match="compiled already"):
        graph_loss(torch.compile(xent), compile=True)
    graph_loss(torch.compile(xent, backend="aot_eager"))  # compiled by the user: graphed as it is


def test_each_micro_batch_gets_its_own_graphed_loss_tensor():
    # On the last stage every micro-batch is an episode of its own and replays the same loss
    # graph: the losses a schedule collects must not all be that graph's one output buffer.
    from fake_runtime import FakeGraphRuntime, serving
    from paddle_graphpp.torch import graph_loss

    with serving(FakeGraphRuntime()):
        loss_fn = graph_loss(lambda out, target: (out - target).square().mean(), 1)
        for step in range(4):
            losses = []
            for _ in range(3):  # forward and backward of each micro-batch before the next (last stage, 1F1B)
                loss = loss_fn(torch.randn(4, 8, requires_grad=True), torch.randn(4, 8))
                losses.append(loss)
                loss.backward()
            assert len({t.data_ptr() for t in losses}) == 3, f"step {step}: the losses share storage"
        assert loss_fn.engine.replays > 0
