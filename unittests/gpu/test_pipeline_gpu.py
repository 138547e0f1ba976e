"""Graphed pipeline stages on 2 GPUs: record one step, capture all, replay; losses as eager's.

Each run is ``tools/train_gpt.py --framework torch --pp 2`` in its own processes (NCCL),
fp32 (TF32 off in the trainer's fp32 path is not assumed: tolerances allow TF32), dropout on.
Skipped without 2 GPUs.
"""
import functools

import pytest
import torch

pytestmark = pytest.mark.two_gpus

from tools.bench_pipeline import run_one  # noqa: E402

BASE = ["--framework", "torch", "--pp", "2", "--hidden", "256", "--layers", "4", "--heads", "4", "--vocab", "512",
        "--seq-len", "128", "--micro-batch-size", "2", "--micro-batches", "6", "--steps", "8", "--dropout", "0.1",
        "--seed", "7", "--timeout", "90", "--lr", "3e-4"]


def _losses(extra):
    r = run_one(BASE + extra, timeout=150)
    assert "error" not in r, r
    return r


@functools.lru_cache(maxsize=None)
def _eager_losses(vpp):
    """The eager run of a schedule, once for every graphed setting compared with it (each run is
    a 2-process training job, which the suite on two GPUs pays for in time)."""
    return _losses(["--vpp", vpp])


@pytest.mark.parametrize("graph, vpp", [([], "1"), ([], "2"), (["--no-graph-accumulate-grads"], "2"),
                                        (["--graph-memory", "per_graph"], "1")],
                         ids=["default-1", "default-2", "no_accumulate-2", "per_graph-1"])
def test_graphed_pipeline_losses_equal_eager_with_dropout(vpp, graph):
    """The defaults under both schedules; each other setting under one of them (every run is a
    2-process job: the suite on two GPUs runs four fewer this way)."""
    eager = _eager_losses(vpp)
    graphed = _losses(["--vpp", vpp, "--cudagraph", *graph])
    assert len(graphed["losses"]) == len(eager["losses"]) == 8
    for a, b in zip(graphed["losses"], eager["losses"]):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (graphed["losses"], eager["losses"])
    reports = [r["memory_report"] for r in graphed["per_rank"] if r.get("memory_report")]
    assert reports and all(rep["torch"]["graphs_captured"] > 0 for rep in reports)


# ------------------------------------------- a new signature and a failed capture, over NCCL
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule, fault", [("1f1b", ["--shorten-at", "4"]),
                                             ("interleaved_1f1b", ["--fail-capture-rank", "1"])],
                         ids=["shorter-sequences-from-step-4-1f1b", "capture-fails-on-rank-1-interleaved_1f1b"])
def test_graphed_stages_stay_equal_to_eager_through_a_new_signature_and_a_failed_capture(schedule, fault, tmp_path):
    """unittests/workers/torch_pipeline_worker.py on 2 GPUs (fp32, TF32 off, dropout): shorter
    sequences from step 4 on (new stages and schedule around the same graphed modules: a second
    signature is captured beside the first), or a layer whose capture fails on rank 1 under
    fallback='eager' (that run goes on eagerly, the rest replays). Losses and every parameter
    gradient of every step as the plain stages' (benchmarks/results/gpu-tests-h200x4.json).
    Each fault under one schedule (the failed capture under the interleaved one, which has a
    chunk per graph on rank 1): the whole suite on two GPUs must fit one 10-minute device call."""
    from testing.parity import TOLERANCE, rel
    from unittests.pipeline_ranks import assert_captured_once_and_replayed, graphed_against_eager, run_pipeline_ranks

    steps = 8
    results = run_pipeline_ranks(["--device", "cuda", "--schedule", schedule, "--steps", str(steps), *fault],
                                 tmp_path, timeout=240)
    eager, graphed, worst_grad = graphed_against_eager(results)
    assert eager.shape[0] == steps and rel(graphed, eager) <= TOLERANCE, (graphed, eager)
    assert worst_grad[0] <= TOLERANCE, worst_grad
    runs = {rank: data["graphed"]["graphed_runs"] for rank, data in results.items()}
    if fault[0] == "--shorten-at":
        at = int(fault[1])
        assert_captured_once_and_replayed(runs, [at, steps - at])
    else:
        eager_runs = [r for r in runs[1] if r["captures"] == 0]
        assert len(eager_runs) == len({r["chunk"] for r in runs[1]}), runs  # one per chunk of rank 1
        assert all(r["replays"] == 0 and r["graphs"] == 0 for r in eager_runs)
        assert_captured_once_and_replayed({0: runs[0], 1: [r for r in runs[1] if r["captures"] > 0]}, [steps],
                                          dropped=True)
