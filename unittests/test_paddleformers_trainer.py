"""PaddleFormers' own ``Trainer`` running a ``LlamaForCausalLMPipe`` with graphs (CPU, gloo): pp=2
1F1B through both routes, and pp=4 x vpp=2 interleaved through graph_pipeline.

Launches unittests/workers/paddleformers_trainer_worker.py under
``python -m paddle.distributed.launch --nproc_per_node 2``: the Trainer trains a tiny tied Llama
4 optimizer steps of 4 accumulated micro-batches (1F1B, ``max_grad_norm=1.0``, a linear schedule
with warmup, fp32), saving every 2 steps, without graphs, after ``graph_pipeline(model)`` and under
``install(default_use_cudagraph=True)``; each route then resumes from its step-2 checkpoint, an
ungraphed model resumes from each graphed route's step-2 checkpoint, and each graphed route's
final checkpoint is loaded into an ungraphed model. The same at pp=4 x vpp=2 on 4 ranks (8 layers,
8 accumulated micro-batches, graph_pipeline only). Losses, grad norms, learning rates and final
weights (by digest) must be identical everywhere. The graphed runs execute eagerly on CPU, so this
checks the wiring under the Trainer (its micro-batch buffering, ``forward_backward_pipeline``,
its optimizer step, clipping, scheduler and checkpoints), not graph replay.

PaddleFormers 1.2.0's own fp32/CPU defects are worked around in test support
(unittests/workers/paddleformers_cpu.py). Needs ``pip install --no-deps paddleformers==1.2.0``
(after the test requirements; see requirements-examples.txt); skipped without it, quoting that line. The launch runs in its own session under a
time limit and is retried when gloo fails to connect inside ``fleet.init``.
"""

import math
import os

import pytest

from installs import skip_without_paddleformers

pytest.importorskip("paddle")
skip_without_paddleformers(allow_module_level=True)

from workers.fleet_ranks import launch_workers  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "unittests", "workers", "paddleformers_trainer_worker.py")
GRAPHED = ("graph_pipeline", "install")
STEPS, ACCUMULATION, SAVE_STEPS = 4, 4, 2
SHARED = "shared:model_shared_weight: shared weights (gradients synced across stages)"


def same_training(run, reference, label, *, from_step=1):
    """``run`` logged the same steps as ``reference`` from ``from_step`` on and ended with the same weights."""
    skip = from_step - 1
    for key in ("steps", "losses", "grad_norms", "learning_rates"):
        assert run[key] == reference[key][skip:], f"{label}: {key} {run[key]} != {reference[key][skip:]}"
    differing = sorted(k for k in reference["weights"] if run["weights"].get(k) != reference["weights"][k])
    assert run["weights"].keys() == reference["weights"].keys() and not differing, \
        f"{label}: final weights differ in {differing[:6]}"


def check_trainer_runs(results, nranks, routes, steps, accumulation, save_steps):
    """Every graphed route trained, resumed and checkpointed exactly as the ungraphed Trainer."""
    assert sorted(results) == list(range(nranks))
    for rank, data in results.items():
        eager = data["eager"]
        assert eager["steps"] == list(range(1, steps + 1)), eager["steps"]
        assert not any(math.isnan(loss) for loss in eager["losses"])
        # clipping acts (every step's norm is above max_grad_norm) and the schedule moves
        assert min(eager["grad_norms"]) > 1.0, eager["grad_norms"]
        assert len(set(eager["learning_rates"])) == steps, eager["learning_rates"]
        # resuming without graphs reproduces the uninterrupted run
        same_training(eager["resumed"], eager, f"rank {rank} eager resumed", from_step=save_steps + 1)
        for route in routes:
            graphed = data[route]
            same_training(graphed, eager, f"rank {rank} {route}")
            # every graphed run took part in every accumulated micro-batch of every step
            assert graphed["graphed_calls"] == [steps * accumulation], graphed["graphed_calls"]
            assert graphed["resumed"]["graphed_calls"] == [(steps - save_steps) * accumulation]
            same_training(graphed["resumed"], eager, f"rank {rank} {route} resumed", from_step=save_steps + 1)
            # the graphed run's checkpoints, in a model without graphs
            same_training(graphed["eager_resumed"], eager, f"rank {rank} ungraphed model resumed from {route}",
                          from_step=save_steps + 1)
            assert graphed["eager_resumed"]["graphed_calls"] == []
            assert graphed["loaded"] == graphed["weights"], f"rank {rank}: {route}'s last checkpoint loads other weights"
            assert graphed["report"] == data[routes[0]]["report"]


def report(data, route):
    return [line.strip() for line in data[route]["report"].splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_pp2_1f1b_graphed_routes_identical_with_checkpoints(tmp_path):
    rc, seconds, logs, results = launch_workers(
        WORKER, 2, ["--steps", str(STEPS), "--accumulation", str(ACCUMULATION), "--save-steps", str(SAVE_STEPS)],
        tmp_path, timeout=300)
    assert rc == 0, f"launch failed (rc={rc}, {seconds:.0f}s)\n{logs[-6000:]}"
    check_trainer_runs(results, 2, GRAPHED, STEPS, ACCUMULATION, SAVE_STEPS)
    assert report(results[0], "install") == [
        "stage 0:", f"eager   [0] {SHARED}", "graphed [1:3) DecoderLayerPipe#1, DecoderLayerPipe#2"]
    assert report(results[1], "install") == [
        "stage 1:", "graphed [3:6) DecoderLayerPipe#3, DecoderLayerPipe#4, RMSNormPipe#5", f"eager   [6] {SHARED}"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_pp4_interleaved_graph_pipeline_identical_with_checkpoints(tmp_path):
    # fleet's interleaved schedule needs pp > 2 and 2*pp micro-batches; gloo needs one 2-rank
    # group per hop (fleet_cpu.use_hop_groups after TrainingArguments(...))
    accumulation = 8
    rc, seconds, logs, results = launch_workers(
        WORKER, 4, ["--pp", "4", "--vpp", "2", "--layers", "8", "--routes", "eager,graph_pipeline",
                    "--steps", str(STEPS), "--accumulation", str(accumulation), "--save-steps", str(SAVE_STEPS)],
        tmp_path, timeout=400)
    assert rc == 0, f"launch failed (rc={rc}, {seconds:.0f}s)\n{logs[-6000:]}"
    check_trainer_runs(results, 4, ("graph_pipeline",), STEPS, accumulation, SAVE_STEPS)
    for rank, data in results.items():
        assert data["uses_hop_groups"] is True
        lines = report(data, "graph_pipeline")
        assert lines[0] == f"stage {rank} chunk 0:" and f"stage {rank} chunk 1:" in lines
    assert report(results[3], "graph_pipeline")[-1] == f"eager   [10] {SHARED}"
