"""tools/bench_peer_megatron.py on CPU: the run plan (no Megatron needed) and, when Megatron-Core
is importable, a tiny model through every variant on 2 gloo ranks (graphs need CUDA: Megatron's
variant then runs its DDP/main_grad path without graphs, ours runs eagerly) with equal losses."""
import importlib.util
import json
import os
import sys

import pytest

from tools import bench_peer_megatron, launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tools", "bench_peer_megatron.py")


def test_dry_run_lists_every_variant_and_length(capsys):
    assert bench_peer_megatron.main(["--pp", "1", "--profile", "--dry-run"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if not l.startswith("#")]
    labels = [l.split()[0] for l in lines]
    assert labels[:6] == ["eager@seq512", "megatron@seq512", "ours@seq512",
                          "eager@seq2048", "megatron@seq2048", "ours@seq2048"]
    assert labels[6:] == ["eager_repeat@seq512", "eager_repeat@seq2048"]  # dropped first when time runs out
    profiled = [l.split()[0] for l in lines if "--profile" in l]
    assert profiled == ["megatron@seq512", "ours@seq512"]
    assert all("--pp 1" in l for l in lines)


def test_headline_ratios_are_ours_over_megatron():
    rows = {"seq512": {"ours": {"tokens_per_s": 300.0}, "megatron": {"tokens_per_s": 200.0, "graphs_per_rank": [48]}},
            "seq2048": {"ours": {"tokens_per_s": 90.0, "peak_reserved_mib": 800.0, "steady_reserved_mib": 500.0},
                        "megatron": {"error": "RuntimeError: ..."}}}
    h = bench_peer_megatron.headline(rows)
    assert h["ours_vs_megatron_speed_seq512"] == 1.5
    assert h["ours_vs_megatron_speed_seq2048"] is None and h["ours_vs_megatron_peak_mem"] is None
    assert h["megatron_graphs_ran"] is True


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_tiny_model_every_variant_on_two_cpu_ranks():
    end = launch.run([sys.executable, SCRIPT, "--device", "cpu", "--pp", "2", "--rounds", "2"], cwd=REPO, timeout=400)
    assert end.returncode == 0, end.stdout[-3000:] + end.stderr[-3000:]
    payload = json.loads([l for l in end.stdout.splitlines() if l.startswith('{"command"')][-1])
    rows = payload["by_config"]["seq32"]
    for variant in ("megatron", "ours", "eager_repeat"):
        assert rows[variant]["max_abs_loss_diff_vs_eager"] == 0.0, variant
