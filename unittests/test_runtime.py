"""The framework table and the runtime seam, on CPU (no capture: unittests/gpu/ does that)."""
import pytest

from paddle_graphpp.core import runtime as runtime_mod
from paddle_graphpp.core.runtime import GraphRuntime, framework_module, framework_of, get_runtime, runtime_for


def test_framework_is_decided_from_the_type_or_a_framework_base_class():
    torch = pytest.importorskip("torch")

    class UserModule(torch.nn.Module):  # defined here, not in torch: its base class decides
        pass

    param = torch.nn.Parameter(torch.zeros(1))
    for obj in (torch.zeros(1), param, torch.nn.Linear(2, 2), UserModule(), torch.optim.SGD([param], lr=0.1)):
        assert framework_of(obj) == "torch"
        assert runtime_for(obj) is get_runtime("torch")
    for obj in (1, "torch", None, object()):
        assert framework_of(obj) is None
    with pytest.raises(TypeError, match="expected a torch or paddle object, got builtins.int"):
        runtime_for(1)


def test_paddle_objects_belong_to_paddle():
    paddle = pytest.importorskip("paddle")
    layer = paddle.nn.Linear(2, 2)
    for obj in (paddle.zeros([1]), layer, paddle.optimizer.SGD(parameters=layer.parameters())):
        assert framework_of(obj) == "paddle"
    assert runtime_for(layer) is get_runtime("paddle")


def test_framework_module_and_get_runtime_reject_unknown_names():
    with pytest.raises(ValueError, match=r"unknown framework 'jax'; choose one of \['paddle', 'torch'\]"):
        framework_module("jax", "optim")
    with pytest.raises(ValueError, match="unknown runtime 'jax'"):
        get_runtime("jax")


def test_a_registered_runtime_replaces_the_real_one_until_unregistered():
    pytest.importorskip("torch")
    from fake_runtime import FakeGraphRuntime

    fake = FakeGraphRuntime()
    runtime_mod.register_runtime("torch", lambda: fake)
    try:
        import torch
        assert runtime_for(torch.zeros(1)) is fake
    finally:
        runtime_mod.unregister_runtime("torch")
    assert runtime_for(torch.zeros(1)) is get_runtime("torch") is not fake


@pytest.mark.parametrize("name", ["torch", "paddle"])
def test_adapters_implement_the_whole_seam_and_nothing_removed(name):
    pytest.importorskip(name)
    rt = get_runtime(name)
    assert isinstance(rt, GraphRuntime) and not GraphRuntime.__abstractmethods__ - set(dir(type(rt)))
    for gone in ("copy_", "synchronize", "warmup_context"):
        assert not hasattr(rt, gone), gone
    zeros = {"reserved_bytes": 0, "allocated_bytes": 0}
    assert rt.memory_stats() == rt.memory_stats([None]) == zeros  # CPU builds
    assert rt.async_allocator_active() is False
    assert rt.mode_key() is None
    with rt.mode_context(None):
        assert rt.mode_key() is None


def test_paddle_mode_context_puts_the_recorded_amp_state_back():
    paddle = pytest.importorskip("paddle")
    rt = get_runtime("paddle")
    tracer = paddle.base.framework._dygraph_tracer()
    # auto_cast is a no-op on a CPU build; set the tracer state it would set, by hand.
    saved = (tracer._amp_level, tracer._amp_dtype, tracer._get_amp_op_list())
    try:
        tracer._amp_level, tracer._amp_dtype = paddle.base.core.AmpLevel.O1, "bfloat16"
        tracer._set_amp_op_list({"matmul_v2"}, {"exp"})
        key = rt.mode_key()
        assert key is not None
        tracer._amp_level = paddle.base.core.AmpLevel.O0
        tracer._set_amp_op_list(set(), set())
        assert rt.mode_key() is None
        with rt.mode_context(key):
            assert rt.mode_key() == key
            with rt.mode_context(None):
                assert rt.mode_key() is None
            assert rt.mode_key() == key
        assert rt.mode_key() is None and tracer._get_amp_op_list() == (set(), set())
    finally:
        tracer._amp_level, tracer._amp_dtype = saved[0], saved[1]
        tracer._set_amp_op_list(*saved[2])


def test_torch_params_with_grad_hooks_sees_python_hooks_and_ddp_forwards(monkeypatch):
    torch = pytest.importorskip("torch")
    rt = get_runtime("torch")
    plain, post, pre = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    post.register_post_accumulate_grad_hook(lambda p: None)
    pre.register_hook(lambda g: g)
    assert rt.params_with_grad_hooks([plain, post, pre]) == [1, 2]
    # DDP's reducer hooks are C++ hooks on the gradient accumulators, invisible from Python:
    # inside a DDP forward (what DDP._inside_ddp_forward marks) every parameter counts.
    ddp = torch.nn.parallel.DistributedDataParallel
    assert callable(getattr(ddp, "_get_active_ddp_module", None)), "torch no longer marks DDP forwards"
    monkeypatch.setattr(ddp, "_active_ddp_module", object())
    assert rt.params_with_grad_hooks([plain, post, pre]) == [0, 1, 2]
