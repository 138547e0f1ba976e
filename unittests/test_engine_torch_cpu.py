"""PyTorch runtime without CUDA: the graphed module runs eagerly and matches the plain module."""
import copy
import warnings

import pytest
import torch

from paddle_graphpp.core.errors import GraphScheduleError
from paddle_graphpp.torch import CUDAGraphedModule

ORDER = "f1 f2 f3 b1 f4 b2 b3 b4"


class TwoHeads(torch.nn.Module):
    """Several outputs, two of them differentiable, one integer; keyword and constant arguments."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 4)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x, *, scale=1.0, mask=None):
        h = torch.nn.functional.gelu(self.a(x)) * scale
        h = self.drop(h)
        if mask is not None:
            h = h * mask
        return {"hidden": h, "logits": self.b(h), "count": (h > 0).sum()}


def run_order(model, xs, masks, order, scale):
    outs = {}
    for tok in order.split():
        n = int(tok[1:]) - 1
        if tok[0] == "f":
            outs[n] = model(xs[n], scale=scale, mask=masks[n])
        else:
            o = outs[n]
            (o["logits"].square().mean() + 0.5 * o["hidden"].mean()).backward()
    return outs


def test_eager_fallback_matches_plain_module_with_accumulation():
    torch.manual_seed(0)
    plain = TwoHeads()
    graphed = CUDAGraphedModule(copy.deepcopy(plain), num_warmup_steps=1)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="running eagerly"):
        for step in range(4):
            xs = [torch.randn(3, 8) for _ in range(4)]
            masks = [torch.rand(3, 8) for _ in range(4)]
            xa = [x.clone().requires_grad_(True) for x in xs]
            xb = [x.clone().requires_grad_(True) for x in xs]
            torch.manual_seed(100 + step)
            oa = run_order(plain, xa, masks, ORDER, 2.0)
            torch.manual_seed(100 + step)
            ob = run_order(graphed, xb, masks, ORDER, 2.0)
            for n in range(4):
                for k in ("hidden", "logits", "count"):
                    torch.testing.assert_close(ob[n][k], oa[n][k], rtol=0, atol=0)
                torch.testing.assert_close(xb[n].grad, xa[n].grad, rtol=0, atol=0)
            for p, q in zip(plain.parameters(), graphed.module.parameters()):
                torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
            if step % 2 == 1:  # two steps of gradient accumulation per optimizer step
                opt_p.step(); opt_g.step(); opt_p.zero_grad(); opt_g.zero_grad()
    for p, q in zip(plain.parameters(), graphed.module.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


def test_warns_once_only():
    model = CUDAGraphedModule(torch.nn.Linear(2, 2))
    with pytest.warns(RuntimeWarning):
        model(torch.randn(1, 2)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(1, 2)).sum().backward()


def test_unpaired_backward_raises():
    model = CUDAGraphedModule(torch.nn.Linear(2, 2))
    with pytest.warns(RuntimeWarning):
        y1 = model(torch.randn(1, 2))  # noqa: F841 - held: its forward stays in flight
    y2 = model(torch.randn(1, 2))
    with pytest.raises(GraphScheduleError, match="order of their forwards"):
        y2.sum().backward()


def test_second_backward_raises_schedule_error():
    model = CUDAGraphedModule(torch.nn.Linear(2, 2))
    with pytest.warns(RuntimeWarning):
        y = model(torch.randn(1, 2))
    y.sum().backward(retain_graph=True)
    with pytest.raises(GraphScheduleError, match="no forward in flight"):
        y.sum().backward()


def test_rejects_non_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        CUDAGraphedModule(lambda x: x)


def test_state_dict_keys_nest_under_module():
    model = CUDAGraphedModule(torch.nn.Linear(2, 2))
    assert set(model.state_dict()) == {"module.weight", "module.bias"}


def test_generators_must_be_cuda_generators():
    with pytest.raises(ValueError, match=r"CUDAGraphedModule\(Linear\): generators: .*cpu generator"):
        CUDAGraphedModule(torch.nn.Linear(2, 2), generators=[torch.Generator()])
    with pytest.raises(TypeError, match="expected torch.Generator objects, got int"):
        CUDAGraphedModule(torch.nn.Linear(2, 2), name="blk", generators=[3])


def test_megatron_tracker_without_graph_safe_states_is_named(monkeypatch):
    import sys
    import types

    from paddle_graphpp.torch.runtime import RUNTIME

    random = types.ModuleType("megatron.core.tensor_parallel.random")
    random._CUDA_RNG_STATE_TRACKER = types.SimpleNamespace(states_={"model-parallel-rng": torch.zeros(16)})
    monkeypatch.setitem(sys.modules, "megatron.core.tensor_parallel.random", random)
    error = RuntimeError("Attempt to increase offset for a CUDA generator not in capture mode.")
    hint = RUNTIME.capture_failure_hint(error, ())
    assert "['model-parallel-rng']" in hint and "use_cudagraphable_rng=True" in hint
    assert RUNTIME.capture_failure_hint(RuntimeError("operation not permitted when stream is capturing"), ()) is None


@pytest.mark.parametrize("accumulate", [True, False])
def test_backward_into_matches_autograd_grad(accumulate):
    """The torch runtime's backward_into: input gradients returned, parameter gradients added
    into (or copied over) their buffers, unused parameters reported and left alone."""
    from paddle_graphpp.torch.runtime import RUNTIME

    torch.manual_seed(0)
    lin, unused = torch.nn.Linear(5, 3), torch.nn.Parameter(torch.randn(2))
    x = torch.randn(4, 5, requires_grad=True)
    dy = torch.randn(4, 3)
    params = [lin.weight, lin.bias, unused]
    aliases = [p.detach().requires_grad_() for p in params]
    y = torch.func.functional_call(lin, {"weight": aliases[0], "bias": aliases[1]}, (x,))
    expected = torch.autograd.grad(y, [x, aliases[0], aliases[1]], dy)
    start = [torch.full_like(p, 0.5) for p in params]
    buffers = [b.clone() for b in start]
    inputs = [x.detach().requires_grad_()]
    y = torch.func.functional_call(lin, {"weight": aliases[0], "bias": aliases[1]}, (inputs[0],))
    grads, used = RUNTIME.backward_into([y], [dy], inputs, aliases, buffers, accumulate=accumulate)
    assert used == [True, True, False]
    torch.testing.assert_close(grads[0], expected[0], rtol=0, atol=0)
    for buf, s, e in zip(buffers[:2], start[:2], expected[1:]):
        torch.testing.assert_close(buf, s + e if accumulate else e, rtol=0, atol=0)
    assert torch.equal(buffers[2], start[2])
    assert all(a.grad is None for a in aliases) and inputs[0].grad is None


def test_backward_into_adds_into_buffers_of_another_dtype_in_place_as_a_main_grad_hook_would():
    """Buffers of the parameters' dtype are added into in place (autograd's accumulation into
    ``.grad``); an fp32 buffer for bf16 parameters (Megatron-Core's ``main_grad`` under
    ``grad_reduce_in_fp32``) by ``buffer.add_(grad)``, as Megatron's hook adds: the same objects,
    the same values as that add."""
    from paddle_graphpp.torch.runtime import RUNTIME

    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 3).to(torch.bfloat16)
    params = [lin.weight, lin.bias]
    x, dy = torch.randn(4, 5, dtype=torch.bfloat16), torch.randn(4, 3, dtype=torch.bfloat16)
    aliases = [p.detach().requires_grad_() for p in params]
    y = torch.func.functional_call(lin, {"weight": aliases[0], "bias": aliases[1]}, (x,))
    expected = torch.autograd.grad(y, aliases, dy)
    for dtype in (torch.float32, torch.bfloat16):
        buffers = [torch.full(p.shape, 0.25, dtype=dtype) for p in params]
        want = [b.clone().add_(e) for b, e in zip(buffers, expected)]
        objects = [(b, b.data_ptr()) for b in buffers]
        y = torch.func.functional_call(lin, {"weight": aliases[0], "bias": aliases[1]}, (x,))
        _, used = RUNTIME.backward_into([y], [dy], [], aliases, buffers, accumulate=True)
        assert used == [True, True]
        assert all(b is o and b.data_ptr() == ptr for b, (o, ptr) in zip(buffers, objects))
        for b, w in zip(buffers, want):
            assert torch.equal(b, w), dtype
        assert all(a.grad is None for a in aliases)


class SharedPlaces(torch.nn.Module):
    """A submodule held under two names, and a weight tied into two modules."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)
        self.again = self.inner  # the same module under a second name (as a torch.compile wrapper holds it)
        self.out = torch.nn.Linear(8, 8)
        self.back = torch.nn.Linear(8, 8)
        self.back.weight = self.out.weight  # one parameter in two modules

    def forward(self, x):
        h = torch.tanh(self.again(x))
        return self.back(self.out(h))


def test_parameters_held_in_several_places_keep_their_objects_and_get_whole_gradients():
    warnings.filterwarnings("ignore", message=".*CUDA graphs are not used.*")
    torch.manual_seed(0)
    eager = SharedPlaces()
    module = copy.deepcopy(eager)
    graphed = CUDAGraphedModule(module, num_warmup_steps=0)
    before = [id(p) for p in module.parameters()]
    x = torch.randn(4, 8)
    for _ in range(3):
        eager(x).square().mean().backward()
        graphed(x).square().mean().backward()
    assert [id(p) for p in module.parameters()] == before  # the module holds the parameters it had
    for (name, p), q in zip(eager.named_parameters(), module.parameters()):
        assert q.grad is not None and torch.allclose(p.grad, q.grad), name  # the tied weight's two parts


def test_a_tensor_spec_is_made_once_per_shape_dtype_device_and_grad_flag(monkeypatch):
    from paddle_graphpp.torch import runtime as torch_runtime

    rt = torch_runtime.TorchRuntime()
    x = torch.zeros(2, 3)
    spec = rt.spec(x)
    assert (spec.shape, spec.dtype, spec.device, spec.requires_grad) == ((2, 3), "float32", "cpu", False)
    assert rt.spec(torch.ones(2, 3)) is spec  # every graphed call asks this of each input
    others = [torch.zeros(3, 2), torch.zeros(2, 3, dtype=torch.float16), torch.zeros(2, 3, requires_grad=True)]
    assert len({spec, *map(rt.spec, others)}) == 4
    assert rt.spec(others[2]).describe() == "shape [2, 3], float32 on cpu, requires grad"
    monkeypatch.setattr(torch_runtime, "_SPECS_KEPT", 3)
    fresh = [rt.spec(torch.zeros(n)) for n in range(1, 5)]  # past the limit the kept specs are forgotten
    assert len(rt._specs) <= 3 and rt.spec(torch.zeros(4)) == fresh[3]
