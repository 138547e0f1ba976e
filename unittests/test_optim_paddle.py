"""GraphedOptimizer and the graph-safe helpers with real Paddle on CPU (eager fallback).

Reference: the same AdamW built with grad_clip=ClipGradByGlobalNorm, then clear_grad().
"""
import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import paddle_graphpp  # noqa: E402
from paddle_graphpp.paddle import optim as popt  # noqa: E402

MAX_NORM = 1.0


def _model(seed=0):
    paddle.seed(seed)
    return paddle.nn.Sequential(paddle.nn.Linear(16, 32), paddle.nn.GELU(), paddle.nn.Linear(32, 8),
                                paddle.nn.LayerNorm(8), paddle.nn.Linear(8, 3))


def _twins():
    a, b = _model(), _model()
    b.set_state_dict(a.state_dict())
    return a, b


def _backward(model, step):
    x = paddle.to_tensor(np.random.RandomState(100 + step).randn(4, 16).astype("float32"))
    scale = 5.0 if step % 3 == 0 else 0.01
    (model(x).square().mean() * scale).backward()


def _global_norm(model):
    return float(np.sqrt(sum(float((p.grad.astype("float32") ** 2).sum()) for p in model.parameters())))


def _assert_same(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        assert np.array_equal(p.numpy(), q.numpy()), f"{p.name} differs by {np.abs(p.numpy() - q.numpy()).max()}"


@pytest.mark.parametrize("cls", [paddle.optimizer.AdamW, paddle.optimizer.Adam])
def test_fallback_matches_plain_optimizer_bit_for_bit(cls):
    ref, ours = _twins()
    kwargs = {"weight_decay": 0.1} if cls is paddle.optimizer.AdamW else {}
    ref_sched = paddle.optimizer.lr.StepDecay(1e-2, step_size=3, gamma=0.5)
    our_sched = paddle.optimizer.lr.StepDecay(1e-2, step_size=3, gamma=0.5)
    ref_opt = cls(ref_sched, parameters=ref.parameters(), grad_clip=paddle.nn.ClipGradByGlobalNorm(MAX_NORM),
                  **kwargs)
    gopt = paddle_graphpp.GraphedOptimizer(cls(our_sched, parameters=ours.parameters(), **kwargs),
                                           clip_grad_norm=MAX_NORM)
    assert isinstance(gopt, popt.PaddleGraphedOptimizer) and not gopt.graphed
    clipped = []
    for step in range(20):
        _backward(ref, step)
        clipped.append(_global_norm(ref) > MAX_NORM)
        ref_opt.step()
        ref_opt.clear_grad()
        ref_sched.step()
        _backward(ours, step)
        gopt.step()
        gopt.clear_grad()
        our_sched.step()
    assert any(clipped) and not all(clipped), "the test must clip on some steps and not on others"
    _assert_same(ref, ours)


def test_helpers_match_clip_grad_by_global_norm_bit_for_bit():
    model = _model()
    _backward(model, 0)
    params = list(model.parameters())
    grads = [p.grad.clone() for p in params]
    originals = [p.grad.clone() for p in params]
    expected = paddle.nn.ClipGradByGlobalNorm(0.5)([(p, p.grad) for p in params])
    norm = paddle_graphpp.clip_by_global_norm(grads, 0.5)
    assert float(norm) > 0.5, "the test must clip"
    for g, (_, e) in zip(grads, expected):
        assert np.array_equal(g.numpy(), e.numpy())
    norm_again = paddle_graphpp.global_grad_norm(originals)
    assert np.array_equal(norm.numpy(), norm_again.numpy())
    assert float(paddle_graphpp.global_grad_norm([p.grad for p in params])) == pytest.approx(0.5)
    before = [g.numpy().copy() for g in grads]
    paddle_graphpp.clip_by_global_norm(grads, 1e6)  # within bounds: times exactly 1
    assert all(np.array_equal(a, g.numpy()) for a, g in zip(before, grads))


def test_zero_grads_in_place_keeps_addresses():
    model = _model()
    _backward(model, 0)
    ptrs = [p.grad.data_ptr() for p in model.parameters()]
    popt.zero_grads_([p.grad for p in model.parameters()])
    assert [p.grad.data_ptr() for p in model.parameters()] == ptrs
    assert all(not p.grad.numpy().any() for p in model.parameters())


def test_frozen_lr_keeps_step_from_refilling_the_lr_tensor():
    model = _model()
    sched = paddle.optimizer.lr.StepDecay(0.1, step_size=1, gamma=0.5)
    opt = paddle.optimizer.AdamW(sched, parameters=model.parameters())
    _backward(model, 0)
    opt.step()
    lr = opt._global_learning_rate()
    sched.step()  # the schedule moves on to 0.05
    with popt._frozen_lr(opt):
        opt.step()  # inside a capture this must not record a fill of the lr tensor
    assert float(lr) == pytest.approx(0.1)
    opt._create_global_learning_rate()  # what the graphed step does before each replay
    assert float(opt._global_learning_rate()) == pytest.approx(0.05)
    assert opt._global_learning_rate() is lr, "the lr tensor is refilled in place"


def test_refusals_are_clear():
    model = _model()
    with pytest.raises(TypeError, match="capturable"):
        paddle_graphpp.GraphedOptimizer(paddle.optimizer.SGD(0.1, parameters=model.parameters()))
    clip = paddle.nn.ClipGradByGlobalNorm(1.0)
    with pytest.raises(ValueError, match="not both"):
        paddle_graphpp.GraphedOptimizer(paddle.optimizer.AdamW(parameters=model.parameters(), grad_clip=clip),
                                        clip_grad_norm=1.0)
    skip = paddle.nn.ClipGradByGlobalNorm(1.0, auto_skip_clip=True)
    with pytest.raises(ValueError, match="auto_skip_clip"):
        paddle_graphpp.GraphedOptimizer(paddle.optimizer.AdamW(parameters=model.parameters(), grad_clip=skip))
    gopt = paddle_graphpp.GraphedOptimizer(paddle.optimizer.AdamW(parameters=model.parameters()))
    with pytest.raises(ValueError, match="set_to_zero"):
        gopt.clear_grad(set_to_zero=False)
    emb = paddle.nn.Embedding(10, 4, sparse=True)
    gopt = paddle_graphpp.GraphedOptimizer(paddle.optimizer.Adam(parameters=emb.parameters()), clip_grad_norm=1.0)
    emb(paddle.to_tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        gopt.step()


def test_compile_is_refused_for_paddle():
    model = _model()
    with pytest.raises(ValueError, match=r"compile=True.*PyTorch-only"):
        paddle_graphpp.GraphedOptimizer(paddle.optimizer.AdamW(parameters=model.parameters()), clip_grad_norm=1.0,
                                        compile=True)
    gopt = paddle_graphpp.GraphedOptimizer(paddle.optimizer.AdamW(parameters=model.parameters()), compile=False)
    assert isinstance(gopt, popt.PaddleGraphedOptimizer)
