"""tools/bench_rounds.py's summary (its runs need GPUs) and its argument checks."""
import pytest

from tools.diagnostics import bench_rounds


def _run(tps, losses):
    return {"tokens_per_s": tps, "losses": losses, "per_rank": [{"peak_mem_mib": 100.0}, {"peak_mem_mib": 120.0}]}


def test_medians_spreads_and_loss_differences_per_variant():
    records = {
        "eager": [_run(100.0, [5.0, 4.0]), _run(80.0, [5.0, 4.5])],
        "graphed": [_run(200.0, [5.0, 4.1]), _run(210.0, [5.0, 4.1]), {"error": "timed out"}],
        "broken": [{"error": "exit code 1"}],
    }
    out = bench_rounds.summarize(records)
    assert out["eager"]["tokens_per_s_median"] == 90.0 and out["eager"]["spread"] == 1.25
    assert out["eager"]["loss_spread_own_rounds"] == 0.5 and out["eager"]["loss_diff_vs_first"] == 0.0
    assert out["graphed"]["speed_vs_first"] == 205.0 / 90.0
    assert out["graphed"]["loss_spread_own_rounds"] == 0.0
    assert abs(out["graphed"]["loss_diff_vs_first"] - 0.1) < 1e-12
    assert out["graphed"]["peak_mem_mib_per_rank"] == [100.0, 120.0]
    assert out["broken"] == {"error": "exit code 1"}


def test_a_variant_must_be_named(capsys):
    with pytest.raises(SystemExit):
        bench_rounds.main(["--name", "x", "--base=--pp 2", "--variant", "graphed"])
    assert "write NAME=ARGS" in capsys.readouterr().err
