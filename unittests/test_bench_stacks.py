"""tools/bench_stacks.py on CPU: the run order, the budget, the figures from runs (medians, spreads,
ratios, loss agreement, the summary), the command line, and the worker runs with tiny fake
workers (one prints its record among other output, one fails, one hangs). The stacks need a GPU."""
import json
import sys
import textwrap

import pytest

from tools import bench_stacks

FAKE_WORKER = textwrap.dedent("""
    import json, sys, time
    mode = sys.argv[1]
    print("a library's line on stdout", flush=True)
    if mode == "ok":
        print(json.dumps({"tokens_per_s": 1000.0, "losses": [9.0, 8.5]}), flush=True)
    elif mode == "fail":
        print("Traceback: it broke", file=sys.stderr, flush=True)
        print(json.dumps({"error": "ValueError: refused"}), flush=True)
        sys.exit(1)
    elif mode == "crash":
        print("Fatal Python error: Aborted", file=sys.stderr, flush=True)
        sys.exit(134)
    elif mode == "hang":
        time.sleep(60)
""")


def _fake(tmp_path, mode):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    return [sys.executable, str(script), mode]


def _run(variant, tps, losses, *, peak=1000.0, steady=900.0, reserved=1200.0, stack="plain", **extra):
    return {"stack": stack, "variant": variant, "tokens_per_s": tps, "losses": losses, "peak_allocated_mib": peak,
            "steady_peak_allocated_mib": steady, "peak_reserved_mib": reserved,
            "steady_peak_reserved_mib": reserved - 50.0, **extra}


def test_runs_go_round_by_round_with_the_variant_order_reversed_every_round():
    runs = bench_stacks.plan(["plain", "checkpoint"], 3)
    plain = [v for _, s, v in runs if s == "plain"]
    assert plain == ["eager", "graphed", "graphed", "eager", "eager", "graphed"]
    assert [v for r, s, v in runs if s == "checkpoint" and r == 1] == ["graphed_no_checkpoint", "graphed", "eager"]
    assert [r for r, _, _ in runs] == [0] * 5 + [1] * 5 + [2] * 5  # every stack in every round


def test_the_dry_run_prints_one_worker_command_per_run(capsys):
    assert bench_stacks.main(["--dry-run", "--stacks", "fsdp2,plain", "--rounds", "2", "--steps", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    commands = [l for l in lines if not l.startswith("#")]
    assert len(commands) == 8 and all("bench_stacks.py --worker" in c and c.endswith("--steps 8") for c in commands)
    assert "--worker fsdp2 eager" in commands[0] and "--worker plain eager" in commands[-1]


def test_the_command_line():
    args = bench_stacks.parse_args([])
    assert args.stacks == list(bench_stacks.STACKS) and (args.rounds, args.steps, args.name) == (3, 12, "stacks")
    assert bench_stacks.parse_args(["--worker", "checkpoint", "graphed_no_checkpoint"]).worker == [
        "checkpoint", "graphed_no_checkpoint"]
    for bad in (["--stacks", "plain,bogus"], ["--stacks", ","], ["--stacks", "plain,plain"], ["--rounds", "0"],
                ["--steps", "4"], ["--budget", "0"], ["--worker", "plain", "graphed_no_checkpoint"],
                ["--worker", "nope", "eager"]):
        with pytest.raises(SystemExit):
            bench_stacks.parse_args(bad)


def test_the_reproduce_step_runs_this_tool_on_one_gpu():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "reproduce.py")
    spec = importlib.util.spec_from_file_location("reproduce", path)
    reproduce = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reproduce)
    (name, gpus, command, record), = [s for s in reproduce.STEPS if s[0] == "stacks"]
    assert gpus == 1 and record == "stacks-<device>.json" and command.startswith("python tools/bench_stacks.py")
    bench_stacks.parse_args(command.split()[2:])  # its options parse


def test_timing_leaves_the_warm_steps_out():
    stamps = [10.0, 12.0, 13.0, 14.0, 14.5, 15.0, 15.5]  # start, then 6 step ends
    t = bench_stacks.timing(stamps, warm=3, tokens_per_step=1000)
    assert t["timed_steps"] == 3 and t["timed_s"] == pytest.approx(1.5)
    assert t["tokens_per_s"] == pytest.approx(2000.0)
    assert t["step_ms"] == [2000.0, 1000.0, 1000.0, 500.0, 500.0, 500.0]
    short = bench_stacks.timing(stamps[:4], warm=3, tokens_per_step=1000)
    assert "tokens_per_s" not in short and short["error"] == "3 steps ran; the first 3 are not timed"


def test_loss_agreement_bit_for_bit_differences_and_the_eager_spread():
    eager = [[9.0, 8.0, 7.0], [9.0, 8.0, 7.0]]
    same = bench_stacks.loss_agreement(eager, [[9.0, 8.0, 7.0]])
    assert same["bitwise_equal"] is True and same["max_abs_diff"] == 0.0 and same["max_rel_diff"] == 0.0
    assert same["eager_bitwise_equal"] is True and same["eager_max_abs_diff"] == 0.0
    assert same["within_eager_spread"] is True and same["same_steps"] is True and same["steps"] == 3

    noisy_eager = [[9.0, 8.0, 7.0], [9.0, 8.004, 7.0]]
    off = bench_stacks.loss_agreement(noisy_eager, [[9.0, 8.0, 7.0], [9.0, 8.002, 7.007]])
    assert off["bitwise_equal"] is False
    assert off["max_abs_diff"] == pytest.approx(0.007) and off["max_rel_diff"] == pytest.approx(0.001)
    assert off["eager_bitwise_equal"] is False and off["eager_max_abs_diff"] == pytest.approx(0.004)
    assert off["within_eager_spread"] is False

    short = bench_stacks.loss_agreement(eager, [[9.0, 8.0]])  # a run that stopped early is never equal
    assert short["bitwise_equal"] is False and short["same_steps"] is False and short["max_abs_diff"] == 0.0

    alone = bench_stacks.loss_agreement([[9.0, 8.0]], [[9.0, 8.0]])  # one eager run: no spread
    assert alone["bitwise_equal"] is True and alone["eager_max_abs_diff"] is None
    assert alone["within_eager_spread"] is None
    nothing = bench_stacks.loss_agreement([], [[9.0]])
    assert nothing["bitwise_equal"] is None and nothing["max_abs_diff"] is None


def test_a_stack_s_medians_spreads_and_ratios_against_eager():
    runs = [_run("eager", 100.0, [9.0, 8.0]), _run("graphed", 300.0, [9.0, 8.0], peak=1100.0, replays=40),
            _run("graphed", 330.0, [9.0, 8.0], peak=1100.0, replays=44), _run("eager", 120.0, [9.0, 8.0]),
            _run("eager", 110.0, [9.0, 8.0]),
            {"stack": "plain", "variant": "graphed", "error": "timed out after 150 s"},
            {"stack": "plain", "variant": "graphed", "not_run": "time budget: 400 of 360 s spent"}]
    res = bench_stacks.stack_result("plain", runs)
    eager, graphed = res["variants"]["eager"], res["variants"]["graphed"]
    assert eager["tokens_per_s"] == {"median": 110.0, "min": 100.0, "max": 120.0, "spread": 1.2, "n": 3}
    assert graphed["runs"] == 3 and graphed["ok"] == 2 and graphed["errors"] == ["timed out after 150 s"]
    assert graphed["tokens_per_s"]["median"] == 315.0 and graphed["replays_min"] == 40
    assert res["speed_vs_eager"]["graphed"] == pytest.approx(315.0 / 110.0)
    assert res["memory"]["vs_eager"]["graphed"]["peak_allocated_mib"] == pytest.approx(1.1)
    assert res["memory"]["vs_eager"]["graphed"]["steady_peak_allocated_mib"] == pytest.approx(1.0)
    assert res["losses_vs_eager"]["graphed"]["bitwise_equal"] is True
    assert res["losses_vs_eager"]["graphed"]["runs"] == 2 and res["losses_vs_eager"]["graphed"]["eager_runs"] == 3
    assert res["runs"] == runs  # every run, also those that failed or did not start


def test_the_checkpoint_stack_sets_graphed_checkpointing_against_both_references():
    refused = ("ValueError: LlamaDecoderLayer[0] has gradient checkpointing on; its recomputation cannot run "
               "inside a graph.\nmore")
    runs = [_run("eager", 100.0, [9.0], peak=800.0, stack="checkpoint"),
            {"stack": "checkpoint", "variant": "graphed", "error": refused, "error_type": "ValueError"},
            _run("graphed_no_checkpoint", 250.0, [9.0], peak=1000.0, stack="checkpoint")]
    res = bench_stacks.stack_result("checkpoint", runs)
    assert res["dropout"] == 0.1
    assert res["speed_vs_eager"] == {"graphed": None, "graphed_no_checkpoint": 2.5}
    assert res["memory"]["vs_eager"]["graphed_no_checkpoint"]["peak_allocated_mib"] == 1.25
    assert res["memory"]["graphed_over_graphed_no_checkpoint"]["peak_allocated_mib"] is None
    s = bench_stacks.summarize({"checkpoint": res})
    assert s["checkpoint_error"] == refused.splitlines()[0] and s["checkpoint_speed"] is None
    assert s["checkpoint_graphed_no_checkpoint_speed"] == 2.5 and s["checkpoint_graphed_no_checkpoint_error"] is None
    assert s["checkpoint_peak_vs_graphed_no_checkpoint"] is None

    # once the library recomputes inside its graphs, the same record holds the two ratios
    runs[1] = _run("graphed", 240.0, [9.0], peak=880.0, stack="checkpoint")
    s = bench_stacks.summarize({"checkpoint": bench_stacks.stack_result("checkpoint", runs)})
    assert s["checkpoint_peak_ratio"] == pytest.approx(1.1) and s["checkpoint_peak_vs_graphed_no_checkpoint"] == 0.88
    assert s["checkpoint_speed"] == 2.4 and s["checkpoint_losses_equal"] is True and s["checkpoint_error"] is None


def test_the_summary_has_one_key_per_headline_and_none_where_nothing_ran():
    plain = bench_stacks.stack_result("plain", [_run("eager", 100.0, [9.0, 8.0]), _run("graphed", 400.0, [9.0, 8.1]),
                                                _run("eager", 100.0, [9.0, 8.0])])
    lightning = bench_stacks.stack_result("lightning", [], skipped="neither lightning nor pytorch_lightning")
    s = bench_stacks.summarize({"plain": plain, "lightning": lightning})
    assert s["plain_speed"] == 4.0 and s["plain_losses_equal"] is False
    assert s["plain_loss_max_rel_diff"] == pytest.approx(0.1 / 8.0) and s["plain_eager_loss_spread"] == 0.0
    assert s["plain_eager_losses_equal"] is True and s["plain_eager_tokens_per_s"] == 100.0
    assert s["plain_peak_ratio"] == 1.0 and s["plain_peak_reserved_ratio"] == 1.0 and s["plain_skipped"] is None
    assert s["lightning_skipped"] == "neither lightning nor pytorch_lightning"
    assert s["lightning_speed"] is None and s["lightning_error"] is None and s["lightning_losses_equal"] is None
    assert set(s) == {f"{st}_{k}" for st in ("plain", "lightning") for k in (
        "skipped", "eager_tokens_per_s", "eager_losses_equal", "eager_loss_spread", "speed", "losses_equal",
        "loss_max_rel_diff", "peak_ratio", "steady_peak_ratio", "peak_reserved_ratio", "error")}
    json.dumps(s)  # a record


def _clock(times):
    it = iter(times)
    return lambda: next(it)


def test_the_budget_starts_no_run_that_would_end_past_it():
    durations = {("plain", "eager"): 40.0, ("plain", "graphed"): 50.0, ("fsdp2", "eager"): 10.0,
                 ("fsdp2", "graphed"): 10.0}
    now = [0.0]
    started = []

    def run(stack, variant):
        started.append((stack, variant))
        now[0] += durations[stack, variant]
        return {"tokens_per_s": 1.0, "losses": [1.0]}

    entries, _ = bench_stacks.run_plan(bench_stacks.plan(["plain", "fsdp2"], 3), run, budget=200.0,
                                       clock=lambda: now[0])
    # round 0 takes 110 s; in round 1 plain graphed (50 s, ends at 160) fits, plain eager (ends at 200) fits,
    # then fsdp2's two runs (10 s each) do not
    assert started == [("plain", "eager"), ("plain", "graphed"), ("fsdp2", "eager"), ("fsdp2", "graphed"),
                       ("plain", "graphed"), ("plain", "eager")]
    assert len(entries) == 12 and sum("not_run" in e for e in entries) == 6
    assert all(e["not_run"].startswith("time budget") for e in entries if "not_run" in e)
    assert entries[0]["wall_s"] == 40.0 and entries[0]["round"] == 0


def test_a_skipped_stack_runs_no_more_and_a_failure_is_not_fatal():
    calls = []

    def run(stack, variant):
        calls.append((stack, variant))
        if stack == "lightning":
            return {"skipped": "no lightning"}
        if variant == "graphed":
            return {"error": "ValueError: refused", "exit_code": 1}
        return {"tokens_per_s": 1.0, "losses": [1.0]}

    entries, skipped = bench_stacks.run_plan(bench_stacks.plan(["lightning", "plain", "fsdp2"], 2), run,
                                             budget=1e9, skipped={"fsdp2": "no NCCL"})
    assert calls == [("lightning", "eager"), ("plain", "eager"), ("plain", "graphed"), ("plain", "graphed"),
                     ("plain", "eager")]
    assert skipped == {"fsdp2": "no NCCL", "lightning": "no lightning"}
    assert [e["not_run"] for e in entries if e["stack"] == "fsdp2"] == ["stack skipped: no NCCL"] * 4
    assert sum(e.get("error") == "ValueError: refused" for e in entries) == 2
    res = bench_stacks.stack_result("lightning", [e for e in entries if e["stack"] == "lightning"],
                                    skipped=skipped["lightning"])
    assert res["skipped"] == "no lightning" and res["variants"]["eager"]["runs"] == 0


def test_a_signal_in_a_run_ends_the_plan_and_keeps_what_ran():
    def run(stack, variant):
        if variant == "graphed":
            raise SystemExit(143)
        return {"tokens_per_s": 1.0, "losses": [1.0]}

    entries, _ = bench_stacks.run_plan(bench_stacks.plan(["plain"], 2), run, budget=1e9)
    assert "tokens_per_s" in entries[0] and entries[1]["error"] == "stopped: SystemExit 143"
    assert [e.get("not_run") for e in entries[2:]] == ["stopped: SystemExit 143"] * 2


def test_a_worker_s_record_is_its_last_stdout_line_and_a_failure_keeps_its_stderr(tmp_path):
    good = bench_stacks.run_worker(_fake(tmp_path, "ok"), timeout=30)
    assert good == {"tokens_per_s": 1000.0, "losses": [9.0, 8.5]}
    failed = bench_stacks.run_worker(_fake(tmp_path, "fail"), timeout=30)
    assert failed["error"] == "ValueError: refused" and failed["exit_code"] == 1
    assert "it broke" in failed["stderr_tail"]
    crashed = bench_stacks.run_worker(_fake(tmp_path, "crash"), timeout=30)
    assert crashed["error"] == "exit code 134 without a result line" and "Aborted" in crashed["stderr_tail"]
    hung = bench_stacks.run_worker(_fake(tmp_path, "hang"), timeout=1.5)
    assert hung["error"] == "timed out after 1.5 s" and hung["exit_code"] != 0


def test_the_workers_see_one_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    env = bench_stacks.child_env()
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["NCCL_NVLS_ENABLE"] == "0"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert bench_stacks.child_env()["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_stack_whose_package_is_missing_is_skipped_with_the_reason(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("lightning", "pytorch_lightning", "accelerate")
                        else real(name, *a))
    assert "pip install lightning" in bench_stacks.unavailable("lightning")
    assert "accelerate" in bench_stacks.unavailable("hf_trainer")
    assert bench_stacks.unavailable("plain") is None and bench_stacks.unavailable("checkpoint") is None


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on a GPU the worker would train")
def test_without_cuda_the_worker_reports_its_error_and_main_refuses(tmp_path, capsys):
    rec = bench_stacks.run_worker([sys.executable, bench_stacks.SCRIPT, "--worker", "plain", "eager"], timeout=120)
    assert rec["error"] == "RuntimeError: bench_stacks.py --worker needs a CUDA device" and rec["exit_code"] == 1
    assert rec["stack"] == "plain" and rec["variant"] == "eager"
    assert bench_stacks.main(["--stacks", "plain"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_the_record_and_the_table_from_fake_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_stacks.benchlib, "RESULTS", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(bench_stacks, "unavailable", lambda stack: "no lightning" if stack == "lightning" else None)

    def fake_worker(cmd, *, timeout, env):
        stack, variant = cmd[cmd.index("--worker") + 1:][:2]
        if stack == "checkpoint" and variant == "graphed":
            return {"stack": stack, "variant": variant, "error": "ValueError: checkpointing refused", "exit_code": 1}
        return _run(variant, 100.0 if variant == "eager" else 300.0, [9.0, 8.0], stack=stack, replays=10)

    monkeypatch.setattr(bench_stacks, "run_worker", fake_worker)
    args = bench_stacks.parse_args(["--stacks", "plain,lightning,checkpoint", "--rounds", "2"])
    assert bench_stacks.measure(args) == 0
    record = json.loads((tmp_path / "stacks-cpu.json").read_text())
    assert {"command", "code_version", "device", "date", "versions", "settings", "method", "stacks",
            "summary"} <= set(record)
    assert record["versions"]["torch"] and "transformers" in record["versions"]
    assert record["settings"]["warm_steps"] == 3 and record["settings"]["tokens_per_step"] == 2048
    assert record["settings"]["shape"]["hidden"] == 512 and record["settings"]["attention_dropout"]["checkpoint"] == 0.1
    assert record["summary"]["plain_speed"] == 3.0 and record["summary"]["lightning_skipped"] == "no lightning"
    assert record["summary"]["checkpoint_error"] == "ValueError: checkpointing refused"
    assert len(record["stacks"]["plain"]["runs"]) == 4 and record["not_run"] == 4  # lightning's four
    out = capsys.readouterr().out
    assert "lightning   skipped: no lightning" in out and "checkpointing refused" in out
    assert "wrote " in out
