#!/usr/bin/env python
"""Pipeline training with and without CUDA graphs, side by side: tools/train_gpt.py --framework torch.

Run on a machine with 2 GPUs (one command, under 8 minutes)::

    python tools/bench_pipeline.py

For each configuration (a launch-bound one: hidden 512, 12 layers, micro-batch 4 x 256 tokens,
8 micro-batches; and a compute-bound one: hidden 2048, 4 layers, micro-batch 4 x 512 tokens) and
each schedule (pp=2 1F1B, pp=2 x vpp=2 interleaved) it trains 50 steps with dropout 0.1 eagerly
and with ``--cudagraph``, then checks that the losses agree to 1e-5 relative error at every step
and reports tokens/s and peak reserved memory (max over ranks). The result goes to
``benchmarks/results/pipeline-<device>.json`` with every command line, and a table is printed.

``--smoke`` runs tiny configurations for a few steps (CPU allowed) and writes nothing: a check
that the script itself works.
Exit status: 0 when every run finished and every loss check passed, 1 otherwise, 2 when the
machine cannot run the benchmark.
"""

from __future__ import annotations

from typing import Optional

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)
from testing import launch  # noqa: E402
from testing.gpt_shape import GPT3_1P3B, GPTShape  # noqa: E402
from tools import benchlib  # noqa: E402

TRAIN = os.path.join(REPO, "tools", "train_gpt.py")
BUDGET_S = 450  # the whole benchmark stays under 8 minutes
LOSS_RTOL = 1e-5
TARGET_SPEEDUP = 1.8  # launch-bound configuration, graphs over eager


def train_gpt_flags(shape: GPTShape) -> list:
    """``tools/train_gpt.py`` arguments that build ``shape``'s model (width, depth, heads, vocab,
    attention); the sequence length and dropout are the run's, left to the caller."""
    return ["--hidden", str(shape.hidden), "--layers", str(shape.layers), "--heads", str(shape.heads),
            "--vocab", str(shape.vocab), "--attention", shape.attention]


# The learning rate the records were measured at; the trainer's own default is the demo's (larger).
RECORD_LR = ["--lr", "3e-4"]
CONFIGS = {
    "launch_bound": ["--hidden", "512", "--layers", "12", "--micro-batch-size", "4", "--seq-len", "256",
                     "--micro-batches", "8", *RECORD_LR],
    "compute_bound": ["--hidden", "2048", "--layers", "4", "--micro-batch-size", "4", "--seq-len", "512",
                      "--micro-batches", "8", *RECORD_LR],
}
SMOKE_CONFIGS = {
    "launch_bound": ["--hidden", "64", "--layers", "4", "--micro-batch-size", "2", "--seq-len", "32",
                     "--micro-batches", "4", *RECORD_LR],
}
#: GPT-3 1.3B as the multi-GPU benchmarks train it (each adds --pp/--tp, --seq-len, --steps and its
#: variant's flags): micro-batch 1, 8 micro-batches, bf16, flash attention, dropout off (runs of
#: different numerics then compare), AdamW at lr 2e-5 after a 3-step linear warmup. At lr 3e-4
#: without warmup the loss rose from 11.3 to 22.9 before it fell. The same width and depth at
#: seq 128 on CPU: at 2e-5 (warmup 3) the loss fell at every one of ten steps (11.30 -> 5.16), at
#: 4e-5 it rose in step 4 (8.00 -> 8.77), and with 8 blocks 5e-5 already rose; the deeper, the
#: smaller the rate Adam's first, gradient-size-blind steps tolerate.
GPT3_1P3B_RUN = ["--framework", "torch", *train_gpt_flags(GPT3_1P3B), "--micro-batch-size", "1",
                 "--micro-batches", "8", "--dtype", "bfloat16", "--dropout", "0", "--lr", "2e-5",
                 "--lr-warmup", "3", "--seed", "1234", "--timeout", "120"]
EXTRA_VARIANTS = ("graphed_optimizer", "graphed_accumulate")
SCHEDULES = {"1F1B": ["--pp", "2"], "interleaved": ["--pp", "2", "--vpp", "2"]}


def run_one(args: list, timeout: float, extra_env: Optional[dict] = None) -> dict:
    """One train_gpt.py run in its own session; its last stdout line parsed, or the failure.
    ``extra_env``: variables added to the run's environment (recorded with the command).

    A run whose rendezvous port was taken between the trainer's pick and the ranks' bind (another
    job on the host, see :func:`testing.launch.free_port`) starts once more, on a new port, within
    what is left of ``timeout``; ``port_retries`` in the record counts it."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", **(extra_env or {}))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    deadline = time.monotonic() + max(1.0, timeout)
    end = launch.run([sys.executable, TRAIN, *args], env=env, timeout=max(1.0, timeout))
    retries = 0
    port_taken = end.returncode != 0 and not end.timed_out and launch.PORT_TAKEN in end.stderr
    if port_taken and deadline - time.monotonic() > 1:
        retries = 1
        end = launch.run([sys.executable, TRAIN, *args], env=env, timeout=deadline - time.monotonic())
    prefix = [f"{k}={v}" for k, v in (extra_env or {}).items()]
    record = {"command": " ".join([*prefix, "python", "tools/train_gpt.py", *args]), "seconds": round(end.seconds, 1)}
    if retries:
        record["port_retries"] = retries
    result = benchlib.last_json_line(end.stdout)
    if end.timed_out or end.returncode != 0 or result is None:
        record["error"] = ("timed out after %.0fs" % timeout) if end.timed_out else f"exit code {end.returncode}"
        record["stderr_tail"] = end.stderr[-3000:]
        return record
    record.update(result)
    return record


def summarize(records: list) -> dict:
    """Median tokens/s and peak memory over a variant's rounds, with the round spread; per rank
    (``*_per_rank``, medians over the rounds) where the runs report their ranks."""
    ok = [r for r in records if "error" not in r]
    if not ok:
        return {"error": records[0].get("error", "no run") if records else "no run"}
    tps = [r["tokens_per_s"] for r in ok]
    out = {"tokens_per_s": statistics.median(tps), "tokens_per_s_rounds": tps, "spread": max(tps) / min(tps),
           "peak_mem_mib": statistics.median([r["peak_mem_mib"] for r in ok]),
           "steady_peak_mem_mib": statistics.median([r.get("steady_peak_mem_mib", r["peak_mem_mib"]) for r in ok]),
           "losses": ok[0]["losses"],
           "graphs_active": all(r.get("graphs_active", False) for r in ok),
           "commands": sorted({r["command"] for r in ok})}
    ranks = {len(r.get("per_rank") or []) for r in ok}
    if len(ranks) == 1 and (count := ranks.pop()):
        for key in ("peak_mem_mib", "steady_peak_mem_mib"):
            out[key + "_per_rank"] = [statistics.median([r["per_rank"][i].get(key, 0.0) for r in ok])
                                      for i in range(count)]
    return out


def compare(eager: dict, graphed: dict, *, rtol: float = LOSS_RTOL) -> dict:
    """Loss agreement (relative error within ``rtol``) and the speed and memory ratios of one
    eager/graphed pair (medians; memory per rank too where both have it)."""
    if "error" in eager or "error" in graphed:
        return {"ok": False, "reason": "a run failed"}
    a, b = eager["losses"], graphed["losses"]
    if len(a) != len(b) or not a:
        return {"ok": False, "reason": f"loss counts differ ({len(a)} vs {len(b)})"}
    rel = benchlib.max_rel_loss_diff(b, a)
    reason = [] if rel <= rtol else [f"losses differ by {rel:.1e}"]
    if not graphed.get("graphs_active", False):
        reason.append("graphs were not active")
    out = {
        "reason": "; ".join(reason),
        "ok": rel <= rtol and graphed.get("graphs_active", False),
        "max_rel_loss_err": rel,
        "loss_rtol": rtol,
        "losses_match": rel <= rtol,
        "graphs_active": graphed.get("graphs_active", False),
        "speedup_tokens_per_s": graphed["tokens_per_s"] / max(eager["tokens_per_s"], 1e-9),
        "peak_mem_ratio": graphed["peak_mem_mib"] / max(eager["peak_mem_mib"], 1e-9),
        "steady_peak_mem_ratio": graphed["steady_peak_mem_mib"] / max(eager["steady_peak_mem_mib"], 1e-9),
    }
    for key in ("peak_mem_mib", "steady_peak_mem_mib"):
        mine, base = graphed.get(key + "_per_rank"), eager.get(key + "_per_rank")
        if mine and base and len(mine) == len(base):
            out[key.replace("_mib", "_ratio") + "_per_rank"] = [x / max(y, 1e-9) for x, y in zip(mine, base)]
    return out


MIN_RUN_S = 25.0  # a run that would start with less time left is recorded as skipped


def run_plan(plan: list, *, budget: float, run_cap: float) -> dict:
    """Run ``(label, seq, train_gpt arguments)`` entries in order, each through :func:`run_one`
    with what is left of ``budget`` seconds (at most ``run_cap``); an entry with less than
    :data:`MIN_RUN_S` left is recorded as skipped. Returns ``{(seq, label): [record, ...]}``."""
    deadline = time.monotonic() + budget
    records: dict = {}
    for i, (label, seq, args) in enumerate(plan, 1):
        remaining = deadline - time.monotonic()
        if remaining < MIN_RUN_S:
            records.setdefault((seq, label), []).append({"error": "skipped: time budget spent"})
            continue
        print(f"[{i}/{len(plan)}] seq {seq} {label} ...", flush=True)
        record = run_one(args, timeout=min(run_cap, remaining - 5))
        if "error" in record:
            print(f"  failed: {record['error']}\n{record.get('stderr_tail', '')[-1500:]}", flush=True)
        records.setdefault((seq, label), []).append(record)
    return records


def print_plan(plan: list) -> None:
    """``--dry-run`` of a tool built on :func:`run_plan`: one line per run, in order."""
    for label, seq, args in plan:
        print(f"{label:<14} seq {seq}: python tools/train_gpt.py {' '.join(args)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of each variant, in alternating order (medians are reported)")
    parser.add_argument("--configs", nargs="*", default=None, help="subset of configurations to run")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole benchmark")
    parser.add_argument("--name", default="pipeline", help="result file name: <name>-<device>.json")
    parser.add_argument("--smoke", action="store_true", help="tiny configurations, CPU allowed, no result file")
    opts = parser.parse_args()
    if opts.steps < 6:
        print("bench_pipeline: --steps must be at least 6 (warmup and capture come first)", file=sys.stderr)
        return 2

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2 and not opts.smoke:
        print(f"bench_pipeline: needs 2 GPUs, found {gpus}; run it on the 2-GPU machine (or --smoke)", file=sys.stderr)
        return 2
    configs = SMOKE_CONFIGS if opts.smoke else CONFIGS
    if opts.configs:
        unknown = set(opts.configs) - set(configs)
        if unknown:
            print(f"bench_pipeline: unknown configuration(s) {sorted(unknown)}; choose from {list(configs)}",
                  file=sys.stderr)
            return 2
        configs = {k: v for k, v in configs.items() if k in opts.configs}
    steps = min(opts.steps, 8) if opts.smoke else opts.steps
    deadline = time.monotonic() + opts.budget
    runs, pairs = [], []
    for cfg_name, cfg_args in configs.items():
        for sched_name, sched_args in SCHEDULES.items():
            base = ["--framework", "torch", *sched_args, *cfg_args, "--steps", str(steps), "--dropout", "0.1",
                    "--seed", "1234", "--timeout", "120"]
            variants = {"eager": [], "graphed": ["--cudagraph"]}
            if cfg_name == "launch_bound" and sched_name == "1F1B":
                variants["graphed_optimizer"] = ["--cudagraph", "--graph-optimizer"]
            if cfg_name in ("compute_bound", "launch_bound"):
                variants["graphed_accumulate"] = ["--cudagraph", "--graph-accumulate-grads"]
            records = {v: [] for v in variants}
            for rnd in range(opts.rounds):
                order = list(variants) if rnd % 2 == 0 else list(variants)[::-1]  # A B C, C B A, ...
                for variant in order:
                    remaining = deadline - time.monotonic()
                    if remaining < 20:
                        records[variant].append({"error": "skipped: the benchmark's time budget is spent"})
                        continue
                    print(f"[{cfg_name} / {sched_name} / {variant} / round {rnd + 1}] ...", flush=True)
                    record = run_one(base + variants[variant], timeout=min(240.0, remaining - 10))
                    record.update(config=cfg_name, schedule=sched_name, variant=variant, round=rnd)
                    runs.append(record)
                    records[variant].append(record)
                    if "error" in record:
                        print(f"  failed: {record['error']}\n{record.get('stderr_tail', '')[-1500:]}", flush=True)
            pair = {"config": cfg_name, "schedule": sched_name}
            pair.update({v: summarize(r) for v, r in records.items()})
            pair["check"] = compare(pair["eager"], pair["graphed"])
            for extra in EXTRA_VARIANTS:
                if extra in pair:
                    pair[f"check_{extra}"] = compare(pair["eager"], pair[extra])
            pairs.append(pair)

    print_table(pairs)
    launch = [p["check"].get("speedup_tokens_per_s") for p in pairs if p["config"] == "launch_bound"]
    summary = {
        "all_ok": all(p["check"]["ok"] for p in pairs),
        "loss_rtol": LOSS_RTOL,
        "target_speedup_launch_bound": TARGET_SPEEDUP,
        "launch_bound_speedups": launch,
        "meets_target": bool(launch) and all(s is not None and s >= TARGET_SPEEDUP for s in launch),
    }
    if opts.smoke:
        print(json.dumps(summary))
        return 0 if all("error" not in r for r in runs) else 1
    payload = {"command": benchlib.command(), **benchlib.environment(), "steps": steps, "rounds": opts.rounds,
               "configs": {k: CONFIGS[k] for k in configs}, "summary": summary, "pairs": pairs,
               "runs": [slim(r) for r in runs]}
    path = benchlib.write_result(opts.name, payload)
    print(f"wrote {path}")
    print(json.dumps(summary))
    return 0 if summary["all_ok"] else 1


def slim(record: dict) -> dict:
    """A run's record as a result file keeps it: the figures and the command, not the whole configuration."""
    keep = ("command", "seconds", "error", "stderr_tail", "tokens_per_s", "peak_mem_mib", "steady_peak_mem_mib",
            "loss_first", "loss_last", "losses", "device", "graphs_active", "timed_steps", "untimed_steps",
            "graphed_runs_on_rank", "torch_version")
    out = {k: record[k] for k in keep if k in record}
    if record.get("per_rank"):
        rank_keys = ("peak_mem_mib", "steady_peak_mem_mib", "compile_steps", "frames_compiled")
        out["per_rank"] = [{k: r[k] for k in rank_keys if k in r} for r in record["per_rank"]]
    return out


def print_table(pairs: list) -> None:
    head = f"{'config':<14}{'schedule':<13}{'variant':<19}{'tok/s':>10}{'spread':>8}{'speedup':>9}" \
           f"{'peak MiB':>10}{'steady':>8}{'max rel err':>13}  ok"
    print(head)
    print("-" * len(head))
    for p in pairs:
        e = p["eager"]
        for variant in [v for v in ("eager", "graphed", *EXTRA_VARIANTS) if v in p]:
            r = p[variant]
            c = {"eager": {}, "graphed": p["check"]}.get(variant, p.get(f"check_{variant}", {}))
            num = lambda d, k, f="{:.0f}": f.format(d[k]) if k in d else "-"  # noqa: E731
            speed = f"{r['tokens_per_s'] / e['tokens_per_s']:.2f}x" if "tokens_per_s" in r and "tokens_per_s" in e else "-"
            err = f"{c['max_rel_loss_err']:.1e}" if "max_rel_loss_err" in c else "-"
            ok = "" if variant == "eager" else ("yes" if c.get("ok") else "NO: " + c.get("reason", "losses differ"))
            print(f"{p['config']:<14}{p['schedule']:<13}{variant:<19}{num(r, 'tokens_per_s'):>10}"
                  f"{num(r, 'spread', '{:.2f}'):>8}{speed:>9}{num(r, 'peak_mem_mib'):>10}"
                  f"{num(r, 'steady_peak_mem_mib'):>8}{err:>13}  {ok}")


if __name__ == "__main__":
    sys.exit(main())
