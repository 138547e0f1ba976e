"""GraphedOptimizer and the graph-safe helpers with real PyTorch on CPU (eager fallback).

On CPU the wrapped sequence runs eagerly; it must equal the plain loop
(clip_grad_norm_ + step + zero_grad) bit for bit, with clipping active on some steps only.
"""
import copy
import logging

import pytest
import torch

import paddle_graphpp
from paddle_graphpp.torch import optim as topt

MAX_NORM = 1.0


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8),
                               torch.nn.LayerNorm(8), torch.nn.Linear(8, 3)).to(dtype)


def _backward(model, step):
    # Loss scale alternates, so the global norm is above MAX_NORM on some steps and below on others.
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(4, 16, generator=g, dtype=next(model.parameters()).dtype)
    scale = 5.0 if step % 3 == 0 else 0.01
    (model(x).square().mean() * scale).backward()


def _plain_run(model, steps, make_opt, schedule=None):
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule else None
    norms = []
    for step in range(steps):
        _backward(model, step)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
    return norms


def _graphed_run(model, steps, make_opt, schedule=None):
    gopt = paddle_graphpp.GraphedOptimizer(make_opt(model.parameters()), clip_grad_norm=MAX_NORM)
    sched = torch.optim.lr_scheduler.LambdaLR(gopt.optimizer, schedule) if schedule else None
    norms = []
    for step in range(steps):
        _backward(model, step)
        norms.append(gopt.step().clone())
        gopt.zero_grad()
        if sched:
            sched.step()
    return gopt, norms


def _assert_same(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name} differs by {(p - q).abs().max().item()}"


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-2),
], ids=["adamw-per-tensor", "adamw-foreach", "adam"])
def test_fallback_matches_plain_loop_bit_for_bit(make_opt):
    ref, ours = _model(), _model()
    ours.load_state_dict(ref.state_dict())
    schedule = lambda s: 1.0 / (1 + s)  # noqa: E731
    ref_norms = _plain_run(ref, 20, make_opt, schedule)
    gopt, our_norms = _graphed_run(ours, 20, make_opt, schedule)
    assert not gopt.graphed
    clipped = [n.item() > MAX_NORM for n in ref_norms]
    assert any(clipped) and not all(clipped), "the test must clip on some steps and not on others"
    assert all(torch.equal(a, b) for a, b in zip(ref_norms, our_norms))
    _assert_same(ref, ours)
    assert all(torch.count_nonzero(p.grad) == 0 for p in ours.parameters()), "step() leaves grads zeroed"


def test_helpers_match_torch_clipping_bit_for_bit():
    model = _model()
    _backward(model, 0)
    grads = [p.grad.clone() for p in model.parameters()]
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    norm = paddle_graphpp.clip_by_global_norm(grads, 0.5)
    assert torch.equal(norm, expected)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert torch.equal(paddle_graphpp.global_grad_norm(grads), torch.nn.utils.get_total_norm(grads))
    # within bounds: multiplied by exactly 1
    before = [g.clone() for g in grads]
    paddle_graphpp.clip_by_global_norm(grads, 1e6)
    assert all(torch.equal(a, b) for a, b in zip(before, grads))


def test_zero_grads_in_place_keeps_addresses():
    model = _model()
    _backward(model, 0)
    ptrs = [p.grad.data_ptr() for p in model.parameters()]
    topt.zero_grads_([p.grad for p in model.parameters()])
    assert [p.grad.data_ptr() for p in model.parameters()] == ptrs
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_zero_grad_skips_clean_grads_and_zeroes_dirty_ones():
    model = _model()
    gopt = paddle_graphpp.GraphedOptimizer(torch.optim.AdamW(model.parameters()))
    _backward(model, 0)
    gopt.step()
    versions = [p.grad._version for p in model.parameters()]
    gopt.zero_grad()  # right after step: nothing to do
    assert [p.grad._version for p in model.parameters()] == versions
    _backward(model, 1)  # a backward, then a skipped step
    gopt.zero_grad()
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    with pytest.raises(ValueError, match="set_to_none"):
        gopt.zero_grad(set_to_none=True)


def test_master_weights_match_manual_fp32_masters():
    steps = 20
    ref, ours = _model(torch.bfloat16), _model(torch.bfloat16)
    ours.load_state_dict(ref.state_dict())
    # reference: hand-written fp32 masters
    masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, foreach=False)
    mw = topt.MasterWeights(ours.parameters())
    gopt = paddle_graphpp.GraphedOptimizer(torch.optim.AdamW(mw.master, lr=1e-2, foreach=False),
                                           clip_grad_norm=MAX_NORM, master_weights=mw)
    for step in range(steps):
        _backward(ref, step)
        for m, p in zip(masters, ref.parameters()):
            m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(masters, MAX_NORM)
        ref_opt.step()
        with torch.no_grad():
            for m, p in zip(masters, ref.parameters()):
                p.copy_(m)
        ref.zero_grad()
        _backward(ours, step)
        gopt.step()
    _assert_same(ref, ours)
    assert all(torch.equal(a, b) for a, b in zip(masters, mw.master))


def test_refusals_are_clear():
    model = _model()
    for opt in (torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.LBFGS(model.parameters())):
        with pytest.raises(TypeError, match="capturable"):
            paddle_graphpp.GraphedOptimizer(opt)
    with pytest.raises(ValueError, match="differentiable"):
        paddle_graphpp.GraphedOptimizer(torch.optim.Adam(model.parameters(), differentiable=True))
    with pytest.raises(ValueError, match="clip_grad_norm"):
        paddle_graphpp.GraphedOptimizer(torch.optim.Adam(model.parameters()), clip_grad_norm=0)
    with pytest.raises(ValueError, match="master_weights"):
        paddle_graphpp.GraphedOptimizer(torch.optim.Adam(model.parameters()),
                                        master_weights=topt.MasterWeights(model.parameters()))
    emb = torch.nn.Embedding(10, 4, sparse=True)
    gopt = paddle_graphpp.GraphedOptimizer(torch.optim.Adam(emb.parameters()))
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        gopt.step()
    with pytest.raises(TypeError, match="torch or paddle"):
        paddle_graphpp.GraphedOptimizer(object())


def test_dispatch_returns_the_torch_class():
    gopt = paddle_graphpp.GraphedOptimizer(torch.optim.AdamW(_model().parameters()))
    assert isinstance(gopt, paddle_graphpp.GraphedOptimizer)
    assert type(gopt) is topt.TorchGraphedOptimizer
    assert gopt.param_groups is gopt.optimizer.param_groups


def test_hyperparameter_change_applies_in_fallback():
    a, b = _model(), _model()
    b.load_state_dict(a.state_dict())
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2)
    gopt = paddle_graphpp.GraphedOptimizer(torch.optim.AdamW(b.parameters(), lr=1e-2))
    for step in range(4):
        if step == 2:
            ref.param_groups[0]["weight_decay"] = 0.5
            gopt.param_groups[0]["weight_decay"] = 0.5
        _backward(a, step)
        _backward(b, step)
        ref.step()
        ref.zero_grad()
        gopt.step()
    _assert_same(a, b)
    state = copy.deepcopy(gopt.state_dict())
    gopt.load_state_dict(state)
    assert gopt._generation >= 1


def test_compile_on_cpu_runs_eagerly_bit_for_bit(monkeypatch, caplog):
    # compile=True applies to the captured GPU step: on CPU nothing is compiled.
    def no_compile(*args, **kwargs):
        raise AssertionError("torch.compile must not be called without CUDA")

    def make_opt(ps):
        return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True)

    monkeypatch.setattr(torch, "compile", no_compile)
    ref, ours = _model(), _model()
    ours.load_state_dict(ref.state_dict())
    ref_norms = _plain_run(ref, 12, make_opt)
    with caplog.at_level(logging.INFO, logger=topt.__name__):
        gopt = paddle_graphpp.GraphedOptimizer(make_opt(ours.parameters()), clip_grad_norm=MAX_NORM, compile=True)
    assert gopt.compile and not gopt.graphed
    assert sum("compile=True applies to the captured GPU step" in r.getMessage() for r in caplog.records) == 1
    our_norms = []
    for step in range(12):
        _backward(ours, step)
        our_norms.append(gopt.step().clone())
        gopt.zero_grad()
    clipped = [n.item() > MAX_NORM for n in ref_norms]
    assert any(clipped) and not all(clipped)
    assert all(torch.equal(a, b) for a, b in zip(ref_norms, our_norms))
    _assert_same(ref, ours)
    with pytest.raises(TypeError, match="compile must be a bool"):
        paddle_graphpp.GraphedOptimizer(make_opt(ours.parameters()), compile="yes")


def test_sparse_check_runs_before_the_compiled_core():
    # The check raises outside the compiled region; a dense step then reaches the compiled core.
    emb = torch.nn.Embedding(10, 4, sparse=True)
    gopt = paddle_graphpp.GraphedOptimizer(torch.optim.Adam(emb.parameters()), compile=True)
    calls = []
    gopt._compiled_core = lambda owner, grads: calls.append((owner, grads))  # stands in for torch.compile's
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        gopt.step()
    assert calls == []
    emb.weight.grad = torch.zeros_like(emb.weight)
    gopt.step()
    assert len(calls) == 1 and calls[0][0] is gopt and calls[0][1][0] is emb.weight.grad


def test_compile_happens_in_the_warmup_and_the_capture_reuses_it(monkeypatch):
    # The GPU flow, on CPU: a fake graph runtime registered as "torch" makes the optimizer
    # "graphed" (its capture runs the code eagerly, its replay only counts), and torch.compile
    # gets the cheap "eager" backend. Values are not checked (the fake capture really steps).
    from fake_runtime import FakeGraphRuntime
    from torch._dynamo.utils import counters

    from paddle_graphpp import graph_api as gp
    from paddle_graphpp.core import runtime as runtime_mod

    real_compile, compile_calls = torch.compile, []

    def eager_compile(fn, **kwargs):
        compile_calls.append(kwargs)
        return real_compile(fn, backend="eager", **kwargs)

    monkeypatch.setattr(torch, "compile", eager_compile)
    rt = FakeGraphRuntime()
    runtime_mod.register_runtime("torch", lambda: rt)
    gp.clear_graph_cache()
    torch._dynamo.reset()
    try:
        model = _model()
        gopt = paddle_graphpp.GraphedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True),
                                               clip_grad_norm=MAX_NORM, compile=True)
        assert gopt.graphed and compile_calls == [{"fullgraph": False, "dynamic": False}]
        compiled, capturing = gopt._compiled_core, []

        def spy(*args):
            capturing.append(rt.capturing)
            return compiled(*args)

        gopt._compiled_core = spy
        frames = []
        for step in range(4):
            _backward(model, step)
            gopt.step()
            gopt.zero_grad()
            frames.append(counters["frames"]["total"])
        assert capturing == [False, True], "compiled code runs in the warmup, then in the capture, then never"
        assert frames[0] > 0 and len(set(frames)) == 1, "compiled once, in the first step's warmup"
        assert len(compile_calls) == 1, "one compiled callable for the optimizer's lifetime"
    finally:
        gp.clear_graph_cache()
        runtime_mod.unregister_runtime("torch")
        torch._dynamo.reset()
