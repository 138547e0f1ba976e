"""Mixture-of-experts blocks seen by the transformers adapter: which experts modules a block holds,
how they dispatch, and whether a capture can hold that dispatch. (A whole block whose capture
fails anyway is graphed around its experts instead: unittests/test_moe_around.py.)

CPU only. Whether each implementation captures on a GPU is the GPU run's claim (docs/moe.md).
"""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from testing import zoo  # noqa: E402

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
