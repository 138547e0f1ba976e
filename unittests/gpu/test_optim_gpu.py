"""graph_process and GraphedOptimizer on a real GPU (PyTorch): capture, replay, re-capture, parity.

Run on the GPU machine: ``python -m pytest unittests/gpu/test_optim_gpu.py -q``. Skipped without CUDA.
"""
import logging

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires a CUDA device")

import paddle_graphpp  # noqa: E402
from paddle_graphpp import graph_api as gp  # noqa: E402
from paddle_graphpp.torch import optim as topt  # noqa: E402

DEV = "cuda"
MAX_NORM = 1.0


@pytest.fixture(autouse=True)
def _fresh_cache():
    gp.clear_graph_cache()
    yield
    gp.clear_graph_cache()
    torch.cuda.synchronize()


def _params(seed=0):
    torch.manual_seed(seed)
    shapes = [(64, 32), (32,), (128, 64), (64,), (16, 128), (16,)] * 5
    return [torch.nn.Parameter(torch.randn(s, device=DEV) * 0.1) for s in shapes]


def _grads(params, step):
    g = torch.Generator(device=DEV).manual_seed(1000 + step)
    scale = 1.0 if step % 2 == 0 else 1e-3  # global norm ~ 10 (clipped) and ~ 0.01 (not clipped)
    return [torch.randn(p.shape, device=DEV, generator=g) * scale for p in params]


def _load(params, grads):
    for p, g in zip(params, grads):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.copy_(g)  # as backward accumulates into a zeroed grad: the address stays


def test_graph_process_replays_and_recaptures_on_a_new_address(caplog):
    calls = []

    def axpy(x, y):
        calls.append(1)
        y.add_(x, alpha=2.0)

    x, y = torch.ones(1024, device=DEV), torch.zeros(1024, device=DEV)
    gp.graph_process(axpy, x, y)  # warmup (runs) + capture (recorded only)
    assert len(calls) == 2 and torch.equal(y, torch.full_like(y, 2.0))
    for _ in range(3):
        gp.graph_process(axpy, x, y)  # replays: Python not called
    assert len(calls) == 2 and torch.equal(y, torch.full_like(y, 8.0))
    entry = next(iter(gp._cache().values()))
    assert isinstance(entry.graph, torch.cuda.CUDAGraph)
    y2 = torch.zeros(1024, device=DEV)
    with caplog.at_level(logging.WARNING, logger=gp.__name__):
        gp.graph_process(axpy, x, y2)
    assert "re-capturing" in caplog.text and len(calls) == 4
    gp.graph_process(axpy, x, y2)
    assert torch.equal(y2, torch.full_like(y2, 4.0)), "the new tensor is updated"
    assert torch.equal(y, torch.full_like(y, 8.0)), "the old tensor is not touched by a stale replay"


def test_same_named_closures_get_their_own_graphs():
    def make(alpha):
        def step(y):
            y.add_(alpha)
        return step

    a, b = make(1.0), make(100.0)
    y = torch.zeros(8, device=DEV)
    for _ in range(3):
        gp.graph_process(a, y)
        gp.graph_process(b, y)
    torch.cuda.synchronize()
    # warmup runs, capture records: per closure 1 eager + 2 replays = 3 applications
    assert torch.equal(y, torch.full_like(y, 303.0))


def test_capture_failure_names_the_host_sync():
    def syncs(t):
        if t.sum().item() > 0:
            t.mul_(2)

    with pytest.raises(paddle_graphpp.CaptureError, match=r"\.item\(\)"):
        gp.graph_process(syncs, torch.ones(4, device=DEV))
    torch.cuda.synchronize()
    assert len(gp._cache()) == 0


@pytest.mark.parametrize("opt_kw", [{"foreach": False}, {"foreach": True}, {"fused": True}],
                         ids=["per-tensor", "foreach", "fused"])
def test_graphed_optimizer_matches_eager_and_keeps_the_schedule(opt_kw, caplog):
    ref, ours = _params(), _params()
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, **opt_kw)
    gopt = paddle_graphpp.GraphedOptimizer(torch.optim.AdamW(ours, lr=1e-2, weight_decay=0.1, **opt_kw),
                                           clip_grad_norm=MAX_NORM)
    assert gopt.graphed
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + 0.3 * s))
    sched = torch.optim.lr_scheduler.LambdaLR(gopt.optimizer, lambda s: 1.0 / (1 + 0.3 * s))
    clipped = []
    with caplog.at_level(logging.WARNING, logger=gp.__name__):
        for step in range(20):
            grads = _grads(ref, step)
            _load(ref, grads)
            norm = torch.nn.utils.clip_grad_norm_(ref, MAX_NORM)
            clipped.append(norm.item() > MAX_NORM)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=False)
            ref_sched.step()
            _load(ours, grads)
            our_norm = gopt.step()
            torch.testing.assert_close(our_norm, norm, rtol=1e-6, atol=0)
            gopt.zero_grad()
            sched.step()
    assert any(clipped) and not all(clipped)
    assert "re-capturing" not in caplog.text, "a steady loop must replay, not re-capture"
    for a, b in zip(ref, ours):
        assert (a - b).abs().max().item() <= 1e-6
        assert torch.count_nonzero(b.grad) == 0
    # the schedule reached the graph: lr decayed 20 times
    assert gopt.param_groups[0]["lr"].item() == pytest.approx(1e-2 / (1 + 0.3 * 20), rel=1e-6)


def test_graphed_optimizer_recaptures_when_a_grad_moves(caplog):
    ref, ours = _params(), _params()
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    gopt = paddle_graphpp.GraphedOptimizer(torch.optim.AdamW(ours, lr=1e-2), clip_grad_norm=MAX_NORM)
    for step in range(6):
        grads = _grads(ref, step)
        if step == 3:
            ours[0].grad = torch.zeros_like(ours[0])  # a new address for one gradient
        _load(ref, grads)
        torch.nn.utils.clip_grad_norm_(ref, MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=False)
        _load(ours, grads)
        with caplog.at_level(logging.WARNING, logger=gp.__name__):
            gopt.step()
    assert "re-capturing" in caplog.text and "address" in caplog.text
    for a, b in zip(ref, ours):
        assert (a - b).abs().max().item() <= 1e-6, "a stale replay would have missed the moved gradient"


def test_graphed_step_does_not_sync_the_host():
    params = _params()
    gopt = paddle_graphpp.GraphedOptimizer(torch.optim.AdamW(params, lr=1e-2, foreach=True),
                                           clip_grad_norm=MAX_NORM)
    sched = torch.optim.lr_scheduler.StepLR(gopt.optimizer, step_size=1, gamma=0.9)
    for step in range(2):  # first step warms up and captures
        _load(params, _grads(params, step))
        gopt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            gopt.step()
            gopt.zero_grad()
            sched.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_master_weights_bf16_graphed_matches_eager():
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (128, 64)] * 4
    model = [torch.nn.Parameter((torch.randn(s, device=DEV) * 0.1).bfloat16()) for s in shapes]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in model]
    eager_mw, graph_mw = topt.MasterWeights(twin), topt.MasterWeights(model)
    eager = paddle_graphpp.GraphedOptimizer(torch.optim.AdamW(eager_mw.master, lr=1e-2), clip_grad_norm=MAX_NORM,
                                            master_weights=eager_mw)
    eager.graphed = False  # the same sequence, run eagerly every step, as the reference
    graphed = paddle_graphpp.GraphedOptimizer(torch.optim.AdamW(graph_mw.master, lr=1e-2),
                                              clip_grad_norm=MAX_NORM, master_weights=graph_mw)
    for step in range(10):
        grads = [g.bfloat16() for g in _grads(model, step)]
        _load(twin, grads)
        _load(model, grads)
        eager.step()
        graphed.step()
    for a, b in zip(eager_mw.master, graph_mw.master):
        assert (a - b).abs().max().item() <= 1e-6
    for a, b in zip(twin, model):
        assert torch.equal(a, b)


@pytest.mark.timeout(600)
def test_compiled_foreach_matches_eager_and_replays_without_sync(caplog):
    # compile=True: the warmup of the first step compiles (Inductor), the capture runs that
    # compiled code, later steps replay the graph and never reach Python or the host.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    ref, ours = _params()[:20], _params()[:20]
    # lr 1e-3: the compiled (like the capturable) step computes the bias corrections in fp32,
    # the eager reference in double; at 1e-3 that drift stays far below the 1e-6 bound.
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.1, foreach=False)
    gopt = paddle_graphpp.GraphedOptimizer(torch.optim.AdamW(ours, lr=1e-3, weight_decay=0.1, foreach=True),
                                           clip_grad_norm=MAX_NORM, compile=True)
    assert gopt.graphed and gopt.compile
    compiled = gopt._compiled_core
    core_calls = []

    def counting_core(*args):
        core_calls.append(1)
        return compiled(*args)

    gopt._compiled_core = counting_core
    frames_before = counters["frames"]["total"]
    clipped = []
    with caplog.at_level(logging.WARNING, logger=gp.__name__):
        for step in range(10):
            grads = _grads(ref, step)
            _load(ref, grads)
            norm = torch.nn.utils.clip_grad_norm_(ref, MAX_NORM)
            clipped.append(norm.item() > MAX_NORM)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=False)
            _load(ours, grads)
            torch.cuda.synchronize()
            if step == 0:  # compile (in the warmup) + capture
                our_norm = gopt.step()
                torch.cuda.synchronize()
                frames_after_first = counters["frames"]["total"]
            else:
                torch.cuda.set_sync_debug_mode("error")
                try:
                    our_norm = gopt.step()
                    gopt.zero_grad()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            # the compiled norm sums in another order than torch's foreach norm
            torch.testing.assert_close(our_norm, norm, rtol=1e-5, atol=0)
    assert any(clipped) and not all(clipped)
    assert frames_after_first > frames_before, "the first step must compile the sequence"
    assert counters["frames"]["total"] == frames_after_first, "no compile after the first step"
    assert len(core_calls) == 2, "compiled core runs at warmup and capture only, then the graph replays"
    assert "re-capturing" not in caplog.text, "a steady loop must replay, not re-capture"
    assert len(gp._cache()) == 1 and isinstance(next(iter(gp._cache().values())).graph, torch.cuda.CUDAGraph)
    for a, b in zip(ref, ours):
        assert (a - b).abs().max().item() <= 1e-6
        assert torch.count_nonzero(b.grad) == 0
    torch._dynamo.reset()
