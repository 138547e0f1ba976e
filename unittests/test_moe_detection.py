"""Mixture-of-experts blocks seen by the transformers adapter: which experts modules a block holds,
how they dispatch, whether a capture can hold that dispatch, and what a failed capture of such a
block says (the fix: an implementation without host reads, or fallback='eager').

CPU only: the capture failure is the fake runtime's, raised where a real capture of the host-reading
dispatch fails. Whether each implementation captures on a GPU is the GPU run's claim (docs/moe.md).
"""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from testing import zoo  # noqa: E402

from paddle_graphpp import CaptureError  # noqa: E402
from paddle_graphpp.core.process import current_process  # noqa: E402
from paddle_graphpp.torch import graph_layers  # noqa: E402
from paddle_graphpp.torch.integrations import transformers as adapter  # noqa: E402

MOE = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"]


def _model(model_type, implementation):
    try:
        return zoo.build(model_type, experts_implementation=implementation)
    except Exception as exc:  # noqa: BLE001 - a class this transformers does not ship
        pytest.skip(f"{model_type} does not build here: {exc}")


@pytest.mark.parametrize("model_type", MOE)
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_each_moe_block_names_its_experts_and_whether_a_capture_can_hold_them(model_type, implementation):
    model = _model(model_type, implementation)
    blocks = list(zoo.blocks_of(model))
    found = [adapter.experts_modules(b) for b in blocks]
    assert any(found), f"{model_type}: no experts module found"
    for entries in found:
        for name, module, impl in entries:
            assert impl == implementation and "experts" in name
            problem = adapter.experts_capture_problem(module, impl)
            # on CPU (fp32), only batched_mm dispatches without reading the host
            assert (problem is None) == (implementation == "batched_mm"), (name, impl, problem)


def test_a_dense_block_holds_no_experts():
    model = _model("llama", None)
    assert not any(adapter.experts_modules(b) for b in zoo.blocks_of(model))


def test_a_failed_capture_of_a_whole_moe_block_names_the_dispatch_and_the_fixes(monkeypatch):
    # batched_mm is graphed whole (it reads nothing on the host); should its capture fail anyway,
    # the error names the experts module, its implementation and both ways on
    from fake_runtime import FakeGraphRuntime, serving

    rt = FakeGraphRuntime()
    current_process().reset(rt.name)
    try:
        with serving(rt):
            model = _model("qwen3_moe", "batched_mm")
            blocks = list(zoo.blocks_of(model))
            experts = type(adapter.experts_modules(blocks[0])[0][1])
            original = experts.forward

            def reads_the_host(self, *args, **kwargs):  # what the eager dispatch does inside a real capture
                if rt.capturing:
                    raise RuntimeError("operation not permitted when stream is capturing")
                return original(self, *args, **kwargs)

            monkeypatch.setattr(experts, "forward", reads_the_host)  # on the class: transformers 5.0 refuses
            # a block whose submodules' forward is replaced on the instance (its output recording)
            graph_layers(blocks, num_warmup_steps=1)
            ids = torch.randint(0, model.config.vocab_size, (2, 16))
            with pytest.raises(CaptureError, match=r"mlp.experts dispatches its routed experts with experts_implementation="
                                                   r"'batched_mm'.*set_experts_implementation\('eager'\) to graph around"):
                for _ in range(4):
                    model(ids, labels=ids).loss.backward()
    finally:
        current_process().reset(rt.name)
