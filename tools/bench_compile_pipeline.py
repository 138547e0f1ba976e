#!/usr/bin/env python
"""Compiled blocks inside graphed pipeline stages against torch.compile alone (2 GPUs, pp=2; or
the model on one GPU, --pp 1).

    python tools/bench_compile_pipeline.py            # writes benchmarks/results/compile-pipeline-pp2-<device>.json
    python tools/bench_compile_pipeline.py --pp 1     # one GPU, no pipeline: compile-pipeline-pp1-<device>.json
    python tools/bench_compile_pipeline.py --dry-run  # prints the runs
    python tools/bench_compile_pipeline.py --smoke    # a tiny configuration, CPU allowed, writes nothing

GPT-3 1.3B shape trained as :data:`tools.bench_pipeline.GPT3_1P3B_RUN` (hidden 2048, 24 layers,
16 heads, vocab 50304, bf16, micro-batch 1, 8 micro-batches, dropout off, lr 2e-5 after a 3-step
warmup), torch pipelining 1F1B over 2 GPUs, ``tools/train_gpt.py --pp 2``, 12 steps. Three
variants, each run in its own processes:

* ``compile``: eager stages whose modules (embedding, blocks, final norm, head) and the loss
  function each run through ``torch.compile`` (Inductor, default mode); the schedule and its
  sends and receives stay eager (``--compile``).
* ``ours``: the stages' graphs alone (``--cudagraph``; the loss graphed with them).
* ``ours_compiled``: the same modules and the loss compiled in the graphs' warmup and captured
  (``--cudagraph --compile``: ``graph_stage_module(..., compile=True)``,
  ``graph_loss(..., compile=True)``).

Per sequence length (2048 first, then 512), ``--rounds`` rounds in alternating order (compile,
ours, ours_compiled; then reversed); every length's first round runs before any second round,
so a short budget loses second rounds only. Speed: tokens/s over the steps after warmup and
capture, and for compiled runs two more (train_gpt's ``untimed_steps``: 4, or 6 compiled);
medians over the rounds, with the spread. The first compiled run of a length pays Inductor's
cold compile (its on-disk cache serves the later ones), inside the untimed steps; each run
reports the steps in which dynamo compiled (``compiles_before_timed_steps`` checks that none
was timed). Memory per rank: the peak including the capture step, and the steady peak after it.

Losses: ``ours_compiled`` against the first ``compile`` run, judged against
``loss_tolerance`` = max(``compile_loss_spread``, :data:`tools.benchlib.BF16_LOSS_RTOL`):
the spread is the largest per-step relative difference between the ``compile`` rounds
(identical runs; it needs two rounds), the bf16 floor sets the tolerance when they agree more
closely than that (``loss_judged_by``). ``loss_falls``: every run ends below its first loss.

``summary`` = ``{"ours_compiled_vs_compile_seq512", "ours_compiled_vs_compile_seq2048",
"ours_compiled_vs_ours_seq2048", ...}`` (speed ratios of the medians); ``meets_targets``: at
seq 2048 ours_compiled is at least 1.10x compile and 1.05x ours.
Exit status: 0 when every run finished, 1 otherwise, 2 when the machine cannot run it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)
from tools import benchlib  # noqa: E402
from tools.bench_pipeline import GPT3_1P3B_RUN, compare, print_plan, run_plan, slim, summarize  # noqa: E402

NAME = "compile-pipeline-pp{pp}"


def base_args(pp: int) -> list:
    """The trainer's arguments every run shares, at ``pp`` stages (one GPU each)."""
    return GPT3_1P3B_RUN + ["--pp", str(pp), "--steps", "12"]


BASE = base_args(2)
SEQS = (2048, 512)
VARIANTS = {"compile": ["--compile"], "ours": ["--cudagraph"], "ours_compiled": ["--cudagraph", "--compile"]}
TARGETS = {"ours_compiled_vs_compile_seq2048": 1.10, "ours_compiled_vs_ours_seq2048": 1.05}
BUDGET_S = 510.0  # the whole benchmark within 9 minutes
RUN_CAP_S = 200.0  # a cold Inductor compile of the 1.3B blocks included
# --smoke: a tiny model on two CPU ranks; aot_eager (dynamo + AOTAutograd, no Inductor) compiles in seconds
SMOKE_BASE = ["--framework", "torch", "--pp", "2", "--hidden", "64", "--layers", "4", "--heads", "2",
              "--micro-batch-size", "2", "--micro-batches", "4", "--dropout", "0", "--lr-warmup", "2",
              "--steps", "8", "--timeout", "60"]
SMOKE_SEQS = (64, 32)


def plan(rounds: int, seqs=SEQS, *, base=BASE, backend: str = "") -> list:
    """(label, seq, train_gpt arguments) in run order: round r of every sequence length before
    round r + 1, the variants in order in even rounds and reversed in odd ones. ``backend``:
    a ``--compile BACKEND`` other than Inductor (the smoke run's)."""
    runs = []
    for r in range(rounds):
        for seq in seqs:
            order = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
            runs += [(label, seq, base + ["--seq-len", str(seq)] + variant_args(label, backend)) for label in order]
    return runs


def variant_args(label: str, backend: str = "") -> list:
    """A variant's train_gpt flags, ``--compile`` naming ``backend`` when one is given."""
    args = list(VARIANTS[label])
    if backend and "--compile" in args:
        args.insert(args.index("--compile") + 1, backend)
    return args


def losses_of(runs: list) -> list:
    return [r["losses"] for r in runs if "error" not in r]


def compile_timing(runs: list) -> dict:
    """Where the compiled runs compiled: ``compiled_on_every_rank`` (each rank of each finished
    run compiled a frame), ``compile_steps`` (the steps, over ranks and runs) and
    ``before_timed_steps`` (all of them before the run's first timed step)."""
    ok = [r for r in runs if "error" not in r]
    ranks = [(rank, r.get("untimed_steps")) for r in ok for rank in r.get("per_rank") or []]
    steps = sorted({s for rank, _ in ranks for s in rank.get("compile_steps", [])})
    return {"compiled_on_every_rank": bool(ranks) and all(rank.get("frames_compiled", 0) > 0 for rank, _ in ranks),
            "compile_steps": steps,
            "before_timed_steps": bool(ranks) and all(
                skip is not None and all(s < skip for s in rank.get("compile_steps", [])) for rank, skip in ranks)}


def seq_row(runs: dict) -> dict:
    """One sequence length: each variant's medians, the three comparisons, the loss check and
    where the compiled runs compiled. ``runs``: ``{variant: [train_gpt record, ...]}``."""
    s = {v: summarize(runs.get(v, [])) for v in VARIANTS}
    loss = benchlib.loss_check(losses_of(runs.get("compile", [])), losses_of(runs.get("ours_compiled", [])),
                               floor=benchlib.BF16_LOSS_RTOL)
    floor = benchlib.BF16_LOSS_RTOL
    return {**s, "ours_compiled_vs_compile": compare(s["compile"], s["ours_compiled"], rtol=loss["tolerance"]),
            "ours_compiled_vs_ours": compare(s["ours"], s["ours_compiled"], rtol=floor),
            "ours_vs_compile": compare(s["compile"], s["ours"], rtol=floor),
            "loss_vs_compile": loss,
            "compile_timing": compile_timing(runs.get("compile", []) + runs.get("ours_compiled", []))}


def summarize_compile(records: dict, seqs, pp: int = 2) -> tuple:
    """``(by_seq, summary)`` from ``{(seq, variant): [train_gpt record, ...]}``. The targets are
    the pipeline's (``pp`` 2): a run at ``pp`` 1 is not judged against them."""
    by_seq = {f"seq{seq}": seq_row({v: records.get((seq, v), []) for v in VARIANTS}) for seq in seqs}
    summary = {}
    for tag, row in by_seq.items():
        for pair in ("ours_compiled_vs_compile", "ours_compiled_vs_ours", "ours_vs_compile"):
            summary[f"{pair}_{tag}"] = row[pair].get("speedup_tokens_per_s")
        summary[f"ours_compiled_peak_vs_compile_per_rank_{tag}"] = \
            row["ours_compiled_vs_compile"].get("peak_mem_ratio_per_rank")
    checks = [row["loss_vs_compile"] for row in by_seq.values()]
    timings = [row["compile_timing"] for row in by_seq.values()]
    summary.update({
        "loss_max_rel_err": max((c["max_rel_err"] for c in checks if c["max_rel_err"] is not None), default=None),
        "compile_loss_spread": max((c["reference_spread"] for c in checks if c["reference_spread"] is not None),
                                   default=None),
        "loss_tolerance": {tag: row["loss_vs_compile"]["tolerance"] for tag, row in by_seq.items()},
        "loss_judged_by": {tag: row["loss_vs_compile"]["judged_by"] for tag, row in by_seq.items()},
        "loss_within_compile_spread": bool(checks) and all(c["within"] for c in checks),
        "loss_falls": benchlib.loss_falls([l for runs in records.values() for l in losses_of(runs)]),
        "compiled_on_every_rank": bool(timings) and all(t["compiled_on_every_rank"] for t in timings),
        "compiles_before_timed_steps": bool(timings) and all(t["before_timed_steps"] for t in timings),
        "targets": TARGETS if pp == 2 else None,
        "meets_targets": (all(summary.get(k) is not None and summary[k] >= v for k, v in TARGETS.items())
                          if pp == 2 else None),
    })
    return by_seq, summary


def print_table(by_seq: dict) -> None:
    print(f"{'seq':<9}{'variant':<15}{'tok/s':>10}{'spread':>8}  peak MiB per rank / steady")
    for tag, row in by_seq.items():
        for v in VARIANTS:
            r = row[v]
            tps = f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else r.get("error", "-")[:10]
            spread = f"{r['spread']:.2f}" if "spread" in r else "-"
            mib = lambda key: [round(x) for x in r.get(key) or []]  # noqa: E731
            print(f"{tag:<9}{v:<15}{tps:>10}{spread:>8}  {mib('peak_mem_mib_per_rank')} / "
                  f"{mib('steady_peak_mem_mib_per_rank')}")
        loss = row["loss_vs_compile"]
        print(f"{tag:<9}ours_compiled / compile {row['ours_compiled_vs_compile'].get('speedup_tokens_per_s')}, "
              f"/ ours {row['ours_compiled_vs_ours'].get('speedup_tokens_per_s')}; loss vs compile "
              f"{loss['max_rel_err']} (tolerance {loss['tolerance']}, by {loss['judged_by']})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, choices=(1, 2), default=2,
                        help="pipeline stages, one GPU each (1: the model on one GPU, no pipeline)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the three variants per length")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all runs")
    parser.add_argument("--seqs", type=int, nargs="+", default=None, help="sequence lengths (default: 2048 512)")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and exit")
    parser.add_argument("--smoke", action="store_true", help="tiny configuration, CPU allowed, no result file")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.smoke and args.pp != 2:
        parser.error("--smoke runs the tiny model at pp=2 (two CPU ranks); leave --pp out")
    seqs = args.seqs or (SMOKE_SEQS if args.smoke else SEQS)
    base = base_args(args.pp)
    runs_plan = (plan(args.rounds, seqs, base=SMOKE_BASE, backend="aot_eager") if args.smoke
                 else plan(args.rounds, seqs, base=base))
    if args.dry_run:
        print_plan(runs_plan)
        return 0
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < args.pp and not args.smoke:
        print(f"bench_compile_pipeline: needs {args.pp} GPUs (pp={args.pp}), found {gpus}; or pass --smoke",
              file=sys.stderr)
        return 2
    records = run_plan(runs_plan, budget=args.budget, run_cap=RUN_CAP_S)
    by_seq, summary = summarize_compile(records, seqs, pp=2 if args.smoke else args.pp)
    print_table(by_seq)
    finished = all("error" not in r for rs in records.values() for r in rs)
    if args.smoke:
        print(json.dumps(summary))
        return 0 if finished else 1
    payload = {"command": benchlib.command(), **benchlib.environment(), "code_version": benchlib.code_version(),
               "pp": args.pp, "config": base, "variants": VARIANTS, "rounds": args.rounds, "summary": summary,
               "by_seq": by_seq,
               "runs": {f"seq{s}_{v}": [slim(r) for r in rs] for (s, v), rs in records.items()}}
    path = benchlib.write_result(NAME.format(pp=args.pp), payload)
    print(f"wrote {path}")
    print(json.dumps(summary))
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
