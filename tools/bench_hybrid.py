#!/usr/bin/env python
"""Tensor and pipeline parallel together (4 GPUs): graphed against eager at TP=2 x PP=2.

    python tools/bench_hybrid.py            # writes benchmarks/results/hybrid-tp2pp2-<device>.json
    python tools/bench_hybrid.py --pp 1     # TP=2 alone on 2 GPUs: hybrid-tp2pp1-<device>.json
    python tools/bench_hybrid.py --dry-run  # prints the runs

GPT-3 1.3B shape (hidden 2048, 24 layers, 16 heads, vocab 50304, bf16, micro-batch 1,
8 micro-batches), torch pipelining 1F1B, ``tools/train_gpt.py --tp 2 --pp 2``: each block's
heads and MLP split over 2 GPUs with the project's column/row layers, their all-reduces
through the capture-aware dispatcher (captured inside the stage graphs when graphed). Each
run in its own processes; per sequence length, ``--rounds`` alternating rounds of eager and
graphed (speed: medians, with the spread), and one TP=1 eager run of the same pipeline depth
as the loss reference. Dropout is off, so the TP=2 losses compare with TP=1's (only the summation order
differs: bf16 tolerance). Memory per rank: peak including the capture step, steady after it.

``summary`` = ``{"speed_vs_eager_seq512", "speed_vs_eager_seq2048", "loss_max_rel_err"}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)
from tools import benchlib  # noqa: E402
from tools.bench_pipeline import compare, run_one, summarize  # noqa: E402

BASE = ["--framework", "torch", "--hidden", "2048", "--layers", "24", "--heads", "16",
        "--vocab", "50304", "--micro-batch-size", "1", "--micro-batches", "8", "--dtype", "bfloat16",
        "--attention", "sdpa", "--dropout", "0", "--steps", "10", "--seed", "1234", "--timeout", "120"]
SEQS = (512, 2048)
BF16_RTOL = 2e-2  # losses of a different summation order in bf16


def plan(rounds: int, pp: int = 2, seqs=SEQS) -> list:
    """(label, seq, train_gpt arguments) in run order."""
    runs = []
    for seq in seqs:
        common = BASE + ["--pp", str(pp), "--seq-len", str(seq)]
        for r in range(rounds):
            pair = [("eager", common + ["--tp", "2"]), ("graphed", common + ["--tp", "2", "--cudagraph"])]
            runs += [(label, seq, a) for label, a in (pair if r % 2 == 0 else pair[::-1])]
        runs.append(("tp1_eager", seq, common))
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating eager/graphed rounds per sequence length")
    parser.add_argument("--budget", type=float, default=560.0, help="seconds for all runs")
    parser.add_argument("--pp", type=int, choices=[1, 2], default=2, help="pipeline stages (GPUs: 2 x pp)")
    parser.add_argument("--seqs", type=int, nargs="+", default=list(SEQS), help="sequence lengths")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and exit")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    runs_plan = plan(args.rounds, args.pp, args.seqs)
    if args.dry_run:
        for label, seq, a in runs_plan:
            print(f"{label:<10} seq {seq}: python tools/train_gpt.py {' '.join(a)}")
        return 0
    import torch

    if torch.cuda.device_count() < 2 * args.pp:
        print(f"bench_hybrid: needs {2 * args.pp} GPUs (TP=2 x PP={args.pp}), found {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget
    records: dict = {}
    for i, (label, seq, a) in enumerate(runs_plan, 1):
        remaining = deadline - time.monotonic()
        key = (seq, label)
        if remaining < 25:
            records.setdefault(key, []).append({"error": "skipped: time budget spent"})
            continue
        print(f"[{i}/{len(runs_plan)}] seq {seq} {label} ...", flush=True)
        records.setdefault(key, []).append(run_one(a, timeout=min(200.0, remaining - 5)))
    by_seq, summary, worst = {}, {}, 0.0
    for seq in args.seqs:
        eager, graphed, ref = (summarize(records.get((seq, n), [])) for n in ("eager", "graphed", "tp1_eager"))
        row = {"eager": eager, "graphed": graphed, "tp1_eager": ref, "graphed_vs_eager": compare(eager, graphed)}
        for name, run in (("eager", eager), ("graphed", graphed)):
            if "error" not in run and "error" not in ref and run["losses"] and len(run["losses"]) == len(ref["losses"]):
                rel = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(run["losses"], ref["losses"]))
                row[f"{name}_loss_rel_err_vs_tp1"] = rel
                worst = max(worst, rel)
        by_seq[f"seq{seq}"] = row
        summary[f"speed_vs_eager_seq{seq}"] = row["graphed_vs_eager"].get("speedup_tokens_per_s")
    summary["loss_max_rel_err"] = worst
    summary["loss_within_bf16_tolerance"] = worst <= BF16_RTOL
    for tag, row in by_seq.items():
        cmp_ = row["graphed_vs_eager"]
        print(f"{tag}: graphed/eager speed {cmp_.get('speedup_tokens_per_s')} peak {cmp_.get('peak_mem_ratio')} "
              f"steady {cmp_.get('steady_peak_mem_ratio')}; loss vs TP=1 eager {row.get('graphed_loss_rel_err_vs_tp1')}")
    payload = {"command": benchlib.command(), **benchlib.environment(), "config": BASE + ["--pp", str(args.pp)],
               "summary": summary,
               "by_seq": by_seq, "runs": {f"seq{s}_{n}": v for (s, n), v in records.items()}}
    path = benchlib.write_result(f"hybrid-tp2pp{args.pp}", payload)
    print(f"wrote {path}")
    return 0 if all("error" not in r for rs in records.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
