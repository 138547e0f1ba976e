"""Checkpoint and resume with Paddle graphed layers and GraphedOptimizer on CPU (eager
there): a fresh model and optimizer resumed through ``set_state_dict`` mid-run, and the same
ones rolled back, give the uninterrupted run's per-step losses exactly."""
import warnings

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import paddle_graphpp  # noqa: E402
from paddle_graphpp import CUDAGraphedLayer  # noqa: E402

WIDTH, STEPS, AT = 16, 8, 4


class Block(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = paddle.nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = paddle.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc2(paddle.nn.functional.gelu(self.fc1(x)))


def build(seed):
    paddle.seed(seed)
    model = paddle.nn.Sequential(CUDAGraphedLayer(Block(), num_warmup_steps=1),
                                 CUDAGraphedLayer(Block(), num_warmup_steps=1), paddle.nn.Linear(WIDTH, 3))
    sched = paddle.optimizer.lr.ExponentialDecay(1e-2, gamma=0.9)
    opt = paddle_graphpp.GraphedOptimizer(
        paddle.optimizer.AdamW(sched, parameters=model.parameters(), weight_decay=0.1), clip_grad_norm=1.0)
    return model, opt, sched


def train_step(model, opt, sched, step):
    losses = []
    for mb in range(2):  # two micro-batches in flight
        rs = np.random.RandomState(1000 * step + mb)
        x = paddle.to_tensor(rs.randn(4, WIDTH).astype("float32"))
        y = paddle.to_tensor(rs.randint(0, 3, (4,)).astype("int64"))
        losses.append(paddle.nn.functional.cross_entropy(model(x), y) / 2)
    for loss in losses:
        loss.backward()
    opt.step()
    sched.step()
    opt.clear_grad()
    return float(sum(float(loss) for loss in losses))


def test_set_state_dict_resume_equals_uninterrupted_run(tmp_path):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA graphs are not used.*")
        # Paddle keys optimizer state by parameter and accumulator names, which a resumed process
        # generates alike; in one process, each run gets a name scope of its own.
        with paddle.utils.unique_name.guard():
            model, opt, sched = build(0)
            straight = []
            for step in range(STEPS):
                if step == AT:
                    paddle.save(model.state_dict(), str(tmp_path / "model.pdparams"))
                    paddle.save(opt.state_dict(), str(tmp_path / "opt.pdopt"))
                straight.append(train_step(model, opt, sched, step))
            final = [p.numpy().copy() for p in model.parameters()]

        with paddle.utils.unique_name.guard():
            fresh, fopt, fsched = build(1)  # other initial weights: everything must come from the files
            fresh.set_state_dict(paddle.load(str(tmp_path / "model.pdparams")))
            fopt.set_state_dict(paddle.load(str(tmp_path / "opt.pdopt")))
            resumed = [train_step(fresh, fopt, fsched, step) for step in range(AT, STEPS)]

        model.set_state_dict(paddle.load(str(tmp_path / "model.pdparams")))  # the same model, rolled back
        opt.set_state_dict(paddle.load(str(tmp_path / "opt.pdopt")))
        rolled = [train_step(model, opt, sched, step) for step in range(AT, STEPS)]

    assert resumed == straight[AT:]
    assert rolled == straight[AT:]
    for a, b, c in zip(final, fresh.parameters(), model.parameters()):
        np.testing.assert_array_equal(b.numpy(), a)
        np.testing.assert_array_equal(c.numpy(), a)
    assert fsched.last_lr == sched.last_lr


def test_grad_scaler_reads_the_wrapped_optimizers_parameters():
    # paddle.amp.GradScaler turns itself off on a CPU build (so its overflow skipping is not
    # testable here); when on, it unscales the gradients of optimizer._param_groups or
    # optimizer._parameter_list, which the wrapper must expose as the wrapped optimizer's.
    model = paddle.nn.Linear(4, 4)
    inner = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
    opt = paddle_graphpp.GraphedOptimizer(inner)
    assert opt._parameter_list is inner._parameter_list
    assert opt._param_groups is inner._param_groups


def test_reset_graphs_walks_a_paddle_model():
    # reset_graphs finds graphed layers through the runtime of the model's framework
    # (Paddle: sublayers); the reset layers warm up again
    model, _, _ = build(0)
    assert paddle_graphpp.reset_graphs(model) == 2
    assert paddle_graphpp.reset_graphs(paddle.nn.Linear(2, 2)) == 0


def test_a_step_abandoned_before_its_backwards_is_dropped_and_training_goes_on():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA graphs are not used.*")
        model, opt, sched = build(0)
        train_step(model, opt, sched, 0)
        x = paddle.to_tensor(np.random.RandomState(7).randn(4, WIDTH).astype("float32"))
        abandoned = [model(x) for _ in range(2)]  # the step raises here, before any backward
        del abandoned
        # Paddle hands an error raised in a backward on as OSError, with the message kept
        with pytest.raises((paddle_graphpp.GraphScheduleError, OSError), match=r"drop_in_flight\(model\)"):
            train_step(model, opt, sched, 1)
        assert paddle_graphpp.drop_in_flight(model) == 2 * 2 + 2 * 2  # 2 layers x (abandoned + refused)
        assert [train_step(model, opt, sched, s) > 0 for s in (2, 3)] == [True, True]
        assert all(layer.engine.in_flight == 0 for layer in model[:2])
