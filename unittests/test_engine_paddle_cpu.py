"""Paddle runtime on a CPU build: the graphed layer runs eagerly and matches the plain layer."""
import copy

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from paddle_graphpp import CUDAGraphedLayer  # noqa: E402

ORDER = "f1 f2 f3 b1 f4 b2 b3 b4"


class TwoHeads(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.a = paddle.nn.Linear(8, 8)
        self.b = paddle.nn.Linear(8, 4)

    def forward(self, x, scale=1.0):
        h = paddle.nn.functional.gelu(self.a(x)) * scale
        return h, self.b(h)


def run_order(model, xs, order):
    outs = {}
    for tok in order.split():
        n = int(tok[1:]) - 1
        if tok[0] == "f":
            outs[n] = model(xs[n], scale=2.0)
        else:
            h, logits = outs[n]
            (logits.square().mean() + 0.5 * h.mean()).backward()
    return outs


def test_eager_fallback_matches_plain_layer_with_accumulation():
    paddle.seed(0)
    plain = TwoHeads()
    graphed = CUDAGraphedLayer(copy.deepcopy(plain), num_warmup_steps=1)
    opt_p = paddle.optimizer.SGD(0.1, parameters=plain.parameters())
    opt_g = paddle.optimizer.SGD(0.1, parameters=graphed.parameters())
    with pytest.warns(RuntimeWarning, match="running eagerly"):
        for step in range(4):
            xs = [paddle.randn([3, 8]) for _ in range(4)]
            xa = [x.clone() for x in xs]
            xb = [x.clone() for x in xs]
            for x in xa + xb:
                x.stop_gradient = False
            oa = run_order(plain, xa, ORDER)
            ob = run_order(graphed, xb, ORDER)
            for n in range(4):
                for a, b in zip(oa[n], ob[n]):
                    np.testing.assert_array_equal(b.numpy(), a.numpy())
                np.testing.assert_array_equal(xb[n].grad.numpy(), xa[n].grad.numpy())
            for p, q in zip(plain.parameters(), graphed.layer.parameters()):
                np.testing.assert_array_equal(q.grad.numpy(), p.grad.numpy())
            if step % 2 == 1:
                opt_p.step(); opt_g.step(); opt_p.clear_grad(); opt_g.clear_grad()
    for p, q in zip(plain.parameters(), graphed.layer.parameters()):
        np.testing.assert_array_equal(q.numpy(), p.numpy())


def test_input_not_requiring_grad_gets_no_grad():
    layer = CUDAGraphedLayer(paddle.nn.Linear(2, 2))
    x = paddle.randn([1, 2])  # stop_gradient=True
    with pytest.warns(RuntimeWarning):
        layer(x).sum().backward()
    assert x.grad is None
    assert all(p.grad is not None for p in layer.parameters())


def test_unpaired_backward_raises():
    layer = CUDAGraphedLayer(paddle.nn.Linear(2, 2))
    with pytest.warns(RuntimeWarning):
        y1 = layer(paddle.randn([1, 2]))  # noqa: F841 - held: its forward stays in flight
    y2 = layer(paddle.randn([1, 2]))
    with pytest.raises(Exception, match="order of their forwards"):
        y2.sum().backward()


def test_no_grad_runs_plain():
    layer = CUDAGraphedLayer(paddle.nn.Linear(2, 2))
    with paddle.no_grad():
        for _ in range(200):
            layer(paddle.randn([1, 2]))
    assert layer.engine.in_flight == 0


def test_rejects_non_layer():
    with pytest.raises(TypeError, match="paddle.nn.Layer"):
        CUDAGraphedLayer(lambda x: x)


def test_paddle_device_and_memory_errors_are_failures_of_capture():
    from paddle_graphpp.paddle.runtime import PaddleRuntime

    rt = PaddleRuntime()
    # Paddle raises CUDA's errors as OSError and running out of memory as MemoryError
    assert rt.is_capture_failure(OSError("(External) CUDA error(900), operation not permitted when stream is capturing"))
    assert rt.is_capture_failure(MemoryError("(ResourceExhausted) Out of memory error on GPU 0"))
    assert rt.is_capture_failure(RuntimeError("(PreconditionNotMet) ..."))
    assert not rt.is_capture_failure(ValueError("the layer's own check"))
