"""tools/bench_hf_pipeline.py on CPU: the run plan, the argument checks, the summary math (its
GPU runs need 2 GPUs), a run's failure and time limit leaving no process behind, and --smoke end
to end on 2 gloo ranks (the graphed blocks run eagerly there, so the losses must be equal)."""
import functools
import json
import os
import sys
import uuid

import pytest

from tools import bench_hf_pipeline as bhp
from testing import launch
from tools import benchlib, hf_stage_worker

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tools", "bench_hf_pipeline.py")
TAG = "GRAPHPP_HF_PIPELINE_TEST_TAG"


# ------------------------------------------------------------------------------ plan and flags
def test_dry_run_alternates_the_variants_every_round_and_names_the_record(capsys):
    assert bhp.main(["--dry-run", "--rounds", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# 12 runs on 2 ranks each (cuda)")
    assert out[1] == "# writes benchmarks/results/hf-pipeline-pp2-<device>.json"
    labels = [line.split()[0] for line in out[2:]]
    assert labels == ["gpt2/eager#0", "gpt2/graphed#0", "llama/eager#0", "llama/graphed#0",
                      "gpt2/graphed#1", "gpt2/eager#1", "llama/graphed#1", "llama/eager#1",
                      "gpt2/eager#2", "gpt2/graphed#2", "llama/eager#2", "llama/graphed#2"]
    first = out[2].split()
    assert first[1:3] == ["python", "tools/hf_stage_worker.py"]
    for flag, value in (("--hidden", "512"), ("--layers", "8"), ("--micro-batches", "8"), ("--dtype", "bfloat16"),
                        ("--device", "cuda")):
        assert first[first.index(flag) + 1] == value, flag


def test_every_planned_run_parses_as_the_worker_s_arguments():
    args = bhp.parse_args(["--models", "llama", "--rounds", "2", "--seq-len", "256"])
    for run in bhp.plan(args):
        opts = hf_stage_worker.parse_args(run["args"])
        assert (opts.model, opts.variant, opts.seq_len, opts.micro_batches) == ("llama", run["variant"], 256, 8)


def test_smoke_takes_the_tiny_cpu_shape_unless_a_flag_says_otherwise():
    args = bhp.parse_args(["--smoke"])
    assert (args.device, args.hidden, args.layers, args.rounds) == ("cpu", 32, 2, 2)
    assert bhp.parse_args(["--smoke", "--hidden", "64"]).hidden == 64
    assert bhp.parse_args([]).device == "cuda"


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--windows", "0"], "--windows must be >= 1"),
    (["--layers", "1"], "--layers must be >= 2, got 1 (a block for each of the 2 stages)"),
    (["--micro-batches", "1"], "--micro-batches must be >= 2, got 1 (Schedule1F1B fills 2 stages)"),
    (["--models", "gpt2,opt"], "--models takes gpt2, llama; got ['opt']"),
    (["--hidden", "100"], "--hidden 100 must be a multiple of --heads 8"),
    (["--budget", "20"], "--budget must be more than 30 seconds"),
    (["--dtype", "float16"], "argument --dtype: invalid choice"),
])
def test_bad_arguments_are_refused_naming_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        bhp.main([*argv, "--dry-run"])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_worker_alone_is_refused_naming_the_launcher(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=1: a pipeline needs 2 or more ranks.*bench_hf_pipeline"):
        hf_stage_worker.init_distributed("cpu")


@pytest.mark.skipif(__import__("torch").cuda.device_count() >= 2, reason="this machine has 2 GPUs")
def test_without_two_gpus_the_benchmark_stops_with_exit_2(capsys):
    assert bhp.main(["--rounds", "1"]) == 2
    assert "needs 2 GPUs (one pipeline stage each)" in capsys.readouterr().err


# ------------------------------------------------------------------------------- summary math
def _run(model, variant, tps, *, losses, peaks=(None, None), steady=(None, None), replays=None, rnd=0):
    per_rank = []
    for rank in range(2):
        rec = {"rank": rank, "tokens_per_s": tps * (2 if rank == 0 else 1),  # rank 0's must not be used
               "peak_mib": peaks[rank], "steady_peak_mib": steady[rank], "capture_phase_s": 1.0,
               "losses": losses if rank == 1 else None}
        if replays is not None:
            rec.update(graphs=16, replays=replays)
        per_rank.append(rec)
    return {"label": f"{model}/{variant}#{rnd}", "model": model, "variant": variant, "round": rnd,
            "per_rank": per_rank}


def test_speed_is_the_median_of_the_last_rank_over_runs_and_memory_is_per_rank():
    losses = [10.0, 9.0, 8.0]
    records = [
        _run("gpt2", "eager", 100.0, losses=losses, peaks=(1000.0, 2000.0), steady=(900.0, 1800.0)),
        _run("gpt2", "graphed", 300.0, losses=[10.0, 9.0, 8.02], peaks=(1100.0, 2000.0), steady=(900.0, 1700.0),
             replays=64),
        _run("gpt2", "graphed", 330.0, losses=losses, peaks=(1100.0, 2000.0), steady=(900.0, 1700.0), replays=64,
             rnd=1),
        _run("gpt2", "eager", 120.0, losses=[10.0, 9.0, 8.01], peaks=(1000.0, 2000.0), steady=(900.0, 1800.0), rnd=1),
        _run("gpt2", "eager", 110.0, losses=losses, peaks=(1000.0, 3000.0), steady=(900.0, 1800.0), rnd=2),
        {**_run("gpt2", "graphed", 1.0, losses=[0.0] * 3, replays=0, rnd=2), "error": "timed out after 150s"},
    ]
    rows = bhp.summarize(records)["gpt2"]
    eager, graphed, check = rows["eager"], rows["graphed"], rows["check"]
    assert eager["tokens_per_s"] == 110.0 and eager["spread"] == 1.2 and eager["runs"] == 3
    assert graphed["tokens_per_s"] == 315.0 and graphed["runs"] == 2  # the failed run counts nowhere
    assert eager["peak_mib_per_rank"] == [1000.0, 2000.0]  # medians per rank over runs
    assert graphed["graphs_replayed"] is True and graphed["graphs_per_rank"] == [16, 16]
    assert check["speed_vs_eager"] == 315.0 / 110.0
    assert check["peak_vs_eager_per_rank"] == [1.1, 1.0]
    assert check["steady_vs_eager_per_rank"] == [1.0, round(1700 / 1800, 4)]
    assert check["loss_max_rel_err"] == pytest.approx(0.02 / 8.0)
    assert check["eager_repeat_loss_max_rel_err"] == pytest.approx(0.01 / 8.0)
    summary = bhp.headline(bhp.summarize(records), rtol=2.0 ** -8)
    assert summary["gpt2_speed_vs_eager"] == 315.0 / 110.0
    assert summary["gpt2_peak_vs_eager_per_rank"] == [1.1, 1.0]
    assert summary["loss_max_rel_err"] == pytest.approx(0.0025) and summary["losses_within_rtol"] is True
    assert bhp.headline(bhp.summarize(records), rtol=1e-3)["losses_within_rtol"] is False
    # llama did not run: its figures are None, one memory entry per rank
    assert summary["llama_speed_vs_eager"] is None and summary["llama_peak_vs_eager_per_rank"] == [None, None]


def test_a_graphed_run_that_never_replayed_is_flagged():
    records = [_run("llama", "eager", 100.0, losses=[5.0]),
               _run("llama", "graphed", 100.0, losses=[5.0], replays=64),
               _run("llama", "graphed", 100.0, losses=[5.0], replays=0, rnd=1)]
    assert bhp.summarize(records)["llama"]["graphed"]["graphs_replayed"] is False


def test_unmeasured_memory_and_missing_losses_give_none_not_a_number():
    records = [_run("llama", "eager", 100.0, losses=[5.0, 4.0]), _run("llama", "graphed", 200.0, losses=[5.0])]
    check = bhp.summarize(records)["llama"]["check"]
    assert check["peak_vs_eager_per_rank"] == [None, None]  # CPU runs: no device memory
    assert check["loss_max_rel_err"] is None  # step counts differ: no comparison invented
    summary = bhp.headline({"llama": {"check": check}}, rtol=1.0)
    assert summary["loss_max_rel_err"] is None and summary["losses_within_rtol"] is False


def test_a_variant_without_a_finished_run_fails_the_check():
    records = [_run("gpt2", "eager", 100.0, losses=[5.0]),
               {**_run("gpt2", "graphed", 100.0, losses=[5.0]), "error": "exit code 1"}]
    rows = bhp.summarize(records)["gpt2"]
    assert rows["graphed"] == {"error": "exit code 1"} and "error" in rows["check"]
    summary = bhp.headline({"gpt2": rows}, rtol=1.0)
    assert summary["gpt2_speed_vs_eager"] is None and summary["losses_within_rtol"] is False


def test_relative_loss_error():
    rel_err = functools.partial(benchlib.max_rel_loss_diff, same_steps=True)  # what the summary uses
    assert rel_err([2.0, 4.4], [2.0, 4.0]) == pytest.approx(0.1)
    assert rel_err([1.0], [1.0, 2.0]) is None and rel_err(None, [1.0]) is None


# ------------------------------------------------------------------------------ processes
def _tagged_processes(tag: str) -> list:
    """Live processes (not zombies) whose environment carries ``TAG=tag``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"{TAG}={tag}".encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(pid))
        except OSError:  # gone, or not ours to read
            continue
    return found


def _smoke_run(variant="graphed", **overrides):
    args = bhp.parse_args(["--smoke", "--models", "gpt2", *[x for k, v in overrides.items()
                                                           for x in (f"--{k.replace('_', '-')}", str(v))]])
    return next(r for r in bhp.plan(args) if r["variant"] == variant)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_failing_stage_is_reported_and_its_peer_stopped(monkeypatch):
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG, tag)
    run = _smoke_run()
    run["args"][run["args"].index("--layers") + 1] = "1"  # passes the worker's parser; causal_lm_stage refuses
    rec = bhp.run_variant(run, timeout=90)
    assert "cannot fill 2 stages" in rec["error"], rec
    assert all("error" in r for r in rec["per_rank"]) and rec["seconds"] < 90
    assert _tagged_processes(tag) == []


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_run_past_its_time_limit_is_stopped_with_its_ranks(monkeypatch):
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG, tag)
    rec = bhp.run_variant(_smoke_run(windows=100000), timeout=8)
    assert rec["error"] == "timed out after 8s" and len(rec["per_rank"]) == 2
    assert _tagged_processes(tag) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smoke_trains_both_models_eager_and_graphed_over_two_gloo_ranks():
    tag = uuid.uuid4().hex
    before = sorted(os.listdir(os.path.join(REPO, "benchmarks", "results")))
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "RANK", "WORLD_SIZE")}
    end = launch.run([sys.executable, SCRIPT, "--smoke"], env={**env, TAG: tag}, cwd=REPO, timeout=270)
    assert end.returncode == 0, end.stdout[-3000:] + end.stderr[-3000:]
    assert _tagged_processes(tag) == []
    assert sorted(os.listdir(os.path.join(REPO, "benchmarks", "results"))) == before  # --smoke writes nothing
    payload = json.loads([line for line in end.stdout.splitlines() if line.startswith('{"command"')][-1])
    assert [r["label"] for r in payload["runs"]][:6] == ["gpt2/eager#0", "gpt2/graphed#0", "llama/eager#0",
                                                          "llama/graphed#0", "gpt2/graphed#1", "gpt2/eager#1"]
    steps = 4 + 2 * 2  # warmup and capture, then 2 windows of 2 steps
    for run in payload["runs"]:
        first, last = run["per_rank"]
        assert first["losses"] is None and len(last["losses"]) == steps, run["label"]
        assert first["layer_indices"] == [0] and last["layer_indices"] == [1]
    summary = payload["summary"]
    # on a CPU the graphed blocks run eagerly: the same arithmetic, so equal losses
    assert summary["loss_max_rel_err"] == 0.0 and summary["losses_within_rtol"] is True
    assert summary["graphs_replayed"] is False
    for model in ("gpt2", "llama"):
        assert summary[f"{model}_speed_vs_eager"] > 0
        assert payload["by_model"][model]["eager"]["runs"] == payload["by_model"][model]["graphed"]["runs"] == 2
