"""Zero-bubble schedules: a graphed layer's backward in two halves (input, then weight).

PyTorch's zero-bubble schedules run each stage's backward as an input pass
(``stage_backward_input``: ``torch.autograd.grad`` w.r.t. the stage inputs) and, later, a
weight pass (``stage_backward_weight``: autograd restarted where the weights' paths join).
Here, on CPU: the eager split matches the plain module under those very functions; the fake
graph runtime shows the split positions captured as three graphs and replayed in order;
and, on two gloo ranks, graphed stages train exactly like plain stages under every zero-bubble
schedule this torch has. Values replayed from real graphs are checked on GPUs
(unittests/gpu/test_zero_bubble_gpu.py).
"""
import copy
import json
import os
import re
import sys
import warnings

import pytest
import torch
import torch.distributed.pipelining as pipelining
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from paddle_graphpp.core.errors import GraphScheduleError
from paddle_graphpp.torch import CUDAGraphedModule
from pipeline_ranks import run_pipeline_ranks
from testing import launch
from testing.parity import Scale, run_order
from fake_runtime import Graphed

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

ZB_SCHEDULES = [name for name, cls in [("interleaved_zb", "ScheduleInterleavedZeroBubble"),
                                       ("zbv", "ScheduleZBVZeroBubble"),
                                       ("dualpipev", "ScheduleDualPipeV")] if hasattr(pipelining, cls)]


@pytest.fixture(autouse=True)
def _quiet_cpu_fallback():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA graphs are not used.*")
        yield


class Block(torch.nn.Module):
    """Two matmuls, a norm, a residual, a second output that depends on a weight only, and a
    parameter the forward never uses."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)
        self.shift = torch.nn.Parameter(torch.randn(8))
        self.unused = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        h = self.down(torch.relu(self.up(self.norm(x)))) + x
        return h * 2 + self.shift, self.shift.square().sum()


def zero_bubble_step(module, xs, order):
    """Run micro-batches through ``module`` as a zero-bubble stage does (``f<n>`` forward,
    ``i<n>`` input pass, ``w<n>`` weight pass, ``b<n>`` full backward; ``n`` from 0). Returns
    the inputs' gradients."""
    run_order(module, xs, order, lambda out: out[0].square().sum() + out[1], first=0)
    return [x.grad for x in xs]


ZB_ORDER = "f0 f1 i0 f2 w0 i1 i2 w2 w1"  # several weight passes pending, the last two out of order


def test_split_backward_matches_the_plain_module_exactly():
    torch.manual_seed(0)
    plain = Block()
    graphed = CUDAGraphedModule(copy.deepcopy(plain), num_warmup_steps=1)
    for step in range(3):
        inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + i)) for i in range(3)]
        got = {}
        for name, module in (("plain", plain), ("graphed", graphed)):
            xs = [x.clone().requires_grad_(True) for x in inputs]
            got[name] = zero_bubble_step(module, xs, ZB_ORDER)
        for a, b in zip(got["plain"], got["graphed"]):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        for (name, p), q in zip(plain.named_parameters(), graphed.module.parameters()):
            if name == "unused":  # the weight pass asks for it: a zero gradient where eager has none
                assert p.grad is None and torch.count_nonzero(q.grad) == 0
            else:
                torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
        assert graphed.engine.in_flight == 0
        if step == 1:
            plain.zero_grad()
            graphed.zero_grad()


def test_a_torch_that_sums_output_gradients_in_the_weight_pass_gets_one(monkeypatch):
    # Torch up to 2.11 sums the gradients a multi-output node received (as the input pass's
    # pre-hooks saw them) before its weight pass, which fails for outputs of different shapes
    # (pytorch/pytorch#170277; measured on the H200's torch 2.11 with this test's GPU twin).
    # There, a graphed layer shows those hooks only its first output's gradient and keeps the
    # rest for itself: the input pass saves one gradient per node, results stay exact. The sum
    # of that one gradient (0 + g) would copy it, for nothing (the layer's weight half reads its
    # own saved state): the hooks see it as a tensor that adding zero leaves as it is.
    from paddle_graphpp.core.process import current_process
    from paddle_graphpp.torch.autograd import WeightPassFacts

    monkeypatch.setattr(current_process().section("torch").part(WeightPassFacts), "sums_output_grads", True)
    torch.manual_seed(0)
    plain = Block()
    graphed = CUDAGraphedModule(copy.deepcopy(plain), num_warmup_steps=1)
    saved, sums = [], 0
    for step in range(3):
        inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + i)) for i in range(3)]
        got = {}
        for name, module in (("plain", plain), ("graphed", graphed)):
            xs = [x.clone().requires_grad_(True) for x in inputs]
            outs = [module(x) for x in xs]
            for n, (h, extra) in enumerate(outs):
                _, groups = stage_backward_input([h.square().sum() + extra], None, [xs[n]], module.parameters())
                if name == "graphed":
                    saved += [sum(g is not None for g in grads) for group in groups for grads in group["grads"]]
                    # what torch 2.11's weight pass does with each saved tuple: the sum is the
                    # one saved tensor itself, no copy
                    for group in groups:
                        for grads in group["grads"]:
                            alone = [g for g in grads if g is not None]
                            if len(alone) == 1:
                                assert sum(alone) is alone[0]
                                sums += 1
                stage_backward_weight(module.parameters(), groups)
            got[name] = [x.grad for x in xs]
        for a, b in zip(got["plain"], got["graphed"]):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        for (name, p), q in zip(plain.named_parameters(), graphed.module.parameters()):
            if name != "unused":
                torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
    assert graphed.engine.in_flight == 0
    assert saved and max(saved) == 1 and sums == len(saved)


class HalfUsed(torch.nn.Module):
    """Two outputs; the stage's loss below reads the first only."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return h, h.square().sum()


@pytest.mark.parametrize("module_cls", [HalfUsed, torch.nn.Linear])
def test_the_weight_pass_alias_takes_effect_in_input_passes_only(monkeypatch, module_cls):
    # On a torch whose weight pass sums saved gradients (2.11), the input pass saves an alias
    # whose sum with zero is itself, for a single-output layer too (the head, the point of it);
    # the node itself gets what autograd gave it, zeros where an output got no gradient (the
    # hook sees the gradients before autograd fills those in). A whole backward is left alone.
    import paddle_graphpp.torch.autograd as torch_runtime
    from paddle_graphpp.core.process import current_process
    from paddle_graphpp.torch.autograd import WeightPassFacts

    monkeypatch.setattr(current_process().section("torch").part(WeightPassFacts), "sums_output_grads", True)
    torch.manual_seed(0)
    plain = HalfUsed() if module_cls is HalfUsed else torch.nn.Linear(8, 8)
    graphed = CUDAGraphedModule(copy.deepcopy(plain), num_warmup_steps=1)
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
    for step in range(3):  # warmup, recorded, captured (eager on the CPU)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        got = {}
        for name, module in (("plain", plain), ("graphed", graphed)):
            xi = x.clone().requires_grad_(True)
            _, groups = stage_backward_input([first(module(xi)).square().sum()], None, [xi], module.parameters())
            if name == "graphed":
                saved = [g for group in groups for grads in group["grads"] for g in grads if g is not None]
                assert saved and all(isinstance(g, torch_runtime._SumsToItself) for g in saved)
            stage_backward_weight(module.parameters(), groups)
            got[name] = xi.grad
        torch.testing.assert_close(got["graphed"], got["plain"], rtol=0, atol=0)
    seen = []
    out = first(graphed(torch.randn(4, 8, requires_grad=True)))
    out.grad_fn.register_prehook(lambda grads: seen.extend(grads))
    out.square().sum().backward()
    assert seen and not any(isinstance(g, torch_runtime._SumsToItself) for g in seen if g is not None)
    assert graphed.engine.in_flight == 0


def test_a_full_backward_still_runs_in_one_piece():
    # Schedules that merge an input pass with the weight pass right after it, and plain
    # loss.backward(), ask for every gradient at once: no weight pass follows.
    torch.manual_seed(0)
    plain = Block()
    graphed = CUDAGraphedModule(copy.deepcopy(plain), num_warmup_steps=1)
    inputs = [torch.randn(4, 8) for _ in range(2)]
    for module in (plain, graphed):
        zero_bubble_step(module, [x.clone().requires_grad_(True) for x in inputs], "f0 f1 b0 i1 w1")
    for p, q in zip(plain.parameters(), graphed.module.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
    assert graphed.engine.in_flight == 0


# ----------------------------------------------------------------- fake graph runtime


def fake_step(layer, order):
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]
    return zero_bubble_step(layer, xs, order)


def test_split_positions_are_captured_as_three_graphs_and_replayed_in_order(rt):
    layer = Graphed(Block(), rt, num_warmup_steps=1)
    order = "f0 f1 i0 f2 w0 i1 b2 w1"  # positions 0 and 1 split, position 2 full
    fake_step(layer, order)  # warmup
    fake_step(layer, order)  # recorded
    assert layer.engine.captures == 0
    fake_step(layer, order)  # captured at its start, then replayed
    assert layer.engine.position_kinds() == {"full": 1, "split": 2}
    assert layer.engine.graph_count() == 3 + 3 + 2
    assert layer.engine.captures == 8 and layer.engine.replays == 8
    for _ in range(2):
        fake_step(layer, order)
    assert layer.engine.captures == 8 and layer.engine.replays == 24
    assert layer.engine.in_flight == 0


def test_a_micro_batch_stays_in_flight_until_its_weight_pass(rt):
    layer = Graphed(Block(), rt, num_warmup_steps=0)
    x = torch.randn(4, 8, requires_grad=True)
    h, extra = layer(x)
    _, groups = stage_backward_input([h.sum() + extra], None, [x], layer.parameters())
    assert layer.engine.in_flight == 1  # its input pass ran; its weight pass has not
    stage_backward_weight(layer.parameters(), groups)
    assert layer.engine.in_flight == 0


def test_a_position_captured_whole_refuses_an_input_only_backward(rt):
    layer = Graphed(Block(), rt, num_warmup_steps=1)
    for _ in range(3):
        fake_step(layer, "f0 f1 b0 b1")
    assert layer.engine.position_kinds() == {"full": 2, "split": 0}
    x = torch.randn(4, 8, requires_grad=True)
    h, extra = layer(x)
    with pytest.raises(RuntimeError) as raised:  # stage_backward_input chains what it caught
        stage_backward_input([h.sum() + extra], None, [x], layer.parameters())
    cause = raised.value.__cause__
    assert isinstance(cause, GraphScheduleError)
    assert re.search(r"test:Block: micro-batch position 0 was captured with a full backward.*input gradients "
                     r"only.*same schedule every step", str(cause))
    # refused before the FIFO was touched: the micro-batch is still in flight, and a full
    # backward, as it was captured, completes it
    assert layer.engine.in_flight == 1
    (h.sum() + extra).backward()
    assert layer.engine.in_flight == 0
    fake_step(layer, "f0 f1 b0 b1")


def test_a_failed_input_half_leaves_nothing_waiting_for_its_weight_half(rt, monkeypatch):
    layer = Graphed(Block(), rt, num_warmup_steps=0)
    x = torch.randn(4, 8, requires_grad=True)
    h, extra = layer(x)

    def broken(*args, **kwargs):
        raise ValueError("input half failed")

    monkeypatch.setattr(rt, "backward_input", broken)
    with pytest.raises(RuntimeError) as raised:
        stage_backward_input([h.sum() + extra], None, [x], layer.parameters())
    assert "input half failed" in str(raised.value.__cause__)
    assert layer.engine.in_flight == 0  # its backward is over: nothing waits for a weight pass
    monkeypatch.undo()
    for _ in range(3):  # the layer and the process's episode clock go on
        fake_step(layer, "f0 i0 f1 w0 i1 w1")
    assert layer.engine.in_flight == 0 and layer.engine.replays > 0


def test_weight_graphs_accumulate_into_grad_without_a_second_set_of_buffers(rt):
    # accumulate_grads="auto": the weight graph adds into the layer's gradient buffers, which
    # the weight pass leaves as .grad; no weight-gradient buffers of its own exist
    layer = Graphed(Block(), rt, num_warmup_steps=1)
    for _ in range(4):
        layer.zero_grad(set_to_none=True)
        fake_step(layer, ZB_ORDER)
    engine = layer.engine
    assert engine.position_kinds() == {"full": 0, "split": 3} and engine.replays > 0
    assert engine.weight_grad_buffers is None
    params = list(layer.module.parameters())
    assert all(p.grad is b for p, b in zip(params, engine.param_grad_buffers))
    # accumulate_grads=False: the weight half writes buffers of its own, .grad is autograd's
    plain = Graphed(Block(), rt, num_warmup_steps=1, accumulate_grads=False)
    for _ in range(4):
        plain.zero_grad(set_to_none=True)
        fake_step(plain, ZB_ORDER)
    own = plain.engine.weight_grad_buffers
    assert own is not None and plain.engine.param_grad_buffers is None
    assert not any(p.grad is b for p, b in zip(plain.module.parameters(), own))


def test_the_recorded_step_accumulates_the_weight_pass_into_grad_as_eager(rt):
    # The step recorded before capture runs eagerly; with accumulation its weight passes add
    # each group of gradients into .grad as they come (as the graphs will) and hand the sums
    # over: the gradients are the plain module's, accumulated over micro-batches and steps.
    torch.manual_seed(0)
    plain = Block()
    layer = Graphed(copy.deepcopy(plain), rt, num_warmup_steps=1)
    for step in range(2):  # warmup, then the recorded step (nothing zeroed: two steps' sums)
        writes = layer.engine.process.grad_writes
        inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + i)) for i in range(3)]
        for module in (plain, layer):
            zero_bubble_step(module, [x.clone().requires_grad_(True) for x in inputs], ZB_ORDER)
    assert layer.engine.process.grad_writes == writes + 3  # the recorded step's three weight passes went into .grad
    assert layer.engine.captures == 0 and layer.engine.position_kinds() == {"full": 0, "split": 0}
    assert next(iter(layer.engine.signatures().values())).accumulate
    for (name, p), q in zip(plain.named_parameters(), layer.module.parameters()):
        if name == "unused":
            assert p.grad is None and torch.count_nonzero(q.grad) == 0
        else:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-6)


def weight_pass_by_hand(layer, groups, params):
    """A weight pass of one's own: autograd asked for ``params``' gradients at the junctions
    the pipelining input pass saved, the results returned (not put into ``.grad``)."""
    from torch.autograd.graph import GradientEdge

    edges, grads = [], []
    for group in groups:
        for got, node in zip(group["grads"], group["intermediates"]):
            edges += [GradientEdge(node, k) for k, g in enumerate(got) if g is not None]
            grads += [g for g in got if g is not None]
    accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]
    return torch.autograd.grad(edges, [GradientEdge(a, 0) for a in accumulators], grads)


def test_the_pipelining_weight_pass_gets_the_sums_and_puts_them_back_into_grad(rt):
    layer = Graphed(Block(), rt, num_warmup_steps=1)
    for _ in range(3):
        fake_step(layer, "f0 i0 w0")
    params, buffers = list(layer.module.parameters()), layer.engine.param_grad_buffers
    handed = []
    original = rt.weight_pass_refills_grad
    rt.weight_pass_refills_grad = lambda: handed.append([p.grad for p in params]) or original()
    fake_step(layer, "f0 i0 w0")
    assert handed  # asked inside stage_backward_weight, where the answer is yes
    assert all(p.grad is b for p, b in zip(params, buffers))  # assigned back: the layer's own buffers


def test_a_weight_pass_of_ones_own_is_refused_before_anything_changes(rt):
    # Per-micro-batch parameter gradients do not exist when the graphs accumulate into .grad:
    # a weight pass other than torch.distributed.pipelining's is refused, naming the layer and
    # the option; the micro-batch still awaits its weight pass, which pipelining's then runs.
    layer = Graphed(Block(), rt, num_warmup_steps=1)
    for _ in range(3):
        fake_step(layer, "f0 i0 w0")
    params = list(layer.module.parameters())
    before = [p.grad.clone() for p in params]
    x = torch.randn(4, 8, requires_grad=True)
    h, extra = layer(x)
    _, groups = stage_backward_input([h.sum() + extra], None, [x], layer.parameters())
    with pytest.raises(GraphScheduleError, match=r"test:Block: adds its parameter gradients into \.grad.*"
                                                 r"accumulate_grads=False"):
        weight_pass_by_hand(layer, groups, params)
    assert layer.engine.in_flight == 1
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
    stage_backward_weight(layer.parameters(), groups)
    assert layer.engine.in_flight == 0
    # accumulate_grads=False: per-micro-batch gradients exist, any weight pass gets them
    plain = Graphed(Block(), rt, num_warmup_steps=1, accumulate_grads=False)
    for _ in range(3):
        fake_step(plain, "f0 i0 w0")
    x = torch.randn(4, 8, requires_grad=True)
    h, extra = plain(x)
    _, groups = stage_backward_input([h.sum() + extra], None, [x], plain.parameters())
    got = weight_pass_by_hand(plain, groups, list(plain.module.parameters()))
    assert all(g is not None for g in got) and plain.engine.in_flight == 0


# ------------------------------------------------------------------- two gloo ranks
run_ranks = run_pipeline_ranks


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("micro_batches", [4, 8])
@pytest.mark.parametrize("schedule", ZB_SCHEDULES)
def test_graphed_stages_train_like_plain_stages_under_zero_bubble(schedule, micro_batches, tmp_path):
    results = run_ranks(["--schedule", schedule, "--steps", "4", "--micro-batches", str(micro_batches)], tmp_path)
    with_losses = [r for r in results.values() if r["eager"]["losses"]]
    assert len(with_losses) == 1  # the rank holding the last stage
    eager, graphed = with_losses[0]["eager"]["losses"], with_losses[0]["graphed"]["losses"]
    assert len(eager) == 4 and all(len(step) == micro_batches for step in eager)
    assert graphed == eager  # per step, per micro-batch, bit for bit
    for data in results.values():
        assert len(data["graphed"]["grads"]) == 4
        for step_eager, step_graphed in zip(data["eager"]["grads"], data["graphed"]["grads"]):
            assert step_graphed.keys() == step_eager.keys()
            for name, want in step_eager.items():
                assert want is not None, name
                assert step_graphed[name] == want, (schedule, name)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("schedule", ZB_SCHEDULES)
def test_zero_bubble_schedules_capture_split_positions_in_every_graphed_run(schedule, tmp_path):
    # Fake runtime: capture and replay are bookkeeping only (values after a replay are stale).
    results = run_ranks(["--schedule", schedule, "--steps", "5", "--runtime", "fake"], tmp_path)
    split = 0
    for rank, data in results.items():
        for run in data["graphed"]["graphed_runs"]:
            assert run["captures"] > 0 and run["replays"] > 0, (rank, run)
            assert run["in_flight"] == 0, (rank, run)
            kinds = run["positions"]
            assert kinds["full"] + kinds["split"] == 4, (rank, run)  # one position per micro-batch
            assert run["graphs"] == 2 * kinds["full"] + 3 * kinds["split"]
            split += kinds["split"]
    assert split > 0  # the first stage backs up whole (it has no input gradient); the others split


# ------------------------------------------------------------------- the benchmark's tools
def test_busy_share_merges_overlapping_kernels():
    from tools.diagnostics.busy import busy_share

    # kernels at [0, 2) and [1, 3) overlap (3 us busy), [5, 6) adds 1; the span is 6 us
    assert busy_share([(0, 2), (1, 3), (5, 6)]) == round(4 / 6, 4)
    assert busy_share([(0, 4), (1, 2)]) == 1.0
    assert busy_share([]) is None


def test_kernels_are_sorted_into_kinds_by_name():
    from tools.diagnostics.busy import kind_of, time_by_kind

    assert kind_of("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>") == "attention"
    assert kind_of("fmha_cutlassB_bf16_aligned_64x64_k128_sm80") == "attention"  # CUTLASS, but attention
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kind_of("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert kind_of("triton_tem_fused_mm_0") == "gemm"  # Inductor's matmul template
    assert kind_of("triton_poi_fused__to_copy_add_mul_0") == "triton"
    assert kind_of("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == (
        "optimizer")
    assert kind_of("void at::native::multi_tensor_apply_kernel<at::native::ZeroFunctor<float>>") == "other"
    assert kind_of("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "communication"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<c10::BFloat16>>") == "other"
    # durations summed per kind, largest first
    out = time_by_kind([(0, 5, "gemm_a"), (5, 7, "triton_poi_x"), (7, 13, "gemm_b"), (13, 14, "add")])
    assert out == {"gemm": 11, "triton": 2, "other": 1} and list(out) == ["gemm", "triton", "other"]


def test_idle_gaps_group_by_neighbours_and_say_when_a_peer_was_awaited():
    from tools.diagnostics.busy import idle_gaps

    kernels = [(0, 10, "gemm"), (5, 12, "softmax"), (112, 120, "gemm"), (150, 160, "gemm"), (165, 170, "add")]
    out = idle_gaps(kernels, comm=[(100, 130)], min_us=20)
    assert out["idle_us"] == 100 + 30 + 5 and out["gaps_us"] == 130 and out["span_us"] == 170
    first, second = out["groups"]
    # 12..112 after softmax (it ended last), 12 us of it with a communication kernel running
    assert (first["after"], first["before"], first["count"], first["total_us"]) == ("softmax", "gemm", 1, 100)
    assert first["comm_share"] == 0.12
    assert (second["after"], second["before"], second["total_us"], second["comm_share"]) == ("gemm", "gemm", 30, 0.333)
    assert idle_gaps([])["groups"] == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_benchmark_smoke_runs_every_schedule_eager_and_graphed():
    end = launch.run([sys.executable, os.path.join(REPO, "tools", "bench_zero_bubble.py"), "--smoke"],
                     cwd=REPO, timeout=540)
    assert end.returncode == 0, end.stdout[-3000:] + end.stderr[-3000:]
    summary = json.loads(end.stdout[end.stdout.index("{\n"):])
    assert summary["all_ok"] is True  # graphed losses equal eager's under each schedule
    assert set(summary["graphed_zb_vs_eager_zb"]["seq64_mb4"]) == set(ZB_SCHEDULES)


def _setting(seq, graphed_1f1b, graphed_zb, eager_zb, agree=True):
    pair = lambda e, g: {"eager": {"tokens_per_s": e}, "graphed": {"tokens_per_s": g},  # noqa: E731
                         "losses_agree": agree, "graphed_vs_eager": g / e}
    return {"seq_len": seq, "micro_batches": 4,
            "schedules": {"1f1b": pair(graphed_1f1b, graphed_1f1b), "zbv": pair(eager_zb, graphed_zb)}}


def test_benchmark_parts_merge_into_one_summary(tmp_path, monkeypatch):
    """Settings run as separate commands (one per GPU pair) join into one record whose summary
    is computed over all of them; parts of a different configuration are refused."""
    from tools import bench_zero_bubble, benchlib

    monkeypatch.setattr(benchlib, "RESULTS", tmp_path / "results")
    monkeypatch.delenv("OUT", raising=False)
    common = {"device": "NVIDIA H100 80GB HBM3", "shape": ["--hidden", "2048"], "steps": 12, "torch": "2.11.0"}
    paths = []
    for seq, setting in ((2048, _setting(2048, 100.0, 115.0, 110.0)), (512, _setting(512, 50.0, 70.0, 50.0))):
        path = tmp_path / f"part{seq}.json"
        path.write_text(json.dumps({**common, "command": f"python bench --seq {seq}", "settings": [setting],
                                    "runs": [{"command": f"run {seq}"}]}))
        paths.append(str(path))
    monkeypatch.setattr(sys, "argv", ["bench_zero_bubble.py", "--merge", *paths, "--name", "zb"])
    assert bench_zero_bubble.main() == 0
    merged = json.loads((tmp_path / "results" / "zb-h100.json").read_text())
    assert merged["parts"] == ["python bench --seq 2048", "python bench --seq 512"]
    assert merged["summary"]["best_graphed_zb_vs_graphed_1f1b"] == 1.15
    assert merged["summary"]["graphed_zb_vs_eager_zb"] == {"seq2048_mb4": {"zbv": 115.0 / 110.0},
                                                           "seq512_mb4": {"zbv": 1.4}}
    assert merged["summary"]["meets_target"] == {"best_graphed_zb_vs_graphed_1f1b": True,
                                                 "graphed_zb_vs_eager_zb": True, "memory_graphed_vs_eager": None}
    assert len(merged["runs"]) == 2

    other = tmp_path / "other.json"
    other.write_text(json.dumps({**common, "steps": 8, "command": "x", "settings": [], "runs": []}))
    monkeypatch.setattr(sys, "argv", ["bench_zero_bubble.py", "--merge", paths[0], str(other)])
    assert bench_zero_bubble.main() == 2


def test_merge_fills_a_schedule_a_part_ran_out_of_budget_for(tmp_path, monkeypatch):
    """A part that ran out of budget before a schedule's graphed run leaves it half done; a second
    part that ran that schedule alone (with its own 1F1B) fills it in, both runs from that part.
    Memory: graphed over eager peak per schedule, against the 1.05 bound."""
    from tools import bench_zero_bubble, benchlib

    monkeypatch.setattr(benchlib, "RESULTS", tmp_path / "results")
    monkeypatch.delenv("OUT", raising=False)
    run = lambda tps, mib: {"tokens_per_s": tps, "peak_mem_mib": mib}  # noqa: E731
    pair = lambda e, g: {"eager": e, "graphed": g, "losses_agree": bool(g["tokens_per_s"]),  # noqa: E731
                         "graphed_vs_eager": g["tokens_per_s"] / e["tokens_per_s"] if g["tokens_per_s"] else None}
    first = {"seq_len": 512, "micro_batches": 8, "schedules": {
        "1f1b": pair(run(20.0, 100.0), run(40.0, 100.0)), "zbv": pair(run(10.0, 100.0), run(40.0, 104.0)),
        "dualpipev": pair(run(25.0, 100.0), run(None, None))}}
    again = {"seq_len": 512, "micro_batches": 8, "schedules": {
        "1f1b": pair(run(21.0, 100.0), run(41.0, 100.0)), "dualpipev": pair(run(26.0, 100.0), run(48.0, 106.0))}}
    common = {"device": "NVIDIA H100 80GB HBM3", "shape": [], "steps": 12, "torch": "2.11.0", "runs": []}
    paths = []
    for i, setting in enumerate((first, again)):
        path = tmp_path / f"part{i}.json"
        path.write_text(json.dumps({**common, "command": f"part {i}", "settings": [setting]}))
        paths.append(str(path))
    monkeypatch.setattr(sys, "argv", ["bench_zero_bubble.py", "--merge", *paths, "--name", "zb"])
    assert bench_zero_bubble.main() == 0  # every pair complete after the join
    merged = json.loads((tmp_path / "results" / "zb-h100.json").read_text())
    assert len(merged["settings"]) == 1
    assert merged["settings"][0]["schedules"]["1f1b"]["graphed"]["tokens_per_s"] == 40.0  # the first part's
    summary = merged["summary"]
    assert summary["graphed_zb_vs_eager_zb"]["seq512_mb8"] == {"zbv": 4.0, "dualpipev": 48.0 / 26.0}
    assert summary["memory_graphed_vs_eager"]["seq512_mb8"] == {"1f1b": 1.0, "zbv": 1.04, "dualpipev": 1.06}
    assert summary["meets_target"]["memory_graphed_vs_eager"] is False  # dualpipev: 1.06 > 1.05


def test_merge_takes_the_seq2048_ratio_from_speed_rounds(tmp_path, monkeypatch):
    """--speed-rounds replaces the single-run ratio by the best ratio of the rounds' medians
    (kept beside it), and refuses a rounds record of another setting or a profiled one."""
    from tools import bench_zero_bubble, benchlib
    from tools.diagnostics import bench_rounds

    monkeypatch.setattr(benchlib, "RESULTS", tmp_path / "results")
    monkeypatch.delenv("OUT", raising=False)
    part = tmp_path / "part.json"
    part.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "shape": [], "steps": 12, "torch": "2.11.0",
                                "command": "python bench", "settings": [_setting(2048, 100.0, 109.0, 100.0)],
                                "runs": []}))
    run = lambda tps: {"tokens_per_s": tps, "losses": [1.0], "per_rank": []}  # noqa: E731
    base = ["--seq-len", "2048", "--micro-batches", "4"]
    records = {"graphed_1f1b": [run(100.0), run(102.0), run(101.0)],
               "graphed_zbv": [run(112.0), run(111.0), run(113.0)],
               "graphed_interleaved_zb": [run(108.0), run(109.0), run(107.0)]}
    rounds = tmp_path / "rounds.json"
    rounds.write_text(json.dumps({"command": "python tools/diagnostics/bench_rounds.py", "base": base,
                                  "summary": bench_rounds.summarize(records)}))
    monkeypatch.setattr(sys, "argv", ["bench_zero_bubble.py", "--merge", str(part), "--speed-rounds", str(rounds),
                                      "--name", "zb"])
    assert bench_zero_bubble.main() == 0
    summary = json.loads((tmp_path / "results" / "zb-h100.json").read_text())["summary"]
    assert summary["best_graphed_zb_vs_graphed_1f1b"] == pytest.approx(112.0 / 101.0)
    assert summary["best_graphed_zb_vs_graphed_1f1b_single_run"] == pytest.approx(1.09)
    assert summary["meets_target"]["best_graphed_zb_vs_graphed_1f1b"] is True
    assert summary["speed_rounds"]["rounds"] == 3
    assert summary["speed_rounds"]["per_schedule"]["interleaved_zb"]["spread"] == pytest.approx(109.0 / 107.0)

    for wrong in (["--seq-len", "512", "--micro-batches", "4"], [*base, "--profile-steps", "3"]):
        rounds.write_text(json.dumps({"base": wrong, "summary": bench_rounds.summarize(records)}))
        assert bench_zero_bubble.main() == 2


# ------------------------------------------------------------------ the split on its own
class Reused(torch.nn.Module):
    """One weight used twice on the activations' path (its junctions lie one after the other),
    another only on the weights' side, one not at all."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.randn(8))
        self.offset = torch.nn.Parameter(torch.randn(8))
        self.unused = torch.nn.Parameter(torch.randn(2))

    def forward(self, x):
        h = self.lin(torch.tanh(self.lin(x)))
        return h * self.scale.exp() + self.offset.sin().sum(), self.offset.cos()


def test_input_then_weight_half_give_autograd_gradients():
    from paddle_graphpp.torch import split_backward

    torch.manual_seed(0)
    module = Reused()
    params = list(module.parameters())
    x = torch.randn(3, 8, requires_grad=True)
    outs = module(x)
    grads_out = [torch.randn_like(o) for o in outs]
    want = torch.autograd.grad(outs, [x, *params], grads_out, retain_graph=True, allow_unused=True)

    got_x, state = split_backward.backward_input(list(outs), grads_out, [x], params)
    torch.testing.assert_close(got_x[0], want[0], rtol=0, atol=0)
    got = [None] * len(params)
    for index, grads in split_backward.backward_weight(state, params):
        for i, g in zip(index, grads):
            assert got[i] is None  # each parameter once
            got[i] = g
    for i, (g, w) in enumerate(zip(got, want[1:])):
        if w is None:  # the unused parameter: zeros (the weight pass asks for every parameter)
            assert torch.count_nonzero(g) == 0, i
        else:
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert state.groups == [] and state.saved == {}  # released


def _dropping_step(model, params):
    """One zero-bubble step of two micro-batches through ``model``: both forwards, the input
    passes (each output dropped after its own), then the weight passes."""
    xs = [torch.randn(2, 4, requires_grad=True) for _ in range(2)]
    ys = [model(x) for x in xs]
    passes = []
    for p in range(2):
        passes.append(stage_backward_input([ys[p].sum()], None, [xs[p]], params)[1])
        ys[p] = None
    for groups in passes:
        stage_backward_weight(params, groups)


def test_an_output_dropped_after_its_input_pass_gives_its_memory_back_before_the_weight_passes(rt):
    # The schedule drops each micro-batch's stage output after its input pass. Only the weight
    # halves remain, and they start from saved state, not from the outputs: b's output is free
    # from its input pass on (not held until its weight half, by the call or by the handle that
    # keeps its autograd node for the weight pass), and goes back to the pool for the graphs
    # captured after that point. a's output is b's saved input: it waits for b's weight half.
    a = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    b = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    params = [*a.parameters(), *b.parameters()]
    for _ in range(3):
        _dropping_step(lambda x: b(a(x)), params)
    names = {id(a.engine.capture): "a", id(b.engine.capture): "b"}
    checks = {(names[k[0]], k[2], k[3]): [(names[link.layer], link.position) for link in links]
              for k, links in a.engine.process.outputs.checks.items()}
    assert checks[("b", 1, "input")] == [("b", 0)]  # right after b's input pass of micro-batch 0
    assert ("b", 0) not in [o for (layer, _, kind), outs in checks.items() if kind == "weight" for o in outs]
    released = [o for outs in checks.values() for o in outs]
    assert ("a", 0) in released and ("b", 1) in released
    for layer in (a, b):
        (sig,) = layer.engine.signatures().values()
        assert all(p.owned == [None] for p in sig.positions.values())


def test_a_gradient_one_graph_hands_another_goes_back_to_the_pool_once_its_reader_is_captured(rt):
    # Layer b's input gradient is layer a's incoming gradient (a link: nothing is copied). Once
    # a's whole backward is captured (its weight half too: it may read that gradient, saved at a
    # junction), no later graph reads it, and its memory is given back to the pool: micro-batch
    # 0's before micro-batch 1's weight halves, though those were in flight when it was made
    # (eager autograd frees it there too).
    a = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    b = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    params = [*a.parameters(), *b.parameters()]
    released = []

    def captured_positions(layer):
        return {pos for sig in layer.engine.signatures().values() for pos in sig.positions}

    rt.release_to_pool = lambda t: released.append((t, captured_positions(a), captured_positions(b)))
    for _ in range(3):  # recorded, then captured at the start of the next step
        xs = [torch.randn(2, 4, requires_grad=True) for _ in range(2)]
        ys = [b(a(x)) for x in xs]
        passes = [stage_backward_input([y.sum()], None, [x], params)[1] for x, y in zip(xs, ys)]
        for groups in passes:
            stage_backward_weight(params, groups)
    assert a.engine.position_kinds() == {"full": 0, "split": 2} == b.engine.position_kinds()
    assert len(released) == 2  # one per position: b's gradient for a
    (key,) = b.engine.signatures()
    given = [b.engine.signatures()[key].positions[pos].static_grad_inputs[0] for pos in (0, 1)]
    for (tensor, a_done, _), pos, mine in zip(released, (0, 1), given):
        assert tensor is mine  # the very tensor both positions keep
        assert pos in a_done  # released only after a's weight half of that position was captured
    assert 1 not in released[0][1] and 1 not in released[0][2]  # not held for the other micro-batch


class AddThenLinear(torch.nn.Module):
    """``x + p`` (a learned offset, like a position embedding), then a linear map: the gradient
    of its input is the very tensor the add's junction saves for its weight half."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.randn(4))
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x + self.p)


def test_a_handed_gradient_its_producers_weight_half_reads_is_given_back_only_after_it(rt):
    # b's input gradient goes to a (a link); b's own weight half reads the same tensor (the
    # add's junction saved it), and the pipelining weight pass captures a's weight half before
    # b's. The gradient waits for its producer's weight half as well as for its reader.
    a = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    b = Graphed(AddThenLinear(), rt, num_warmup_steps=0)
    c = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    params = [*a.parameters(), *b.parameters(), *c.parameters()]
    events = []
    rt.release_to_pool = lambda t: events.append(("release", t))
    weight_half = rt.backward_weight

    def reading(state, ps):
        read = [g for got in state.saved.values() for g in (got or ()) if g is not None]
        events.append(("weight", read + [g for group in state.groups for _, g in group.output_edges]))
        return weight_half(state, ps)

    rt.backward_weight = reading
    for step in range(3):  # recorded, then captured at the start of the next step
        events.clear()
        xs = [torch.randn(2, 4, requires_grad=True) for _ in range(2)]
        ys = [c(b(a(x))) for x in xs]
        passes = [stage_backward_input([y.sum()], None, [x], params)[1] for x, y in zip(xs, ys)]
        for groups in passes:
            stage_backward_weight(params, groups)
        if step == 1:
            at_capture = list(events)
    released = []
    for kind, obj in at_capture:
        if kind == "release":
            released.append(obj)
        else:  # a weight half being captured reads nothing given back before it
            assert not any(g is r for g in obj for r in released)
    assert len(released) == 4  # per position: c's gradient for b, b's for a


def test_the_weight_state_holds_the_outputs_nodes_not_their_memory():
    # The input half's caller drops the outputs; the junctions are kept as Python handles, which
    # for a custom function do not own the node on torch <= 2.11. The state keeps a handle that
    # owns each output's node (a view's node) without keeping the output's memory.
    from torch.multiprocessing.reductions import StorageWeakRef

    from paddle_graphpp.torch import split_backward

    lin = torch.nn.Linear(4, 4)
    w = torch.nn.Parameter(torch.rand(4))
    x = torch.randn(3, 4, requires_grad=True)
    out = Scale.apply(torch.tanh(lin(x)), w)
    memory = StorageWeakRef(out.untyped_storage())
    params = [lin.weight, lin.bias, w]
    (gx,), state = split_backward.backward_input([out], [torch.ones_like(out)], [x], params)
    assert [a.next_functions[0][0] for a in state.anchors] == [out.grad_fn]
    del out
    assert memory.expired()  # nothing in the state holds the output's memory
    got = {i: g for index, grads in split_backward.backward_weight(state, params) for i, g in zip(index, grads)}
    lin2, w2, x2 = copy.deepcopy(lin), w.detach().clone().requires_grad_(True), x.detach().clone().requires_grad_(True)
    (torch.tanh(lin2(x2)) * w2).sum().backward()
    for i, want in enumerate([lin2.weight.grad, lin2.bias.grad, w2.grad]):
        assert torch.allclose(got[i], want)
    assert torch.allclose(gx, x2.grad)
    assert state.anchors == []


class Squares(torch.nn.Module):
    """A loss-like layer without parameters: its input gradient is the next layer's incoming one."""

    def forward(self, x):
        return x.square().sum()


@pytest.mark.parametrize("sums", [False, True])
def test_the_gradient_a_loss_layer_hands_the_head_stays_a_link_whatever_the_weight_pass(rt, monkeypatch, sums):
    # The loss layer's input gradient (an output head's logits gradient) is read by the head's
    # graphs directly: a link, no buffer of the head's own, given back to the pool once the
    # head's backward is captured. On a torch whose weight pass sums saved gradients (2.11)
    # the head's node has a pre-hook; a hook that hands on the incoming gradient in another
    # tensor object loses the link unless it keeps the loss layer's tensor alive (measured on
    # 2 x H200 with such a hook, since removed: every micro-batch's logits gradient stayed a
    # buffer of its own, +0.2-1.0 GB).
    from paddle_graphpp.core.process import current_process
    from paddle_graphpp.torch.autograd import WeightPassFacts

    monkeypatch.setattr(current_process().section("torch").part(WeightPassFacts), "sums_output_grads", sums)
    head = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    loss = Graphed(Squares(), rt, num_warmup_steps=0)
    released = []
    rt.release_to_pool = lambda t: released.append(t)
    for _ in range(3):  # recorded, then captured at the start of the next step
        xs = [torch.randn(2, 4, requires_grad=True) for _ in range(2)]
        losses = [loss(head(x)) for x in xs]
        for x, value in zip(xs, losses):  # the zero-bubble passes: the hook acts in the input pass
            _, groups = stage_backward_input([value], None, [x], head.parameters())
            stage_backward_weight(head.parameters(), groups)
    (key,) = head.engine.signatures()
    positions = head.engine.signatures()[key].positions
    (lkey,) = loss.engine.signatures()
    handed = [loss.engine.signatures()[lkey].positions[p].static_grad_inputs[0] for p in (0, 1)]
    for p in (0, 1):
        assert positions[p].static_grad_outputs[0] is handed[p]  # read where the loss layer wrote it
    assert [t for t in released if any(t is h for h in handed)] == handed  # given back, both


# ---------------------- gradients handed between graphs that eager code reads as well
class AddP(torch.nn.Module):
    """Eager, between two graphed layers: a learned offset, passing its input gradient on
    unchanged (its junction saves that gradient for its weight pass)."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.randn(4))

    def forward(self, h):
        return h + self.p


def _counting(rt, monkeypatch):
    """Record the events in order, count the graphs made and note each release to the pool
    with the number of graphs made before it."""
    from paddle_graphpp.core.recording import Recording

    order, graphs, released = [], [0], []
    record, create = Recording.record, rt.create_graph

    def rec(self, layer, key, pos, forward, half=None):
        order.append((layer, pos, forward, half))
        record(self, layer, key, pos, forward, half=half)

    def made():
        graphs[0] += 1
        return create()

    monkeypatch.setattr(Recording, "record", rec)
    rt.create_graph = made
    rt.release_to_pool = lambda t: released.append((t, graphs[0]))
    return order, graphs, released


def test_a_gradient_an_eager_junction_saved_is_not_given_back_before_its_weight_pass(rt, monkeypatch):
    # x -> a (graphed) -> h + p (eager) -> c (graphed) -> d (graphed). c's input gradient g
    # reaches a unchanged (a link) and the add's junction saves it for p's eager weight pass,
    # which the pipelining weight pass runs last here (groups in parameter order: c, a, d, p).
    # Graphs captured after g goes back may take its memory and, at replay, run before that
    # eager read if they were recorded before it: g waits for its recorded death.
    a = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    mid = AddP()
    c = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    d = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    params = [*c.parameters(), *a.parameters(), *d.parameters(), *mid.parameters()]
    order, graphs, released = _counting(rt, monkeypatch)
    reads = []
    mid.p.register_hook(lambda g: reads.append(len(order)))
    for step in range(2):  # recorded, then captured at the start of the next step
        if step == 1:
            recorded, read_at = list(order), list(reads)
        _dropping_step(lambda x: d(c(mid(a(x)))), params)
    assert len(recorded) == graphs[0]  # every recorded event captured, in order
    (key,) = c.engine.signatures()
    for pos in (0, 1):
        g = c.engine.signatures()[key].positions[pos].static_grad_inputs[0]
        after = [n for t, n in released if t is g]
        assert len(after) == 1 and after[0] >= read_at[pos], (pos, after, read_at[pos])  # given back, after


def test_a_gradient_another_reader_copies_is_not_given_back_before_that_copy(rt, monkeypatch):
    # s = A(tanh(A0(x))) + B(y).view(2, 4); loss = P(s). P's input gradient g reaches A
    # unchanged (a link) and B as a view of another shape (no link: B copies it into a
    # buffer of its own when its backward replays). g waits for that copy.
    b_layer = Graphed(torch.nn.Linear(2, 2), rt, num_warmup_steps=0)
    a0 = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    a = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    p_layer = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    order, graphs, released = _counting(rt, monkeypatch)
    for step in range(2):  # recorded, then captured at the start of the next step
        if step == 1:
            recorded = list(order)
        x, y = torch.randn(2, 4, requires_grad=True), torch.randn(2, 2, 2, requires_grad=True)
        bo = b_layer(y.view(4, 2)).view(2, 4)
        s = a(torch.tanh(a0(x))) + bo
        p_layer(s).sum().backward()
    (key,) = p_layer.engine.signatures()
    g = p_layer.engine.signatures()[key].positions[0].static_grad_inputs[0]
    reads_at = [i for i, (layer, _, forward, _) in enumerate(recorded) if layer is b_layer.engine.capture and not forward]
    after = [n for t, n in released if t is g]
    assert len(after) == 1 and after[0] >= reads_at[0] + 1, (after, reads_at)  # given back, after the copy


def test_nothing_of_a_capture_batch_that_escapes_reaches_the_next(rt):
    # a -> h + p (eager) -> c -> d; c's input gradient (a link to a) dies in micro-batch 0's
    # weight pass. d's weight-half capture of micro-batch 1 fails under fallback='eager' with
    # warnings raised as errors, so the failure's warning escapes the batch: the gradients
    # found dead in it must not count as dead in the next one.
    from paddle_graphpp.core.records import CaptureFailed

    a = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    mid = AddP()
    c = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    d = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0, fallback="eager")
    params = [*c.parameters(), *a.parameters(), *d.parameters(), *mid.parameters()]
    real = d.engine.capture.backward_weight

    def failing(key, pos, half, batch):
        if pos == 1:
            raise CaptureFailed("weight half", RuntimeError("injected"), None)
        return real(key, pos, half, batch)

    d.engine.capture.backward_weight = failing
    proc = a.engine.process

    def step():
        _dropping_step(lambda x: d(c(mid(a(x)))), params)

    step()  # recorded
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(RuntimeWarning, match="injected"):
            step()  # captured at its first forward: d's failure warning escapes
    # The batch was the capture's own object: the next steps record and capture afresh, and the
    # layers that captured replay.
    assert proc.recording is None  # nothing of the failed batch's recording carries over
    for _ in range(3):
        step()
    assert a.engine.replays > 0 and c.engine.replays > 0


def test_memory_of_tensors_without_a_plain_storage_is_not_watched():
    from paddle_graphpp.torch.memory.capabilities import storage_watches

    sparse = torch.sparse_coo_tensor([[0, 1], [1, 0]], [1.0, 2.0], (2, 2))
    assert storage_watches([sparse], []) is None
    dense = torch.ones(2)
    watch = storage_watches([dense], [sparse])
    assert watch is not None and watch[0]()
