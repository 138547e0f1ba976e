"""The PaddleFormers zoo: every PaddleFormers 1.2.0 pipe class that trains eagerly on CPU at pp=2
trains identically through ``paddle_graphpp.graph_pipeline(model)`` and through
``paddle_graphpp.install(default_use_cudagraph=True)``.

The classes, their tiny configurations and the settings each needs on CPU are the table of
unittests/workers/paddleformers_zoo.py (docs/paddle.md renders it). Each case launches
unittests/workers/paddleformers_worker.py ``--model NAME`` on two CPU ranks (gloo, fleet 1F1B,
4 micro-batches, 3 steps), tied and untied where the class supports tied embeddings, and checks
what test_paddleformers_pipe.py checks for Llama (``check_routes_agree``): the same per-step
losses through the three routes, the same state_dict keys, every graphed run called every
micro-batch; and that the segmentation graphs every decoder layer and leaves the tied
embedding/head eager. The MoE classes' decoder layers read the host in their experts' dispatch:
they stay eager, graphed in parts (attention and router graphed in place, every part's graph
called every micro-batch; experts eager), their dense layers graphed whole. The graphed runs execute eagerly on
CPU, so this checks the wiring, not capture (test_paddle_moe_parts.py counts captures and replays
of the parts with a fake runtime).

Needs ``pip install --no-deps paddleformers==1.2.0``; skipped without it, quoting that line.
"""

import os
import subprocess
import sys

import pytest

from installs import skip_without_paddleformers

pytest.importorskip("paddle")
skip_without_paddleformers(allow_module_level=True)

from workers.fleet_ranks import launch_workers  # noqa: E402
from workers.paddleformers_zoo import CASES, NOT_COVERED, SHARED, check_routes_agree  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "unittests", "workers", "paddleformers_worker.py")
STEPS, MICRO = 3, 4


def trainable_cases():
    """(name, tie) of every case that trains: tied and untied where the class supports tying."""
    return [pytest.param(case.name, tie, id=f"{case.name}-{'tied' if tie else 'untied'}")
            for case in CASES.values() if not case.not_trainable
            for tie in ((True, False) if case.tie else (False,))]


@pytest.mark.slow
@pytest.mark.timeout(600)  # 10-35 s measured; launch_workers retries a launch stuck in fleet.init
@pytest.mark.parametrize("name,tie", trainable_cases())
def test_pipe_class_pp2_1f1b_identical_through_both_routes(tmp_path, name, tie):
    case = CASES[name]
    rc, seconds, logs, results = launch_workers(
        WORKER, 2, ["--model", name, "--tie", str(int(tie)), "--steps", str(STEPS), "--micro-batches", str(MICRO)],
        tmp_path, timeout=240)
    assert rc == 0, f"{case.pipe_class}: launch failed (rc={rc}, {seconds:.0f}s)\n{logs[-6000:]}"
    check_routes_agree(results, 2, STEPS, MICRO)
    print(f"{case.pipe_class} {'tied' if tie else 'untied'}: {seconds:.1f}s, losses {results[0]['eager']['losses']}")
    for rank in (0, 1):
        report = results[rank]["install"]["report"]
        print(report)
        lines = [line.strip() for line in report.splitlines()]
        graphed = [line for line in lines if line.startswith("graphed")]
        decoders = sum(line.count("DecoderLayerPipe#") for line in graphed)
        if case.router:
            check_graphed_in_parts(case, rank, report)
            continue
        assert decoders == case.layers // 2, f"rank {rank}: not every decoder layer is graphed\n{report}"
        if tie:  # the tied embedding (first stage) and head (last stage) eager, the rest one graphed run
            shared = lines[1] if rank == 0 else lines[-1]
            assert shared.endswith(SHARED) and shared.startswith("eager"), report
        assert len(graphed) == 1 and len(lines) == 2 + tie, f"rank {rank}: one graphed run expected\n{report}"


def check_graphed_in_parts(case, rank, report):
    """A mixture of experts at pp=2: its dense decoder layers on ``rank`` graphed whole, every other
    decoder layer eager and graphed in parts (its attention and router in place, a router that is a
    lone linear layer eager; its experts eager, and why), nothing marked with mark_not_capturable."""
    per_rank = case.layers // 2
    dense = max(0, min(case.dense_layers, (rank + 1) * per_rank) - rank * per_rank)
    lines = [line.strip() for line in report.splitlines()]
    graphed = [line for line in lines if line.startswith("graphed")]
    assert sum(line.count("DecoderLayerPipe#") for line in graphed) == dense, f"rank {rank}: dense layers\n{report}"
    in_parts = [i for i, line in enumerate(lines) if line.startswith("eager") and "DecoderLayerPipe#" in line]
    assert len(in_parts) == per_rank - dense, f"rank {rank}: MoE layers\n{report}"
    for i in in_parts:
        assert lines[i].endswith("graphed in parts: its own forward runs eagerly, calling the parts graphed in place")
        router = f"mlp.{case.router}"
        if case.linear_router:  # eager: a graph of one linear layer would save nothing
            assert lines[i + 1] in ("graphed in place: self_attn", "graphed in place: linear_attn"), report
            assert lines[i + 3].startswith(f"eager: {router}: a lone linear layer"), report
        else:  # graphed with its shared experts, each reading a copy of the mixture's input (own_input.py)
            shared = ", mlp.shared_experts" if case.name in ("glm4_moe", "deepseek_v3") else ""
            assert lines[i + 1] == f"graphed in place: self_attn, {router}{shared}", report
            assert f"eager: {router}" not in report and "eager: mlp.shared_experts" not in report, report
        assert lines[i + 2].startswith("eager: mlp.experts: the dispatch over the experts reads the host"), report
    assert "mark_not_capturable" not in report


def test_the_zoo_table_lists_each_class_once():
    """No class is both a case and not covered, nor twice a case; ERNIE 4.5 MoE alone does not train."""
    names = [case.pipe_class for case in CASES.values()]
    assert len(names) == len(set(names)) and not set(names) & set(NOT_COVERED)
    assert [case.name for case in CASES.values() if case.not_trainable] == ["ernie4_5_moe"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_zoo_lists_every_pipe_class_paddleformers_exports():
    """Every ``...Pipe`` / ``...PipeDeprecated`` class the installed PaddleFormers exports is a case
    or named as not covered (in a subprocess: importing PaddleFormers switches transformers'
    PyTorch support off for the whole process)."""
    code = ("import paddleformers.transformers as t; "
            "print(' '.join(n for n in dir(t) if n.endswith(('Pipe', 'PipeDeprecated'))))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, cwd=REPO)
    assert found.returncode == 0, found.stderr[-3000:]
    exported = set(found.stdout.split())
    listed = {case.pipe_class for case in CASES.values()} | set(NOT_COVERED)
    assert exported - listed == set(), f"pipe classes the zoo does not list: {sorted(exported - listed)}"
