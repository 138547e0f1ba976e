"""tools/bench_compile.py on CPU: the worker commands, the group plan, the round order, the summary,
and the cross-process rounds with tiny fake workers (one exits, one hangs, one fails as
reduce-overhead does) that speak compile_worker's protocol. The model runs need a GPU."""
import json
import sys
import textwrap
import time

import pytest

from tools import bench_compile
from tools.compile_worker import VARIANTS

FAKE_WORKER = textwrap.dedent("""
    import json, sys, time
    name, mode, log = sys.argv[1:4]
    def reply(obj):
        print(json.dumps(obj), flush=True)
    print("fake worker log line on stdout, not JSON", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "warm":
            if mode == "exit":
                print("fake: dying in warm", file=sys.stderr, flush=True)
                sys.exit(3)
            if mode == "hang-warm":
                time.sleep(60)
            if mode == "failed":
                reply({"event": "failed", "error": "RuntimeError: overwritten", "tried": [{"approach": "a"}]})
                sys.exit(1)
            reply({"event": "ready", "first_step_s": 2.0, "losses": [5.0, 4.0], "peak_reserved_mib": 100.0})
        elif cmd[0] == "run":
            if mode == "hang":
                time.sleep(60)
            with open(log, "a") as f:
                f.write(name + "\\n")
            reply({"event": "ran", "steps": int(cmd[1]), "seconds": 0.2 if mode == "fast" else 0.4})
        elif cmd[0] == "profile":
            with open(log, "a") as f:
                f.write("profile-" + name + "\\n")
            reply({"event": "profiled", "steps": int(cmd[1]), "compute_busy": 0.8 if mode == "fast" else 0.95})
        elif cmd[0] == "done":
            reply({"event": "done", "steady_peak_reserved_mib": 90.0})
            sys.exit(0)
""")


def _fakes(tmp_path, modes: dict) -> tuple:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    log = tmp_path / "runs.log"
    return {name: [sys.executable, str(script), name, mode, str(log)] for name, mode in modes.items()}, log


def test_dry_run_prints_one_worker_command_per_variant_and_shape(capsys):
    assert bench_compile.main(["--dry-run", "--groups", "one"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if not l.startswith("#")]
    pairs = [(l.split()[l.split().index("--variant") + 1], l.split()[l.split().index("--shape") + 1]) for l in lines]
    assert sorted(pairs) == sorted((v, s) for v in VARIANTS for s in ("small", "1b"))
    assert all("compile_worker.py" in l and "--micro-batches 4 --warmup 6" in l for l in lines)


def test_dry_run_by_default_splits_1b_in_two_groups_each_with_compile(capsys):
    assert bench_compile.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    headers = [l for l in out.splitlines() if l.startswith("#")]
    assert headers == ["# small, group 1: " + ", ".join(VARIANTS),
                       "# 1b, group 1: compile, ours_compiled, ours, ours_whole, ours_whole_compiled, ours_whole_step",
                       "# 1b, group 2: compile, eager, reduce_overhead, ours_compiled_model"]
    assert out.count("--variant compile --shape 1b") == 2


def test_group_plan():
    assert bench_compile.plan_groups("1b", ["eager", "ours"], "auto") == [["eager", "ours"]]
    assert bench_compile.plan_groups("1b", ["compile", "ours", "eager", "ours_compiled"], "auto") == [
        ["compile", "ours_compiled", "ours"], ["compile", "eager"]]
    assert bench_compile.plan_groups("1b", ["compile", "ours"], "compile,ours;compile") == [["compile", "ours"]]
    assert bench_compile.plan_groups("1b", ["compile"], "compile") == [["compile"]]
    with pytest.raises(ValueError, match="leaves out ours"):
        bench_compile.plan_groups("small", ["compile", "ours"], "compile")
    with pytest.raises(SystemExit):
        bench_compile.parse_args(["--variants", "eager,bogus"])


def test_round_order_alternates():
    assert bench_compile.round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def test_timing_of_a_record():
    rec = bench_compile.variant_record({"round_seconds": [0.3, 0.6, 0.4]}, tokens_per_step=1000, iters=2)
    assert rec["median_s_per_step"] == 0.2 and rec["tokens_per_s"] == 5000.0
    assert rec["spread"] == 2.0 and rec["rounds"] == 3
    assert bench_compile.variant_record({"round_seconds": []}, tokens_per_step=1, iters=1)["error"] == "no timed round"
    assert bench_compile.variant_record({"error": "x"}, tokens_per_step=1, iters=1) == {"error": "x"}


def _ok(tps, losses=None, **extra):
    return {"tokens_per_s": tps, "losses": losses or [5.0, 4.0], **extra}


def test_summary_ratios_loss_error_and_reduce_overhead():
    shapes = {
        "small": {"groups": [{"eager": _ok(100.0), "compile": _ok(200.0, [5.0, 4.0]), "ours": _ok(300.0),
                              "ours_compiled": _ok(400.0, [5.05, 4.0]),
                              "reduce_overhead": {"error": "RuntimeError: overwritten", "tried": []}}]},
        "1b": {"groups": [{"compile": _ok(50.0, [2.0, 1.0]), "ours_compiled": _ok(60.0, [2.0, 1.1])},
                          {"compile": _ok(40.0), "reduce_overhead": _ok(48.0, approach="b")}]},
    }
    s = bench_compile.summarize(shapes)
    assert set(s) == {"ours_compiled_vs_compile_1b", "ours_compiled_vs_ours_small", "ours_compiled_vs_compile_small",
                      "loss_max_rel_err_vs_compile", "reduce_overhead", "ours_whole_vs_reduce_overhead_small",
                      "ours_whole_step_vs_reduce_overhead_small", "ours_whole_vs_compile_1b",
                      "ours_whole_uncompiled_vs_reduce_overhead_small", "whole_loss_max_rel_err_vs_compile",
                      "tiny_us_per_step"}
    assert s["ours_compiled_vs_compile_1b"] == pytest.approx(1.2)
    assert s["ours_compiled_vs_ours_small"] == pytest.approx(4 / 3)
    assert s["ours_compiled_vs_compile_small"] == pytest.approx(2.0)
    assert s["loss_max_rel_err_vs_compile"] == pytest.approx(0.1)  # 1b's second step: |1.1 - 1| / 1
    assert s["reduce_overhead"]["small"] == {"error": "RuntimeError: overwritten"}
    assert s["reduce_overhead"]["1b"] == {"tokens_per_s": 48.0, "approach": "b", "vs_compile": pytest.approx(1.2)}


def test_summary_of_the_whole_scopes_against_reduce_overhead_and_compile():
    shapes = {
        "small": {"groups": [{"compile": _ok(100.0, [5.0, 4.0]), "reduce_overhead": _ok(200.0),
                              "ours_whole": _ok(240.0), "ours_whole_compiled": _ok(300.0, [5.0, 4.2]),
                              "ours_whole_step": _ok(400.0)}]},
        "1b": {"groups": [{"compile": _ok(50.0), "ours_whole_compiled": _ok(60.0)}]},
        "tiny": {"groups": [{"reduce_overhead": _ok(10.0, median_s_per_step=0.02), "ours_whole_step": {"error": "CaptureError: x"}}]},
    }
    s = bench_compile.summarize(shapes)
    assert s["ours_whole_vs_reduce_overhead_small"] == pytest.approx(1.5)  # the compiled whole model
    assert s["ours_whole_uncompiled_vs_reduce_overhead_small"] == pytest.approx(1.2)
    assert s["ours_whole_step_vs_reduce_overhead_small"] == pytest.approx(2.0)
    assert s["ours_whole_vs_compile_1b"] == pytest.approx(1.2)
    assert s["whole_loss_max_rel_err_vs_compile"]["ours_whole_compiled"] == pytest.approx(0.05)
    assert s["tiny_us_per_step"]["ours_whole_step"] is None and s["tiny_us_per_step"]["reduce_overhead"] == 20000.0


def test_summary_is_null_where_a_variant_failed_or_did_not_run():
    shapes = {"1b": {"groups": [{"compile": _ok(50.0), "ours_compiled": {"error": "exit code 1"}}]}}
    s = bench_compile.summarize(shapes)
    assert s["ours_compiled_vs_compile_1b"] is None
    assert s["ours_compiled_vs_ours_small"] is None and s["ours_compiled_vs_compile_small"] is None
    assert s["loss_max_rel_err_vs_compile"] is None
    assert s["reduce_overhead"] == {"1b": None}


def test_ratios_only_within_a_group():
    shapes = {"1b": {"groups": [{"compile": _ok(50.0)}, {"ours_compiled": _ok(60.0)}]}}
    assert bench_compile.summarize(shapes)["ours_compiled_vs_compile_1b"] is None


def test_a_worker_that_exits_hangs_or_fails_is_reported_and_the_others_go_on(tmp_path):
    commands, log = _fakes(tmp_path, {"a": "fast", "b": "exit", "c": "hang", "d": "failed", "e": "slow"})
    start = time.monotonic()
    raw = bench_compile.run_group(commands, iters=2, rounds=3, warm_timeout=20, reply_timeout=1.0,
                                  deadline=time.monotonic() + 60)
    assert time.monotonic() - start < 15
    assert log.read_text().split() == ["a", "e", "e", "a", "a", "e"]  # c hung on its first run
    assert raw["a"]["round_seconds"] == [0.2] * 3 and raw["a"]["steady_peak_reserved_mib"] == 90.0
    assert raw["a"]["first_step_s"] == 2.0 and "error" not in raw["a"] and "error" not in raw["e"]
    assert raw["b"]["error"] == "exited before replying to 'warm'" and raw["b"]["exit_code"] == 3
    assert "dying in warm" in raw["b"]["stderr_tail"]
    assert raw["c"]["error"] == "no reply to 'run 2' within 1 s" and raw["c"]["exit_code"] != 0
    assert raw["c"]["first_step_s"] == 2.0  # what it did before it hung is kept
    assert raw["d"]["error"] == "RuntimeError: overwritten" and raw["d"]["tried"] == [{"approach": "a"}]
    rec = bench_compile.variant_record(raw["e"], tokens_per_step=800, iters=2)
    assert rec["tokens_per_s"] == pytest.approx(4000.0) and rec["spread"] == 1.0


def test_after_the_rounds_each_worker_profiles_and_compile_s_busy_share_bounds_graphing(tmp_path):
    commands, log = _fakes(tmp_path, {"compile": "slow", "ours_compiled": "fast", "gone": "exit"})
    raw = bench_compile.run_group(commands, iters=1, rounds=2, warm_timeout=20, deadline=time.monotonic() + 60,
                                  profile_steps=3)
    # profiled after every round, once each, the failed worker skipped
    assert log.read_text().split() == ["compile", "ours_compiled", "ours_compiled", "compile",
                                       "profile-compile", "profile-ours_compiled"]
    assert raw["compile"]["profile"] == {"steps": 3, "compute_busy": 0.95}
    assert "profile" not in raw["gone"]


def test_the_ceiling_puts_kernel_time_beside_step_time():
    def rec(step_s, busy_ms):
        return {"tokens_per_s": 1.0, "median_s_per_step": step_s, "profile": {"busy_ms": busy_ms}}

    shapes = {"1b": {"groups": [{"compile": rec(0.110, 100.0), "ours_compiled": rec(0.105, 90.0),
                                 "reduce_overhead": rec(0.104, 101.0)}]},
              "small": {"groups": [{"compile": {"tokens_per_s": 1.0, "median_s_per_step": 0.05}}]}}
    ceiling = bench_compile.graphing_ceiling(shapes)
    assert ceiling["1b"]["compile_idle_ms"] == pytest.approx(10.0)
    assert ceiling["1b"]["compile_graphed_max"] == pytest.approx(1.1)  # compile's kernels with no idle time
    assert ceiling["1b"]["ours_compiled_max"] == pytest.approx(110 / 90, abs=1e-4)
    assert ceiling["1b"]["ours_compiled_idle_ms"] == pytest.approx(15.0)
    assert ceiling["1b"]["reduce_overhead_idle_ms"] == pytest.approx(3.0)
    assert ceiling["small"] is None  # compile was not profiled there


def test_resummarize_rewrites_summary_and_ceiling_from_the_stored_runs(tmp_path):
    record = tmp_path / "compile-x.json"
    shapes = {"1b": {"groups": [{"compile": _ok(50.0, median_s_per_step=0.2, profile={"busy_ms": 180.0}),
                                 "ours_compiled": _ok(60.0, median_s_per_step=0.1667, profile={"busy_ms": 150.0})}]}}
    record.write_text(json.dumps({"shapes": shapes, "summary": {"stale": True}}))
    assert bench_compile.main(["--resummarize", str(record)]) == 0
    out = json.loads(record.read_text())
    assert out["summary"]["ours_compiled_vs_compile_1b"] == pytest.approx(1.2)
    assert out["graphing_ceiling"]["1b"]["ours_compiled_max"] == pytest.approx(200 / 150, abs=1e-4)
    assert "stale" not in out["summary"] and out["summary_code_version"]


def test_no_profile_unless_asked(tmp_path):
    commands, log = _fakes(tmp_path, {"a": "fast"})
    raw = bench_compile.run_group(commands, iters=1, rounds=1, warm_timeout=20, deadline=time.monotonic() + 30)
    assert "profile" not in raw["a"] and log.read_text().split() == ["a"]
    with pytest.raises(SystemExit):
        bench_compile.parse_args(["--profile-steps", "-1"])


def test_a_worker_hanging_in_its_warmup_is_stopped_at_the_limit(tmp_path):
    commands, _ = _fakes(tmp_path, {"a": "fast", "b": "hang-warm"})
    raw = bench_compile.run_group(commands, iters=1, rounds=2, warm_timeout=1.5, deadline=time.monotonic() + 30)
    assert raw["b"]["error"].startswith("no reply to 'warm' within")
    assert raw["a"]["round_seconds"] == [0.2, 0.2]


def test_the_budget_cuts_the_rounds_short(tmp_path):
    commands, _ = _fakes(tmp_path, {"a": "fast"})
    raw = bench_compile.run_group(commands, iters=1, rounds=3, warm_timeout=5, deadline=time.monotonic() + 0.5)
    assert raw["a"]["round_seconds"] == [] and raw["a"]["note"] == "rounds cut short: time budget spent"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on a GPU the worker would build the model")
def test_the_real_worker_without_cuda_reports_its_error_as_a_reply():
    args = bench_compile.parse_args(["--shapes", "small", "--variants", "eager"])
    raw = bench_compile.run_group({"eager": bench_compile.worker_command("eager", "small", args)}, iters=1, rounds=1,
                                  warm_timeout=60, deadline=time.monotonic() + 60)
    assert raw["eager"]["error"] and raw["eager"]["exit_code"] == 1  # no CUDA: a reply, then exit 1
    assert "Traceback" in raw["eager"]["stderr_tail"] and raw["eager"]["round_seconds"] == []


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on a GPU main() would run the benchmark")
def test_without_cuda_main_refuses_and_the_versions_it_records_are_readable(capsys):
    assert bench_compile.main(["--shapes", "small"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert bench_compile.benchlib.code_version()  # read before the run: a failure there costs no GPU time
