#!/usr/bin/env python
"""Unmodified Hugging Face GPT-2 and Llama over 2 GPUs with ``causal_lm_stage``: eager against graphed.

    python tools/bench_hf_pipeline.py             # 2 GPUs, about 5 minutes
    python tools/bench_hf_pipeline.py --dry-run   # print the runs and the record's name
    python tools/bench_hf_pipeline.py --smoke     # tiny, on 2 CPU (gloo) ranks, writes nothing

Each model is built from a config (no download) in ``tools/bench_hf.py``'s shape: hidden 512,
8 layers, 8 heads, vocab 32000, bf16; dropout off, input embedding untied from the head (they
sit on different ranks). It is cut into 2 pipeline stages by ``causal_lm_stage`` (4 blocks
each), one per GPU, and trained with ``torch.distributed.pipelining``'s ``Schedule1F1B`` over
8 micro-batches of 2 x 128 tokens, AdamW, as the README's ``hf_pipe.py`` does
(``tools/hf_stage_worker.py`` is one rank). Variants: ``eager`` (``graph=False``) and
``graphed`` (the stage's blocks graphed in place, the library's defaults).

Every run is one variant in its own 2 processes. ``--rounds`` rounds per model alternate the
order (eager, graphed; then graphed, eager; ...). In a run, 4 warmup-and-capture steps come
first, then ``--windows`` timed windows of ``--iters`` steps; a run's tokens/s is the last
rank's median window. Per variant: the median over runs and the spread (fastest run over the
slowest); per rank, the peak of reserved memory including the capture steps and the steady peak
after them (medians over runs). Loss check: every step's loss of every graphed run against the
first eager run's, max relative error, within ``LOSS_RTOL`` (bf16: one bf16 epsilon, 2^-8; fp32:
1e-5); the eager runs' own spread is recorded beside it (bf16 embedding backward uses atomics,
so two eager runs need not agree bit for bit).

Writes ``benchmarks/results/hf-pipeline-pp2-<device>.json``; its ``summary`` holds
``gpt2_speed_vs_eager``, ``llama_speed_vs_eager``, ``loss_max_rel_err`` and, per model and rank,
graphed over eager peak memory (``<model>_peak_vs_eager_per_rank``, capture steps included) and
steady memory (``<model>_steady_vs_eager_per_rank``). Exit status: 0 when every run finished and
the losses agree, 1 otherwise, 2 when the machine cannot run it.
"""

from __future__ import annotations

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
from tools import bench_hf, benchlib  # noqa: E402

WORKER = os.path.join(REPO, "tools", "hf_stage_worker.py")
RECORD = "hf-pipeline-pp2"
WORLD = 2
VARIANTS = ("eager", "graphed")
LOSS_RTOL = {"bfloat16": 2.0 ** -8, "float32": 1e-5}
BUDGET_S = 450.0  # the whole benchmark within 8 minutes of a 10-minute GPU session
RUN_CAP_S = 150.0  # one run: start, build, warmup and capture, timed windows
MIN_RUN_S = 30.0  # below this much budget left, a run is skipped
# (flag, least value, why)
MINIMUMS = (("--rounds", 1, ""), ("--windows", 1, ""), ("--iters", 1, ""), ("--micro-batch-size", 1, ""),
            ("--seq-len", 1, ""), ("--layers", WORLD, f"a block for each of the {WORLD} stages"),
            ("--micro-batches", WORLD, f"Schedule1F1B fills {WORLD} stages"))
# --smoke: a few seconds per run on 2 CPU ranks (the graphed blocks fall back to eager there)
SMOKE = dict(hidden=32, layers=2, heads=2, vocab=64, micro_batch_size=2, seq_len=8, micro_batches=4, rounds=2,
             windows=2, iters=2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_hf.add_model_args(p, micro_batches=8)
    p.add_argument("--rounds", type=int, default=3, help="runs of each variant per model, in alternating order")
    p.add_argument("--windows", type=int, default=5, help="timed windows per run")
    p.add_argument("--iters", type=int, default=8, help="steps per timed window")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all runs")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on 2 CPU (gloo) ranks; writes nothing")
    p.add_argument("--dry-run", action="store_true", help="print the runs and the record's name, run nothing")
    args = p.parse_args(argv)
    if args.smoke:  # the tiny shape, unless a flag says otherwise
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    args.models = bench_hf.models_arg(p, args.models)
    for flag, least, why in MINIMUMS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < least:
            p.error(f"{flag} must be >= {least}, got {value}" + (f" ({why})" if why else ""))
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if args.budget <= MIN_RUN_S:
        p.error(f"--budget must be more than {MIN_RUN_S:.0f} seconds, got {args.budget:g}")
    args.device = "cpu" if args.smoke else "cuda"
    return args


def plan(args) -> list[dict]:
    """The runs in order: round by round, each model's two variants, their order reversed every round."""
    runs = []
    for r in range(args.rounds):
        for model in args.models:
            for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                worker_args = ["--model", model, "--variant", variant, "--device", args.device]
                for flag in ("hidden", "layers", "heads", "vocab", "micro_batch_size", "seq_len", "micro_batches",
                             "dtype", "windows", "iters"):
                    worker_args += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
                runs.append({"label": f"{model}/{variant}#{r}", "model": model, "variant": variant, "round": r,
                             "args": worker_args})
    return runs


def run_variant(run: dict, timeout: float) -> dict:
    """One run on ``WORLD`` ranks: the per-rank records (each worker's JSON line, or its failure)."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, WORKER, *run["args"]]
    ends = launch.run_ranks([cmd] * WORLD, envs=launch.rank_envs(WORLD, base=env), cwd=REPO, timeout=timeout)
    record = {k: run[k] for k in ("label", "model", "variant", "round")}
    record.update(command="python tools/hf_stage_worker.py " + " ".join(run["args"]),
                  seconds=round(max(e.seconds for e in ends), 1), per_rank=[])
    for end in ends:
        out = benchlib.last_json_line(end.stdout)
        out = out if isinstance(out, dict) else {}
        if end.returncode != 0 or "error" in out or not out:
            out.setdefault("error", f"timed out after {timeout:.0f}s" if end.timed_out else
                           f"exit code {end.returncode}" + (" (stopped: a peer failed)" if end.stopped else ""))
            out["stderr_tail"] = end.stderr[-3000:]
        record["per_rank"].append(out)
    errors = [r["error"] for r in record["per_rank"] if "error" in r]
    if errors:
        record["error"] = next((e for e in errors if "stopped: a peer failed" not in e), errors[0])
    return record


def variant_row(runs: list) -> dict:
    """Medians over a variant's finished runs: tokens/s (the last rank's) with the spread over runs,
    and per rank the peak memory including the capture steps and the steady peak."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"] if runs else "no run"}
    tps = [r["per_rank"][-1]["tokens_per_s"] for r in ok]
    ranks = len(ok[0]["per_rank"])

    def per_rank(key):
        values = [[r["per_rank"][k].get(key) for r in ok] for k in range(ranks)]
        return [statistics.median(v) if None not in v else None for v in values]

    row = {"runs": len(ok), "tokens_per_s": statistics.median(tps), "tokens_per_s_runs": tps,
           "spread": max(tps) / min(tps), "peak_mib_per_rank": per_rank("peak_mib"),
           "steady_mib_per_rank": per_rank("steady_peak_mib"), "capture_phase_s": per_rank("capture_phase_s"),
           "losses": ok[0]["per_rank"][-1].get("losses")}
    if "replays" in ok[0]["per_rank"][0]:
        row["graphs_per_rank"] = [r.get("graphs") for r in ok[0]["per_rank"]]
        row["graphs_replayed"] = all(rank.get("replays", 0) > 0 for r in ok for rank in r["per_rank"])
    return row


def compare(eager_runs: list, graphed_runs: list, eager: dict, graphed: dict) -> dict:
    """Graphed over eager: speed, memory per rank; losses of every graphed run (and of the later
    eager runs) against the first eager run's."""
    if "error" in eager or "error" in graphed:
        return {"error": "a variant has no finished run"}
    reference = eager["losses"]

    def rel_err(run):
        return benchlib.max_rel_loss_diff(run["per_rank"][-1].get("losses"), reference, same_steps=True)

    graphed_errs = [rel_err(r) for r in graphed_runs if "error" not in r]
    repeats = [rel_err(r) for r in eager_runs if "error" not in r][1:]

    def ratios(key):
        return [round(g / e, 4) if g is not None and e else None for g, e in zip(graphed[key], eager[key])]

    return {"speed_vs_eager": graphed["tokens_per_s"] / eager["tokens_per_s"],
            "peak_vs_eager_per_rank": ratios("peak_mib_per_rank"),
            "steady_vs_eager_per_rank": ratios("steady_mib_per_rank"),
            "loss_max_rel_err": None if None in graphed_errs else max(graphed_errs),
            "eager_repeat_loss_max_rel_err": None if not repeats or None in repeats else max(repeats)}


def summarize(records: list) -> dict:
    """Per model: each variant's row and graphed against eager (``check``)."""
    out = {}
    for model in dict.fromkeys(r["model"] for r in records):
        runs = {v: [r for r in records if r["model"] == model and r["variant"] == v] for v in VARIANTS}
        rows = {v: variant_row(runs[v]) for v in VARIANTS}
        rows["check"] = compare(runs["eager"], runs["graphed"], rows["eager"], rows["graphed"])
        out[model] = rows
    return out


def headline(by_model: dict, *, rtol: float) -> dict:
    """The record's ``summary``: speed per model, the worst loss error over models against ``rtol``,
    and per model and rank graphed over eager memory (``None`` where unmeasured or failed)."""
    summary, errs, repeats = {}, [], []
    for model in bench_hf.MODELS:
        check = by_model.get(model, {}).get("check", {})
        summary[f"{model}_speed_vs_eager"] = check.get("speed_vs_eager")
        summary[f"{model}_peak_vs_eager_per_rank"] = check.get("peak_vs_eager_per_rank", [None] * WORLD)
        summary[f"{model}_steady_vs_eager_per_rank"] = check.get("steady_vs_eager_per_rank", [None] * WORLD)
        if model in by_model:
            errs.append(check.get("loss_max_rel_err"))
            repeats.append(check.get("eager_repeat_loss_max_rel_err"))
    worst = None if not errs or None in errs else max(errs)
    summary["loss_max_rel_err"] = worst
    summary["eager_repeat_loss_max_rel_err"] = max([e for e in repeats if e is not None], default=None)
    summary["loss_rtol"] = rtol
    summary["losses_within_rtol"] = worst is not None and worst <= rtol
    return summary


def run_all(runs: list, budget: float) -> list:
    """Every planned run within ``budget`` seconds (each at most ``RUN_CAP_S``); a run that no
    longer fits is recorded as skipped."""
    deadline = time.monotonic() + budget
    records = []
    for i, run in enumerate(runs, 1):
        remaining = deadline - time.monotonic()
        if remaining < MIN_RUN_S:
            records.append({**{k: run[k] for k in ("label", "model", "variant", "round")},
                            "error": "skipped: the time budget is spent", "per_rank": []})
            print(f"[{i}/{len(runs)}] {run['label']}: skipped (budget)", flush=True)
            continue
        print(f"[{i}/{len(runs)}] {run['label']} ...", flush=True)
        records.append(rec := run_variant(run, timeout=min(RUN_CAP_S, remaining - 5)))
        if "error" in rec:
            tail = next((r.get("stderr_tail", "") for r in rec["per_rank"] if "error" in r), "")
            print(f"  failed: {rec['error'][:500]}\n{tail[-1500:]}", flush=True)
    return records


def print_table(by_model: dict) -> None:
    head = f"{'model':<7}{'variant':<9}{'tok/s':>10}{'spread':>8}{'x eager':>9}  peak / steady MiB per rank"
    print(head)
    print("-" * len(head))
    for model, rows in by_model.items():
        check = rows["check"]
        for variant in VARIANTS:
            r = rows[variant]
            if "error" in r:
                print(f"{model:<7}{variant:<9} FAILED: {r['error'][:200]}")
                continue
            speed = f"{check['speed_vs_eager']:.3f}" if variant == "graphed" and "speed_vs_eager" in check else "-"
            print(f"{model:<7}{variant:<9}{r['tokens_per_s']:>10.0f}{r['spread']:>8.3f}{speed:>9}  "
                  f"{r['peak_mib_per_rank']} / {r['steady_mib_per_rank']}")
        if "error" not in check:
            print(f"{model:<7}losses: graphed vs eager max rel. err. {check['loss_max_rel_err']}, eager vs eager "
                  f"{check['eager_repeat_loss_max_rel_err']}; memory graphed/eager peak "
                  f"{check['peak_vs_eager_per_rank']}, steady {check['steady_vs_eager_per_rank']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = plan(args)
    if args.dry_run:
        print(f"# {len(runs)} runs on {WORLD} ranks each ({args.device}), budget {args.budget:.0f}s, at most "
              f"{RUN_CAP_S:.0f}s a run")
        print("# writes nothing (--smoke)" if args.smoke else f"# writes benchmarks/results/{RECORD}-<device>.json")
        for r in runs:
            print(r["label"], "python tools/hf_stage_worker.py", *r["args"])
        return 0
    if not args.smoke:
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < WORLD:
            print(f"bench_hf_pipeline: needs {WORLD} GPUs (one pipeline stage each), found {have}; run it on a "
                  f"2-GPU machine, or --smoke for a CPU check", file=sys.stderr)
            return 2
    records = run_all(runs, args.budget)
    by_model = summarize(records)
    print_table(by_model)
    summary = headline(by_model, rtol=LOSS_RTOL[args.dtype])
    graphed_rows = [rows["graphed"] for rows in by_model.values()]
    summary["graphs_replayed"] = bool(graphed_rows) and all(r.get("graphs_replayed") for r in graphed_rows)
    method = " ".join("\n\n".join(__doc__.split("\n\n")[2:4]).split())  # the docstring's model and method
    payload = {"command": benchlib.command(), **benchlib.environment(), "versions": _versions(),
               "code_version": benchlib.code_version(), "pp": WORLD, "settings": dict(vars(args)), "method": method,
               "summary": summary, "by_model": by_model, "runs": records}
    ok = all("error" not in r for r in records) and summary["losses_within_rtol"]
    if args.smoke:  # a check of the scripts: no result file
        print(json.dumps(payload))
        return 0 if ok else 1
    path = benchlib.write_result(RECORD, payload)
    print(f"wrote {path}")
    print(json.dumps(summary))
    return 0 if ok and summary["graphs_replayed"] else 1


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in ("torch", "transformers", "paddle_graphpp"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
