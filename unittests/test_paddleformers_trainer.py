"""PaddleFormers' own ``Trainer`` running a ``LlamaForCausalLMPipe`` at pp=2 with graphs (CPU, gloo).

Launches unittests/workers/paddleformers_trainer_worker.py under
``python -m paddle.distributed.launch --nproc_per_node 2``: the Trainer trains a tiny tied Llama
4 optimizer steps of 4 accumulated micro-batches (1F1B, ``max_grad_norm=1.0``, a linear schedule
with warmup, fp32), saving every 2 steps, without graphs, after ``graph_pipeline(model)`` and under
``install(default_use_cudagraph=True)``; each route then resumes from its step-2 checkpoint, an
ungraphed model resumes from each graphed route's step-2 checkpoint, and each graphed route's
final checkpoint is loaded into an ungraphed model. Losses, grad norms, learning rates and final
weights (by digest) must be identical everywhere. The graphed runs execute eagerly on CPU, so this
checks the wiring under the Trainer (its micro-batch buffering, ``forward_backward_pipeline``,
its optimizer step, clipping, scheduler and checkpoints), not graph replay.

PaddleFormers 1.2.0's own fp32/CPU defects are worked around in test support
(unittests/workers/paddleformers_cpu.py). Needs ``pip install --no-deps -r
requirements-paddleformers.txt``; skipped without it. The launch runs in its own session under a
time limit and is retried when gloo fails to connect inside ``fleet.init``.
"""

import importlib.util
import math
import os

import pytest

pytest.importorskip("paddle")
# Checked without importing it: importing paddleformers switches transformers' PyTorch support off.
if importlib.util.find_spec("paddleformers") is None:
    pytest.skip("paddleformers is not installed: pip install --no-deps -r requirements-paddleformers.txt",
                allow_module_level=True)

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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_pp2_graphed_routes_identical_with_checkpoints(tmp_path):
    rc, seconds, logs, results = launch_workers(
        WORKER, 2, ["--steps", str(STEPS), "--accumulation", str(ACCUMULATION), "--save-steps", str(SAVE_STEPS)],
        tmp_path, timeout=300)
    assert rc == 0, f"launch failed (rc={rc}, {seconds:.0f}s)\n{logs[-6000:]}"
    assert sorted(results) == [0, 1]
    for rank, data in results.items():
        eager = data["eager"]
        assert eager["steps"] == list(range(1, STEPS + 1)), eager["steps"]
        assert not any(math.isnan(loss) for loss in eager["losses"])
        # clipping acts (every step's norm is above max_grad_norm) and the schedule moves
        assert min(eager["grad_norms"]) > 1.0, eager["grad_norms"]
        assert len(set(eager["learning_rates"])) == STEPS, eager["learning_rates"]
        # resuming without graphs reproduces the uninterrupted run
        same_training(eager["resumed"], eager, f"rank {rank} eager resumed", from_step=SAVE_STEPS + 1)
        for route in GRAPHED:
            graphed = data[route]
            same_training(graphed, eager, f"rank {rank} {route}")
            # every graphed run took part in every accumulated micro-batch of every step
            assert graphed["graphed_calls"] == [STEPS * ACCUMULATION], graphed["graphed_calls"]
            assert graphed["resumed"]["graphed_calls"] == [(STEPS - SAVE_STEPS) * ACCUMULATION]
            same_training(graphed["resumed"], eager, f"rank {rank} {route} resumed", from_step=SAVE_STEPS + 1)
            # the graphed run's checkpoints, in a model without graphs
            same_training(graphed["eager_resumed"], eager, f"rank {rank} ungraphed model resumed from {route}",
                          from_step=SAVE_STEPS + 1)
            assert graphed["eager_resumed"]["graphed_calls"] == []
            assert graphed["loaded"] == graphed["weights"], f"rank {rank}: {route}'s last checkpoint loads other weights"
            assert graphed["report"] == data["graph_pipeline"]["report"]
    first = [line.strip() for line in results[0]["install"]["report"].splitlines()]
    last = [line.strip() for line in results[1]["install"]["report"].splitlines()]
    assert first == ["stage 0:", f"eager   [0] {SHARED}", "graphed [1:3) DecoderLayerPipe#1, DecoderLayerPipe#2"]
    assert last == ["stage 1:", "graphed [3:6) DecoderLayerPipe#3, DecoderLayerPipe#4, RMSNormPipe#5",
                    f"eager   [6] {SHARED}"]
