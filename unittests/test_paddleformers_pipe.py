"""A real client: PaddleFormers' LlamaForCausalLMPipe trained by fleet on CPU ranks (gloo).

PaddleFormers builds its pipe models by subclassing fleet's ``PipelineLayer`` and calling its
constructor itself, without ``use_cudagraph``. (test_paddleformers_zoo.py runs the other pipe
classes the same way, through the same worker and ``check_routes_agree``.) Each case launches
unittests/workers/paddleformers_worker.py under ``python -m paddle.distributed.launch`` and
trains the same tiny Llama eagerly, after ``paddle_graphpp.graph_pipeline(model)`` and under
``paddle_graphpp.install(default_use_cudagraph=True)``: the per-step losses must be identical,
the decoder layers graphed and the tied embedding/head eager. The graphed runs execute eagerly
on CPU, so this checks the wiring (segmentation, names, schedule), not graph replay.

Needs ``pip install --no-deps paddleformers==1.2.0`` (after the test requirements; see
requirements-examples.txt); skipped without it, quoting that line. Each
launch runs in its own session under a time limit (testing/launch.py), and is retried when
gloo fails to connect inside ``fleet.init`` (before any code under test runs).
"""

import os

import pytest

from installs import skip_without_paddleformers

pytest.importorskip("paddle")
skip_without_paddleformers(allow_module_level=True)

from workers.fleet_ranks import launch_workers  # noqa: E402
from workers.paddleformers_zoo import ROUTES, SHARED, check_routes_agree  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "unittests", "workers", "paddleformers_worker.py")


def run_workers(nproc, args, tmp_path, timeout):
    """Run the worker on ``nproc`` ranks; returns (rc or None when stopped, seconds, logs, results by rank)."""
    return launch_workers(WORKER, nproc, args, tmp_path, timeout)


def report_lines(data):
    return [line.strip() for line in data["install"]["report"].splitlines()]



@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tie", [1, 0], ids=["tied", "untied"])
def test_llama_pipe_pp2_1f1b_identical_losses(tmp_path, tie):
    steps, micro = 4, 4
    rc, seconds, logs, results = run_workers(
        2, ["--pp", "2", "--tie", str(tie), "--steps", str(steps), "--micro-batches", str(micro)],
        tmp_path, timeout=240)
    assert rc == 0, f"launch failed (rc={rc}, {seconds:.0f}s)\n{logs[-6000:]}"
    check_routes_agree(results, 2, steps, micro)
    losses = results[0]["eager"]["losses"]
    assert losses[-1] < losses[0], f"the model did not train: {losses}"
    first, last = report_lines(results[0]), report_lines(results[1])
    if tie:  # the tied embedding and head eager, the decoder layers (and the final norm) graphed
        assert first == ["stage 0:", f"eager   [0] {SHARED}", "graphed [1:3) DecoderLayerPipe#1, DecoderLayerPipe#2"]
        assert last == ["stage 1:", "graphed [3:6) DecoderLayerPipe#3, DecoderLayerPipe#4, RMSNormPipe#5",
                        f"eager   [6] {SHARED}"]
    else:  # nothing shared: each stage is one graphed run
        assert first == ["stage 0:", "graphed [0:3) EmbeddingPipe#0, DecoderLayerPipe#1, DecoderLayerPipe#2"]
        assert last == ["stage 1:",
                        "graphed [3:7) DecoderLayerPipe#3, DecoderLayerPipe#4, RMSNormPipe#5, LMHeadPipe#6"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_llama_pipe_pp2_recompute_interval_with_graph_pipeline(tmp_path):
    # PaddleFormers builds its pipe models with recompute_interval=0 and a recompute_ctx; the
    # worker sets fleet's _recompute_interval = 1 before graph_pipeline (what graph_pipeline's
    # refusal of recompute_granularity suggests). The install route is graphed in its
    # constructor and does not recompute: recomputing changes no loss.
    steps, micro = 3, 4
    rc, seconds, logs, results = run_workers(
        2, ["--pp", "2", "--steps", str(steps), "--micro-batches", str(micro), "--recompute-interval", "1"],
        tmp_path, timeout=240)
    assert rc == 0, f"launch failed (rc={rc}, {seconds:.0f}s)\n{logs[-6000:]}"
    assert sorted(results) == [0, 1]
    reference = results[0]["eager"]["losses"]
    for rank, data in results.items():
        for route in ROUTES:
            assert data[route]["losses"] == reference, f"rank {rank} {route}: {data[route]['losses']} != {reference}"
        eager, graphed = data["eager"], data["graph_pipeline"]
        assert set(eager["forwards"].values()) == {2 * steps * micro}  # fleet recomputes every decoder layer
        assert graphed["forwards"] == eager["forwards"]  # and so do the graphed runs, inside their graphs
        assert set(data["install"]["forwards"].values()) == {steps * micro}
        assert set(graphed["graphed_calls"].values()) == {steps * micro}  # each called once per micro-batch
        lines = [line.strip() for line in graphed["report"].splitlines()]
        assert "recompute_interval=1: graphed runs recompute inside their own graphs" in lines[-1]
        assert sum(line.startswith("graphed") for line in lines) == 2 + rank  # one run per layer (and the norm)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_llama_pipe_pp4_vpp2_interleaved_identical_losses(tmp_path):
    # Fleet's interleaved schedule needs pp > 2; gloo needs one 2-rank group per hop then
    # (fleet_cpu.use_hop_groups), and 2*pp micro-batches.
    steps, micro = 3, 8
    rc, seconds, logs, results = run_workers(
        4, ["--pp", "4", "--vpp", "2", "--layers", "8", "--tie", "1", "--steps", str(steps),
            "--micro-batches", str(micro), "--micro-batch-size", "1"], tmp_path, timeout=300)
    assert rc == 0, f"launch failed (rc={rc}, {seconds:.0f}s)\n{logs[-6000:]}"
    check_routes_agree(results, 4, steps, micro)
    for rank, data in results.items():
        assert data["uses_hop_groups"] is True
        lines = report_lines(data)
        assert lines[0] == f"stage {rank} chunk 0:" and f"stage {rank} chunk 1:" in lines
        assert sum("DecoderLayerPipe" in line and line.startswith("graphed") for line in lines) == 2
    assert f"eager   [0] {SHARED}" in report_lines(results[0])
    assert report_lines(results[3])[-1] == f"eager   [10] {SHARED}"
