"""Graphed pipeline stages on 2 GPUs: record one step, capture all, replay; losses as eager's.

Each run is ``tools/train_gpt.py --framework torch --pp 2`` in its own processes (NCCL),
fp32 (TF32 off in the trainer's fp32 path is not assumed: tolerances allow TF32), dropout on.
Skipped without 2 GPUs.
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="requires two CUDA devices")

from tools.bench_pipeline import run_one  # noqa: E402

BASE = ["--framework", "torch", "--pp", "2", "--hidden", "256", "--layers", "4", "--heads", "4", "--vocab", "512",
        "--seq-len", "128", "--micro-batch-size", "2", "--micro-batches", "6", "--steps", "8", "--dropout", "0.1",
        "--seed", "7", "--timeout", "90"]


def _losses(extra):
    r = run_one(BASE + extra, timeout=150)
    assert "error" not in r, r
    return r


@pytest.mark.parametrize("vpp", ["1", "2"])
@pytest.mark.parametrize("graph", [[], ["--no-graph-accumulate-grads"], ["--graph-memory", "per_graph"]],
                         ids=["default", "no_accumulate", "per_graph"])
def test_graphed_pipeline_losses_equal_eager_with_dropout(vpp, graph):
    eager = _losses(["--vpp", vpp])
    graphed = _losses(["--vpp", vpp, "--cudagraph", *graph])
    assert len(graphed["losses"]) == len(eager["losses"]) == 8
    for a, b in zip(graphed["losses"], eager["losses"]):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (graphed["losses"], eager["losses"])
    reports = [r["memory_report"] for r in graphed["per_rank"] if r.get("memory_report")]
    assert reports and all(rep["torch"]["graphs_captured"] > 0 for rep in reports)
