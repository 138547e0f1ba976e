"""Zero-bubble schedules on real GPUs: a graphed layer's backward as input and weight graphs.

One GPU: the GPT stack of testing/parity.py (dropout 0.1, two differentiable outputs)
runs micro-batches the way a zero-bubble stage does, through torch.distributed.pipelining's
own input and weight passes (``stage_backward_input`` / ``stage_backward_weight``), eagerly
and graphed side by side; losses, input gradients, parameter gradients and AdamW weights
agree to 1e-6 (fp32, TF32 off), and memory stays flat over many replays.
Two GPUs: the pipeline test worker trains graphed and plain stages under each zero-bubble
schedule this torch has (NCCL), and compares per-step losses and every parameter gradient.

Run on the GPU machine: ``python -m pytest unittests/gpu/test_zero_bubble_gpu.py -q``.
Skipped without CUDA; the two-GPU tests skip unless two GPUs are visible.
"""
import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires a CUDA device")

import torch.distributed.pipelining as pipelining  # noqa: E402

from paddle_graphpp.torch import CUDAGraphedModule  # noqa: E402
from testing.parity import SEQ, TOLERANCE, Scale, Stack, rel, run_order, twins  # noqa: E402
from unittests.pipeline_ranks import graphed_against_eager, run_pipeline_ranks  # noqa: E402

DEV = "cuda"
ZB_SCHEDULES = [name for name, cls in [("interleaved_zb", "ScheduleInterleavedZeroBubble"),
                                       ("zbv", "ScheduleZBVZeroBubble"),
                                       ("dualpipev", "ScheduleDualPipeV")] if hasattr(pipelining, cls)]

# Forwards fN, input passes iN, weight passes wN, one full backward bN: micro-batches 1, 2 and 4
# split (their weight passes pending together, run out of input order), 3 whole.
ZB_ORDER = "f1 f2 f3 i1 f4 i2 w1 b3 i4 w4 w2"


@pytest.fixture(autouse=True)
def _fp32_exact(fp32_exact):  # unittests/gpu/conftest.py
    yield


def zb_step(model, xs, seed):
    """Run ZB_ORDER over the micro-batches ``xs``; returns the losses and the input gradients.
    ``seed``: reseed first, so the eager and the graphed model draw the same dropout masks."""
    if seed is not None:
        torch.manual_seed(seed)
    losses = run_order(model, xs, ZB_ORDER, lambda out: out[0].square().mean() + out[1].sin().mean())
    return torch.stack([losses[n] for n in range(len(xs))]), [x.grad.clone() for x in xs]


@pytest.mark.parametrize("accumulate_grads", [False, True])
def test_split_backward_graphs_match_eager_with_dropout(accumulate_grads):
    eager, graphed, opt_e, opt_g = twins(device=DEV, accumulate_grads=accumulate_grads)
    steps = 12
    for step in range(steps):
        base = [torch.randn(2, SEQ, 64, device=DEV) for _ in range(4)]
        le, ge = zb_step(eager, [b.clone().requires_grad_(True) for b in base], seed=1000 + step)
        lg, gg = zb_step(graphed, [b.clone().requires_grad_(True) for b in base], seed=1000 + step)
        errs = [rel(lg, le)] + [rel(g, e) for g, e in zip(gg, ge)]
        errs += [rel(q.grad, p.grad) for p, q in zip(eager.parameters(), graphed.module.parameters())]
        assert max(errs) <= TOLERANCE, f"step {step}: max relative error {max(errs):.3e}"
        assert graphed.engine.in_flight == 0
        opt_e.step(); opt_g.step()
        opt_e.zero_grad(); opt_g.zero_grad()
    for p, q in zip(eager.parameters(), graphed.module.parameters()):
        assert rel(q, p) <= TOLERANCE
    assert graphed.engine.position_kinds() == {"full": 1, "split": 3}
    per_step = 3 * 3 + 2  # forward, input and weight graphs of 3 split positions; a pair for the whole one
    assert graphed.engine.captures == per_step
    assert graphed.engine.replays == per_step * (steps - 2)  # step 0 warms up, step 1 records


def test_split_graphs_with_a_graphed_loss_match_eager_with_dropout():
    """The loss graphed too: its input gradients are the stack's incoming gradients (linked,
    not copied), given back to the pool once the stack's weight half of that micro-batch is
    captured (the weight half reads them, saved at its junctions). Values as eager's."""
    from paddle_graphpp.torch import graph_loss

    def plain(h, extra):
        return h.square().mean() + extra.sin().mean()

    eager, graphed, opt_e, opt_g = twins(device=DEV)
    loss_g = graph_loss(plain, 2)
    steps = 10
    for step in range(steps):
        base = [torch.randn(2, SEQ, 64, device=DEV) for _ in range(4)]
        got = {}
        runs = (("eager", eager, lambda out: plain(*out)), ("graphed", graphed, lambda out: loss_g(*out)))
        for name, model, loss in runs:
            xs = [b.clone().requires_grad_(True) for b in base]
            torch.manual_seed(1000 + step)
            losses = run_order(model, xs, ZB_ORDER, loss)
            got[name] = (torch.stack([losses[n] for n in range(len(xs))]), [x.grad.clone() for x in xs])
        (le, ge), (lg, gg) = got["eager"], got["graphed"]
        errs = [rel(lg, le)] + [rel(g, e) for g, e in zip(gg, ge)]
        errs += [rel(q.grad, p.grad) for p, q in zip(eager.parameters(), graphed.module.parameters())]
        assert max(errs) <= TOLERANCE, f"step {step}: max relative error {max(errs):.3e}"
        opt_e.step(); opt_g.step()
        opt_e.zero_grad(); opt_g.zero_grad()
    assert graphed.engine.position_kinds() == {"full": 1, "split": 3}
    assert loss_g.engine.captures == 2 * 4 and loss_g.engine.replays == 2 * 4 * (steps - 2)


def test_dropout_masks_differ_between_replays_of_a_split_position():
    torch.manual_seed(0)
    graphed = CUDAGraphedModule(Stack().to(DEV), num_warmup_steps=1)
    grads = []
    for step in range(6):
        base = [torch.ones(2, SEQ, 64, device=DEV) for _ in range(4)]
        _, input_grads = zb_step(graphed, [b.clone().requires_grad_(True) for b in base], seed=None)
        grads.append(input_grads[0])
        graphed.zero_grad()
    assert graphed.engine.position_kinds()["split"] == 3
    assert not torch.equal(grads[-1], grads[-2])  # same input, fresh masks: a different gradient


def test_weight_graphs_share_the_pool_and_memory_stays_flat():
    torch.manual_seed(0)
    graphed = CUDAGraphedModule(Stack().to(DEV), num_warmup_steps=1)
    opt = torch.optim.AdamW(graphed.parameters(), lr=1e-4)
    base = [torch.randn(2, SEQ, 64, device=DEV) for _ in range(4)]

    def one(step):
        zb_step(graphed, [b.clone().requires_grad_(True) for b in base], seed=step)
        opt.step()
        opt.zero_grad()

    from paddle_graphpp import memory_report

    for step in range(5):  # warmup, recorded, captured + replayed, replayed, replayed
        one(step)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    generations = memory_report()["torch"]["pool_generations"]
    for step in range(5, 205):
        one(step)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.memory_reserved() == reserved
    assert memory_report()["torch"]["pool_generations"] == generations  # no capture after the first
    assert graphed.engine.captures == 11 and graphed.engine.replays == 11 * 203


# ------------------------------------------------------------------------------- two GPUs
@pytest.mark.two_gpus
@pytest.mark.parametrize("schedule, micro_batches",
                         [(s, 8) for s in ZB_SCHEDULES] + ([("zbv", 4)] if "zbv" in ZB_SCHEDULES else []))
def test_zero_bubble_schedules_on_two_gpus_match_eager_with_dropout(schedule, micro_batches, tmp_path):
    """Every schedule at 8 micro-batches, and zbv at 4 as well (as few as it takes: the first
    rank's chunks run back to back); each run is a 2-process job, which the suite on two GPUs
    pays for in time."""
    steps = 6
    results = run_pipeline_ranks(["--device", "cuda", "--schedule", schedule, "--steps", str(steps),
                                  "--micro-batches", str(micro_batches)], tmp_path, timeout=240)
    eager, graphed, worst_grad = graphed_against_eager(results)
    assert eager.shape == (steps, micro_batches)
    assert rel(graphed, eager) <= TOLERANCE, (graphed, eager)
    assert worst_grad[0] <= TOLERANCE, worst_grad
    split = 0
    for rank, data in results.items():
        for run in data["graphed"]["graphed_runs"]:
            assert run["captures"] > 0 and run["replays"] > 0 and run["in_flight"] == 0, (rank, run)
            split += run["positions"]["split"]
    assert split > 0


def test_weight_pass_after_the_input_pass_dropped_the_outputs():
    """As torch.distributed.pipelining's stage does it: the input pass detaches the stage's
    outputs and nothing else keeps them, so only the nodes its weight pass restarts at hold the
    graph (a one-output block here: the graphed node is that restart point). Gradients as eager's."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from testing.gpt_torch import Block, GPTShape

    torch.manual_seed(0)
    block = Block(GPTShape(hidden=64, heads=4, vocab=8, seq_len=SEQ, layers=1, dropout=0.0)).to(DEV)
    graphed = CUDAGraphedModule(copy.deepcopy(block), num_warmup_steps=1)
    for step in range(5):  # warmup, recorded, captured and replayed, replayed
        xs = [torch.randn(2, SEQ, 64, device=DEV) for _ in range(3)]
        for model in (block, graphed):
            model.zero_grad(set_to_none=True)
            pending = []
            for x in xs:
                x = x.clone().requires_grad_(True)
                loss = model(x).square().mean()
                _, groups = stage_backward_input([loss], None, [x], model.parameters())
                del loss  # detached by the input pass; the node survives through the engine only
                pending.append(groups)
            for groups in pending:
                stage_backward_weight(model.parameters(), groups)
        for p, q in zip(block.parameters(), graphed.module.parameters()):
            assert rel(q.grad, p.grad) <= TOLERANCE, f"step {step}"
    assert graphed.engine.position_kinds()["split"] >= 1 and graphed.engine.in_flight == 0


# ---------------------------------------- outputs that give their memory back, on a GPU
class ScaledLinear(torch.nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.w = torch.nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x):
        return Scale.apply(torch.tanh(self.lin(x)), self.w)  # a custom-function junction


def _zb_dropping(a, b, xs, hold=None, split=True):
    """Forwards of every micro-batch through ``b(a(x))``, then per micro-batch the pipelining
    input pass, after which its output is dropped (kept only for ``hold``), then the weight
    passes. Returns the losses and the kept output. ``split=False``: a whole backward per
    micro-batch instead (the eager reference: torch 2.11's ``stage_backward_weight`` cannot
    restart autograd at a custom function's node, it reads the node's ``_input_metadata``)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    params = [*a.parameters(), *b.parameters()]
    ys = [b(a(x)) for x in xs]
    losses, passes, kept = [], [], None
    for p, x in enumerate(xs):
        loss = ys[p].square().mean()
        losses.append(loss.detach())
        if split:
            passes.append(stage_backward_input([loss], None, [x], params)[1])
        else:
            loss.backward()
        if p == hold:
            kept = ys[p]
        ys[p] = loss = None
    for groups in passes:
        stage_backward_weight(params, groups)
    return torch.stack(losses), kept


def test_outputs_the_step_frees_give_their_memory_back_and_stay_exact():
    """Two chained graphed layers with a custom-function junction, under a zero-bubble order
    that drops each output after its input pass: the captured outputs give their memory back
    where the step freed them (b's, after its input pass), losses and every gradient stay
    eager's, and an output held past that point in a later step keeps its values (moved to
    memory of its own before the graphs that reuse its memory run). Written 2026-11-26 after a
    review; not yet run on a GPU."""
    torch.manual_seed(0)
    eager = [ScaledLinear().to(DEV), ScaledLinear().to(DEV)]
    graphed = [CUDAGraphedModule(copy.deepcopy(m), num_warmup_steps=1) for m in eager]
    for step in range(6):
        xs = [torch.randn(2, SEQ, 64, device=DEV) for _ in range(4)]
        hold = 1 if step == 5 else None
        le, ke = _zb_dropping(*eager, [x.clone().requires_grad_(True) for x in xs], hold, split=False)
        gx = [x.clone().requires_grad_(True) for x in xs]
        lg, kg = _zb_dropping(*graphed, gx, hold)
        assert rel(lg, le) <= TOLERANCE, step
        for p, q in zip([*eager[0].parameters(), *eager[1].parameters()],
                        [*graphed[0].parameters(), *graphed[1].parameters()]):
            assert rel(q.grad, p.grad) <= TOLERANCE, step
            p.grad = q.grad = None
        if hold is not None:
            assert rel(kg, ke) <= TOLERANCE  # the held output kept its micro-batch's values
    proc = graphed[1].engine.process
    released = {link.position for links in proc.outputs.checks.values() for link in links
                if link.layer == id(graphed[1].engine.capture)}  # links name the layer's capture participant
    assert len(released) >= 3  # b's outputs of (at least) the first three micro-batches went back
    assert graphed[0].engine.replays and graphed[1].engine.replays
