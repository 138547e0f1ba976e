"""tools/bench_hybrid.py on CPU: the run plan (two identical TP=1 eager runs around the rounds,
a training that warms its rate up) and the summary's loss judgement from made-up runs. Its runs
need 2 or 4 GPUs."""
import json

import pytest

from tools import bench_hybrid
from tools.benchlib import BF16_LOSS_RTOL, loss_check
from tools.train_gpt import parse_args, validate


def test_each_length_has_tp1_eager_before_and_after_alternating_rounds():
    runs = bench_hybrid.plan(2, pp=2, seqs=(512, 2048))
    labels = [label for label, seq, _ in runs if seq == 512]
    assert labels == ["tp1_eager", "eager", "graphed", "graphed", "eager", "tp1_eager"]
    assert [seq for _, seq, _ in runs] == [512] * 6 + [2048] * 6
    first, last = (args for label, seq, args in runs if seq == 512 and label == "tp1_eager")
    assert first == last  # identical runs: their difference is the eager spread
    for label, seq, args in runs:
        cfg = parse_args(args)
        validate(cfg)
        assert (cfg.tp, cfg.pp, cfg.seq_len) == (1 if label == "tp1_eager" else 2, 2, seq)
        assert cfg.cudagraph == (label == "graphed")
        assert (cfg.lr, cfg.lr_warmup, cfg.dropout, cfg.steps) == (2e-5, 3, 0.0, 10)
        assert cfg.lr_warmup < cfg.steps  # the rate reaches its peak within the run


def run(losses, tps=100.0):
    return {"command": "x", "tokens_per_s": tps, "losses": losses, "peak_mem_mib": 100.0,
            "steady_peak_mem_mib": 90.0, "graphs_active": True}


def test_tp2_losses_are_judged_against_the_spread_of_two_identical_tp1_runs():
    records = {
        (512, "tp1_eager"): [run([10.0, 8.0, 6.0]), run([10.0, 8.0, 6.3])],  # spread 5%
        (512, "eager"): [run([10.0, 8.1, 6.2], 50.0)],
        (512, "graphed"): [run([10.0, 8.1, 6.2], 200.0)],
        (2048, "tp1_eager"): [run([10.0, 8.0, 6.0]), run([10.0, 8.0, 6.0])],  # bit-identical: the floor judges
        (2048, "eager"): [run([10.0, 8.0, 6.03], 80.0)],
        (2048, "graphed"): [run([10.0, 8.0, 6.03], 120.0)],
    }
    by_seq, summary = bench_hybrid.summarize_hybrid(records, [512, 2048])
    assert summary["speed_vs_eager_seq512"] == 4.0 and summary["speed_vs_eager_seq2048"] == 1.5
    assert summary["eager_loss_spread"] == pytest.approx(0.05)
    assert summary["loss_max_rel_err"] == pytest.approx(0.2 / 6.0)
    assert summary["loss_judged_by"] == {"seq512": "reference_spread", "seq2048": "floor"}
    assert summary["loss_tolerance"] == {"seq512": pytest.approx(0.05), "seq2048": BF16_LOSS_RTOL}
    assert summary["loss_within_eager_spread"] is True and summary["loss_falls"] is True
    assert by_seq["seq2048"]["loss_vs_tp1"]["max_rel_err"] == pytest.approx(0.005)
    assert summary["graphed_vs_eager_loss_max_rel_err"] == 0.0  # graphed TP=2 as eager TP=2 at every step
    assert summary["graphed_within_eager_spread"] is True and summary["eager_tp2_loss_spread"] is None

    records[(2048, "graphed")] = [run([10.0, 8.0, 6.1])]  # 1.7% with no spread to cover it
    summary = bench_hybrid.summarize_hybrid(records, [512, 2048])[1]
    assert summary["loss_within_eager_spread"] is False
    assert summary["graphed_vs_eager_loss_max_rel_err"] == pytest.approx(0.07 / 6.03)
    records[(2048, "graphed")] = [run([10.0, 12.0, 10.5])]  # diverges: the loss ends above its start
    summary = bench_hybrid.summarize_hybrid(records, [512, 2048])[1]
    assert summary["loss_falls"] is False and summary["loss_within_eager_spread"] is False


def test_graphed_runs_are_held_to_the_spread_of_identical_eager_tp2_runs_without_a_floor(tmp_path):
    records = {(512, "tp1_eager"): [run([10.0, 8.0]), run([10.0, 8.0])],
               (512, "eager"): [run([10.0, 8.0]), run([10.0, 8.002])],  # spread 2.5e-4
               (512, "graphed"): [run([10.0, 8.001]), run([10.0, 8.0])]}
    summary = bench_hybrid.summarize_hybrid(records, [512])[1]
    assert summary["eager_tp2_loss_spread"] == pytest.approx(2.5e-4)
    assert summary["graphed_within_eager_spread"] is True
    records[(512, "graphed")] = [run([10.0, 8.004])]  # 5e-4: inside the bf16 floor, outside the spread
    summary = bench_hybrid.summarize_hybrid(records, [512])[1]
    assert summary["loss_within_eager_spread"] is True and summary["graphed_within_eager_spread"] is False

    path = tmp_path / "hybrid-tp2pp2-x.json"  # a record written before the key existed
    path.write_text(json.dumps({"summary": {}, "runs": {f"seq{s}_{n}": v for (s, n), v in records.items()}}))
    assert bench_hybrid.main(["--resummarize", str(path)]) == 0
    rewritten = json.loads(path.read_text())
    assert rewritten["summary"]["graphed_within_eager_spread"] is False
    assert rewritten["runs"]["seq512_graphed"] == records[(512, "graphed")]


def test_without_a_second_tp1_run_or_with_failed_runs_the_check_says_so():
    records = {(512, "tp1_eager"): [run([10.0, 8.0]), {"error": "skipped: time budget spent"}],
               (512, "eager"): [run([10.0, 8.05])], (512, "graphed"): [{"error": "exit code 1"}]}
    by_seq, summary = bench_hybrid.summarize_hybrid(records, [512])
    assert summary["eager_loss_spread"] is None and summary["loss_judged_by"] == {"seq512": "floor"}
    assert summary["loss_within_eager_spread"] is True  # 0.6% against the floor; the failed run has no losses
    assert summary["speed_vs_eager_seq512"] is None


def test_loss_check_edge_cases():
    assert loss_check([], [[1.0]], floor=0.01)["within"] is False  # no reference
    assert loss_check([[1.0, 0.9]], [], floor=0.01)["within"] is False  # nothing under test
    assert loss_check([[1.0, 0.9]], [[1.0]], floor=0.5)["within"] is False  # a run stopped early
    check = loss_check([[2.0, 1.0], [2.0, 1.1]], [[2.0, 1.05]], floor=0.01)
    assert check["reference_spread"] == pytest.approx(0.1) and check["max_rel_err"] == pytest.approx(0.05)
    assert check["within"] is True and check["judged_by"] == "reference_spread"


def test_dry_run_prints_the_plan(capsys):
    assert bench_hybrid.main(["--dry-run", "--rounds", "1", "--seqs", "512", "--pp", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[0].startswith("tp1_eager") and lines[-1].startswith("tp1_eager")
    assert all("--pp 1" in line and "--lr-warmup 3" in line for line in lines)
