#!/usr/bin/env python
"""Repeat a few ``tools/train_gpt.py`` variants in alternating rounds: speed spread and loss spread.

    python tools/diagnostics/bench_rounds.py --name zb-rounds --rounds 2 \\
        --base "--framework torch --pp 2 --seq-len 2048 ..." \\
        --variant 1f1b_graphed="--cudagraph" --variant zbv_graphed="--vpp 2 --schedule zbv --cudagraph"

Each round runs every variant once, each in its own processes, the order reversed every other
round. Per variant it records tokens/s of every round (median and slowest/fastest spread), the
per-step losses, and the largest per-step loss difference between its own rounds (the
run-to-run spread of identical runs) and against the first variant's first round. Ratios of the
medians to the first variant's are the comparison. Writes ``benchmarks/results/<name>-<device>.json``.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)
from tools import benchlib  # noqa: E402
from tools.bench_pipeline import run_one  # noqa: E402


def summarize(records: dict) -> dict:
    """Per variant: tokens/s median and spread over its rounds, losses spread between its own
    rounds and against the first variant's first round, speed against the first variant."""
    first = next(iter(records))
    reference = next((r for r in records[first] if "error" not in r), {})
    base_tps = None
    out = {}
    for name, runs in records.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            out[name] = {"error": runs[0].get("error") if runs else "no run"}
            continue
        tps = [r["tokens_per_s"] for r in ok]
        med = statistics.median(tps)
        base_tps = med if name == first else base_tps
        spreads = [benchlib.max_loss_diff(ok[0], r) for r in ok[1:]]
        out[name] = {"tokens_per_s_median": med, "tokens_per_s_rounds": tps, "spread": max(tps) / min(tps),
                     "speed_vs_first": med / base_tps if base_tps else None,
                     "loss_spread_own_rounds": max((s for s in spreads if s is not None), default=None),
                     "loss_diff_vs_first": benchlib.max_loss_diff(reference, ok[0]),
                     "peak_mem_mib_per_rank": [p.get("peak_mem_mib") for p in ok[0].get("per_rank", [])]}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="train_gpt.py arguments every variant shares")
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=ARGS",
                        help="a variant: its name and its extra train_gpt.py arguments (repeatable; the first "
                             "is the reference)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget", type=float, default=300.0, help="seconds for all runs")
    parser.add_argument("--name", required=True, help="result file name: <name>-<device>.json")
    args = parser.parse_args(argv)
    variants = {}
    for spec in args.variant:
        name, sep, extra = spec.partition("=")
        if not sep or not name:
            parser.error(f"--variant {spec!r}: write NAME=ARGS")
        variants[name] = shlex.split(extra)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    base = shlex.split(args.base)
    deadline = time.monotonic() + args.budget
    records = {name: [] for name in variants}
    for r in range(args.rounds):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            remaining = deadline - time.monotonic()
            if remaining < 30:
                records[name].append({"error": "skipped: time budget spent"})
                continue
            print(f"[round {r}] {name} ...", flush=True)
            records[name].append(run_one(base + variants[name], timeout=min(300.0, remaining - 5)))
    summary = summarize(records)
    for name, row in summary.items():
        print(f"{name:<16}", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    payload = {"command": benchlib.command(), **benchlib.environment(), "base": base, "variants": variants,
               "summary": summary, "runs": records}
    path = benchlib.write_result(args.name, payload)
    print(f"wrote {path}")
    return 0 if all("error" not in r for rs in records.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
