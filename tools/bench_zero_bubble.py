#!/usr/bin/env python
"""Zero-bubble pipeline schedules with and without CUDA graphs (issue 14's benchmark).

Two GPUs (the acceptance run)::

    python tools/bench_zero_bubble.py                   # GPT-3 1.3B shape, bf16, pp=2

For each sequence length (512, 2048) and micro-batch count (4, 8) it trains the 1.3B shape
(hidden 2048, 24 layers, 16 heads, vocab 50304, micro-batch 1, sdpa attention, dropout 0.1)
through ``tools/train_gpt.py --framework torch --dtype bfloat16`` under eager 1F1B, graphed
1F1B, and each zero-bubble schedule this torch has (``interleaved_zb``, ``zbv``,
``dualpipev``, with ``--vpp 2``) eager and graphed. Each run reports tokens/s over the steps
after warmup and capture, and, per rank, the compute-busy share of its last steps
(``--profile-steps``, ``tools/diagnostics/busy.py``). Graphed losses are checked against the eager run of
the same schedule (bf16: relative 1e-3). The result goes to
``benchmarks/results/zero-bubble-<device>.json``; its ``summary`` holds
``best_graphed_zb_vs_graphed_1f1b`` at seq 2048 with 4 micro-batches (target >= 1.10) and
``graphed_zb_vs_eager_zb`` per setting (target >= 1.0 everywhere, >= 1.3 at seq 512).

One GPU (``--single-gpu``): what splitting the backward costs, without a pipeline. A stack of
``--blocks`` 1.3B-shaped blocks runs four micro-batches per step with full backwards (1F1B
order) and with input and weight passes (a zero-bubble order, through torch.distributed.
pipelining's ``stage_backward_input`` / ``stage_backward_weight``), eagerly and graphed;
milliseconds per step go to ``benchmarks/results/zero-bubble-split-<device>.json``.

The settings can run as separate commands on separate GPU pairs and be joined afterwards::

    python tools/bench_zero_bubble.py --seq 2048 --name zero-bubble-seq2048   # GPUs 0,1
    python tools/bench_zero_bubble.py --seq 512 --name zero-bubble-seq512     # GPUs 2,3
    python tools/bench_zero_bubble.py --merge benchmarks/results/zero-bubble-seq*-<device>.json

``--merge`` recomputes the summary over the joined settings (no GPU) and writes
``<name>-<device>.json`` with every part's command. Parts may share a setting: a schedule one
part lacks, or ran only half of (out of budget), is taken from a part that ran it eager and
graphed (``--schedules`` runs a few again). The summary also holds, per setting and schedule,
graphed over eager peak memory (``memory_graphed_vs_eager``, each run's larger rank; bound 1.05). With ``--speed-rounds ROUNDS.json`` (a
``tools/diagnostics/bench_rounds.py`` record at seq 2048 with 4 micro-batches whose first variant is
``graphed_1f1b`` and whose others are ``graphed_<schedule>``, run without the profiler) the
summary's ``best_graphed_zb_vs_graphed_1f1b`` is the best ratio of the rounds' medians, with their
spread; the ratio of this benchmark's single profiled runs stays beside it
(``best_graphed_zb_vs_graphed_1f1b_single_run``).

``--smoke`` runs tiny configurations for a few steps (CPU allowed) and writes nothing.
Exit status: 0 when every run finished and every check passed, 1 otherwise, 2 when the machine
cannot run the benchmark.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import sys
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)
from tools import benchlib  # noqa: E402
from tools.bench_pipeline import RECORD_LR, run_one  # noqa: E402
from testing.parity import run_order  # noqa: E402

BUDGET_S = 3600
LOSS_RTOL = 1e-3  # bf16: two eager runs already differ by ~1e-6; a wrong gradient shows far above this
SHAPE_ARGS = ["--hidden", "2048", "--layers", "24", "--heads", "16", "--vocab", "50304", "--micro-batch-size", "1",
              "--dtype", "bfloat16", "--attention", "sdpa", "--dropout", "0.1", *RECORD_LR]
SMOKE_SHAPE_ARGS = ["--hidden", "64", "--layers", "4", "--heads", "2", "--vocab", "256", "--micro-batch-size", "2",
                    "--dropout", "0.1", *RECORD_LR]
ZERO_BUBBLE = {"interleaved_zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
               "dualpipev": "ScheduleDualPipeV"}
TARGET_ZB_OVER_1F1B = 1.10
TARGET_GRAPHED_OVER_EAGER = 1.0
TARGET_GRAPHED_OVER_EAGER_SEQ512 = 1.3
MEMORY_BOUND = 1.05  # graphed over eager peak memory (the memory issue's bound)


def schedule_args(schedule: str) -> list:
    return ["--pp", "2"] if schedule == "1f1b" else ["--pp", "2", "--vpp", "2", "--schedule", schedule]


def busy_of(record: dict) -> list:
    return [r.get("compute_busy") for r in record.get("per_rank") or []]


def losses_agree(a: dict, b: dict) -> bool:
    la, lb = a.get("losses") or [], b.get("losses") or []
    return bool(la) and len(la) == len(lb) and all(abs(x - y) <= LOSS_RTOL * max(1.0, abs(y)) for x, y in zip(la, lb))


def two_gpu(opts, schedules: list) -> int:
    seqs = [64] if opts.smoke else opts.seq
    mbs = [4] if opts.smoke else opts.micro_batches
    steps = 6 if opts.smoke else opts.steps
    shape = SMOKE_SHAPE_ARGS if opts.smoke else SHAPE_ARGS
    deadline = time.monotonic() + opts.budget
    runs, settings = [], []
    for seq in seqs:
        for n_mb in mbs:
            setting = {"seq_len": seq, "micro_batches": n_mb, "schedules": {}}
            for schedule in ["1f1b", *schedules]:
                pair = {}
                for variant, extra in (("eager", []), ("graphed", ["--cudagraph"])):
                    remaining = deadline - time.monotonic()
                    if remaining < 60:
                        pair[variant] = {"error": "skipped: the benchmark's time budget is spent"}
                        continue
                    args = ["--framework", "torch", *schedule_args(schedule), *shape, "--seq-len", str(seq),
                            "--micro-batches", str(n_mb), "--steps", str(steps), "--seed", "1234", "--timeout", "300",
                            *([] if opts.smoke else ["--profile-steps", "3"]), *shlex.split(opts.trainer_args), *extra]
                    print(f"[seq {seq} / {n_mb} micro-batches / {schedule} / {variant}] ...", flush=True)
                    record = run_one(args, timeout=min(600.0, remaining - 30))
                    record.update(seq_len=seq, micro_batches=n_mb, schedule=schedule, variant=variant)
                    runs.append(record)
                    if "error" in record:
                        print(f"  failed: {record['error']}\n{record.get('stderr_tail', '')[-1500:]}", flush=True)
                    pair[variant] = {k: record.get(k) for k in ("error", "tokens_per_s", "peak_mem_mib",
                                                                 "steady_peak_mem_mib") if k in record}
                    pair[variant]["compute_busy_per_rank"] = busy_of(record)
                    pair[variant]["_record"] = record
                eager, graphed = pair.get("eager", {}), pair.get("graphed", {})
                ok = "error" not in eager and "error" not in graphed
                pair["losses_agree"] = ok and losses_agree(graphed["_record"], eager["_record"])
                pair["graphed_vs_eager"] = (graphed["tokens_per_s"] / eager["tokens_per_s"]) if ok else None
                for v in ("eager", "graphed"):
                    pair.get(v, {}).pop("_record", None)
                setting["schedules"][schedule] = pair
            settings.append(setting)

    summary = summarize(settings, schedules)
    print(json.dumps(summary, indent=1))
    if opts.smoke:
        return 0 if all("error" not in r for r in runs) else 1
    payload = {"command": benchlib.command(), **benchlib.environment(), "steps": steps, "shape": shape,
               "trainer_args": opts.trainer_args, "summary": summary, "settings": settings,
               "runs": [{k: r[k] for k in ("command", "seconds", "error", "stderr_tail", "tokens_per_s", "losses",
                                         "per_rank", "timed_steps") if k in r} for r in runs]}
    path = benchlib.write_result(opts.name, payload)
    print(f"wrote {path}")
    return 0 if summary["all_ok"] else 1


def summarize(settings: list, schedules: list) -> dict:
    """The acceptance figures: the best graphed zero-bubble schedule over graphed 1F1B at seq 2048
    with 4 micro-batches, and graphed over eager for each zero-bubble schedule and setting."""
    best_at_2048_4, zb_ratios, memory, all_ok = None, {}, {}, True
    for s in settings:
        tag = f"seq{s['seq_len']}_mb{s['micro_batches']}"
        pairs = s["schedules"]
        all_ok &= all(p["losses_agree"] for p in pairs.values())
        base = pairs["1f1b"]["graphed"].get("tokens_per_s")
        ratios = {}
        for name in schedules:
            zb = pairs[name]
            ratios[name] = zb["graphed_vs_eager"]
            if s["seq_len"] == 2048 and s["micro_batches"] == 4 and base and zb["graphed"].get("tokens_per_s"):
                over = zb["graphed"]["tokens_per_s"] / base
                best_at_2048_4 = over if best_at_2048_4 is None else max(best_at_2048_4, over)
        zb_ratios[tag] = ratios
        memory[tag] = {name: _memory_ratio(pair) for name, pair in pairs.items()}
    memory_ratios = [r for by_name in memory.values() for r in by_name.values()]
    meets = {
        "best_graphed_zb_vs_graphed_1f1b": best_at_2048_4 is not None and best_at_2048_4 >= TARGET_ZB_OVER_1F1B,
        "graphed_zb_vs_eager_zb": all(
            r is not None and r >= (TARGET_GRAPHED_OVER_EAGER_SEQ512 if tag.startswith("seq512_") else
                                    TARGET_GRAPHED_OVER_EAGER)
            for tag, ratios in zb_ratios.items() for r in ratios.values()),
        "memory_graphed_vs_eager": (all(r is not None and r <= MEMORY_BOUND for r in memory_ratios)
                                    if any(r is not None for r in memory_ratios) else None),
    }
    return {"all_ok": all_ok, "loss_rtol": LOSS_RTOL, "best_graphed_zb_vs_graphed_1f1b": best_at_2048_4,
            "graphed_zb_vs_eager_zb": zb_ratios, "memory_graphed_vs_eager": memory, "targets": {
                "best_graphed_zb_vs_graphed_1f1b": TARGET_ZB_OVER_1F1B,
                "graphed_zb_vs_eager_zb": TARGET_GRAPHED_OVER_EAGER,
                "graphed_zb_vs_eager_zb_seq512": TARGET_GRAPHED_OVER_EAGER_SEQ512,
                "memory_graphed_vs_eager": MEMORY_BOUND},
            "meets_target": meets}


def _memory_ratio(pair: dict) -> Optional[float]:
    """Graphed over eager peak memory (each run's larger rank, the capture step included)."""
    graphed, eager = pair["graphed"].get("peak_mem_mib"), pair["eager"].get("peak_mem_mib")
    return graphed / eager if graphed and eager else None


def _complete(pair: dict) -> bool:
    return bool(pair["eager"].get("tokens_per_s") and pair["graphed"].get("tokens_per_s"))


def join_settings(settings: list) -> list:
    """One setting per (sequence, micro-batches): a schedule missing from the first part of a
    setting, or whose eager or graphed run is missing there (its part ran out of budget), is
    taken from a later part that ran both, so each graphed / eager ratio compares runs of one
    part (a ratio over graphed 1F1B takes the first part's 1F1B)."""
    joined: dict = {}
    for s in settings:
        key = (s["seq_len"], s["micro_batches"])
        have = joined.get(key)
        if have is None:
            joined[key] = copy.deepcopy(s)
            continue
        for name, pair in s["schedules"].items():
            mine = have["schedules"].get(name)
            if mine is None or (not _complete(mine) and _complete(pair)):
                have["schedules"][name] = copy.deepcopy(pair)
    return list(joined.values())


def speed_from_rounds(record: dict) -> dict:
    """``best_graphed_zb_vs_graphed_1f1b`` from a bench_rounds record (see the module docstring).

    Raises ValueError when the record is not of that setting or names no zero-bubble variant."""
    base = record.get("base") or []
    for flag, want in (("--seq-len", "2048"), ("--micro-batches", "4")):
        if flag not in base or base[base.index(flag) + 1] != want:
            raise ValueError(f"the rounds record's base has no {flag} {want}: {' '.join(base)}")
    if "--profile-steps" in base:
        raise ValueError("the rounds record was profiled; time rounds without --profile-steps")
    summary = record.get("summary") or {}
    names = list(summary)
    if not names or names[0] != "graphed_1f1b":
        raise ValueError(f"the rounds record's first variant must be graphed_1f1b, not {names[:1]}")
    ratios = {name.removeprefix("graphed_"): row for name, row in summary.items()
              if name.removeprefix("graphed_") in ZERO_BUBBLE and row.get("speed_vs_first")}
    if not ratios:
        raise ValueError(f"the rounds record has no graphed_<schedule> variant of {list(ZERO_BUBBLE)}: {names}")
    detail = {name: {"speed_vs_graphed_1f1b": row["speed_vs_first"], "tokens_per_s_rounds": row["tokens_per_s_rounds"],
                     "spread": row["spread"]} for name, row in ratios.items()}
    detail["1f1b"] = {k: summary["graphed_1f1b"][k] for k in ("tokens_per_s_rounds", "spread")}
    return {"best": max(row["speed_vs_first"] for row in ratios.values()), "rounds": len(
        summary["graphed_1f1b"]["tokens_per_s_rounds"]), "command": record.get("command"), "per_schedule": detail}


def merge(opts) -> int:
    """Join result files of separate two-GPU runs (same shape and steps) into one record."""
    parts = []
    for path in opts.merge:
        try:
            with open(path) as f:
                parts.append(json.load(f))
        except (OSError, ValueError) as exc:
            print(f"bench_zero_bubble --merge: cannot read {path}: {exc}", file=sys.stderr)
            return 2
    first = parts[0]
    for path, part in zip(opts.merge, parts):
        for key in ("device", "shape", "steps", "torch", "trainer_args"):
            if part.get(key) != first.get(key):
                print(f"bench_zero_bubble --merge: {path} has {key}={part.get(key)!r}, {opts.merge[0]} has "
                      f"{first.get(key)!r}; merge only runs of one benchmark configuration", file=sys.stderr)
                return 2
    settings = join_settings([s for part in parts for s in part["settings"]])
    schedules = [name for name in ZERO_BUBBLE if name in settings[0]["schedules"]]
    summary = summarize(settings, schedules)
    if opts.speed_rounds:
        try:
            with open(opts.speed_rounds) as f:
                rounds = speed_from_rounds(json.load(f))
        except (OSError, ValueError) as exc:
            print(f"bench_zero_bubble --speed-rounds {opts.speed_rounds}: {exc}", file=sys.stderr)
            return 2
        single = summary["best_graphed_zb_vs_graphed_1f1b"]
        best = rounds.pop("best")
        summary = {**summary, "best_graphed_zb_vs_graphed_1f1b": best,
                   "best_graphed_zb_vs_graphed_1f1b_single_run": single, "speed_rounds": rounds}
        summary["meets_target"]["best_graphed_zb_vs_graphed_1f1b"] = best >= TARGET_ZB_OVER_1F1B
    print(json.dumps(summary, indent=1))
    env = {k: first.get(k) for k in ("date", "python", "torch", "cuda", "device", "device_count", "nccl")}
    payload = {"command": benchlib.command(), "parts": [p["command"] for p in parts], **env, "steps": first["steps"],
               "shape": first["shape"], "trainer_args": first.get("trainer_args"), "summary": summary,
               "settings": settings,
               "runs": [r for p in parts for r in p["runs"]]}
    path = benchlib.write_result(opts.name, payload, slug=benchlib.slug_of(first["device"]))
    print(f"wrote {path}")
    return 0 if summary["all_ok"] else 1


# ------------------------------------------------------------------------------- one GPU
FULL_ORDER = "f1 f2 b1 f3 b2 f4 b3 b4"
SPLIT_ORDER = "f1 f2 i1 f3 i2 w1 f4 i3 w2 i4 w3 w4"


def split_loss(output):
    return output.float().square().mean()


def single_gpu(opts) -> int:
    import torch

    from paddle_graphpp.torch import CUDAGraphedModule
    from testing.gpt_shape import GPTShape
    from testing.gpt_torch import Block

    smoke = opts.smoke
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not smoke:
        print("bench_zero_bubble --single-gpu: needs a GPU (or --smoke)", file=sys.stderr)
        return 2
    dtype = torch.float32 if smoke else torch.bfloat16
    results, ok = {}, True
    for seq in ([32] if smoke else opts.seq):
        shape = (GPTShape(hidden=64, heads=2, vocab=256, seq_len=seq, layers=2, dropout=0.1) if smoke else
                 GPTShape(hidden=2048, heads=16, vocab=50304, seq_len=seq, layers=opts.blocks, dropout=0.1,
                          attention="sdpa"))
        torch.manual_seed(0)
        stack = torch.nn.Sequential(*[Block(shape) for _ in range(shape.layers)]).to(device=device, dtype=dtype)
        # A graphed model replays the schedule it was captured under: one per order.
        models = {"eager_full": stack, "eager_split": stack,
                  "graphed_full": CUDAGraphedModule(copy.deepcopy(stack), num_warmup_steps=2),
                  "graphed_split": CUDAGraphedModule(copy.deepcopy(stack), num_warmup_steps=2)}
        base = [torch.randn(1 if not smoke else 2, seq, shape.hidden, device=device, dtype=dtype) for _ in range(4)]
        variants, losses = {}, {}
        for key, model in models.items():
            order = SPLIT_ORDER if key.endswith("split") else FULL_ORDER

            def one(model=model, order=order, key=key):
                xs = [b.clone().requires_grad_(True) for b in base]
                losses[key] = run_order(model, xs, order, split_loss)
                model.zero_grad(set_to_none=False)

            variants[key] = one
        for key, fn in variants.items():  # warmup, record and capture (graphed: full and split positions)
            for _ in range(4):
                fn()
        if smoke:
            for fn in variants.values():
                fn()
            timings = {k: None for k in variants}
        else:
            timings = benchlib.time_rounds(variants, iters=opts.iters, rounds=opts.rounds)
        entry = {"timings_ms": timings}
        if not smoke:
            med = {k: v["median_ms"] for k, v in timings.items()}
            entry["split_over_full_eager"] = med["eager_split"] / med["eager_full"]
            entry["split_over_full_graphed"] = med["graphed_split"] / med["graphed_full"]
            entry["graphed_over_eager_split"] = med["eager_split"] / med["graphed_split"]
        split = models["graphed_split"].engine
        entry["graphs"] = {k: {"captures": models[k].engine.captures, "positions": models[k].engine.position_kinds()}
                           for k in ("graphed_full", "graphed_split")}
        results[f"seq{seq}"] = entry
        ok &= split.position_kinds()["split"] == 4 or device == "cpu"
        del models, variants, stack
    print(json.dumps(results, indent=1))
    if smoke:
        return 0
    payload = {"command": benchlib.command(), **benchlib.environment(), "blocks": opts.blocks,
               "orders": {"full": FULL_ORDER, "split": SPLIT_ORDER}, "results": results}
    path = benchlib.write_result(f"{opts.name}-split", payload)
    print(f"wrote {path}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--schedules", nargs="+", default=list(ZERO_BUBBLE), choices=list(ZERO_BUBBLE))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--trainer-args", default="", metavar="ARGS",
                        help="more tools/train_gpt.py arguments for every run "
                             "(written as --trainer-args=--no-return-outputs)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole two-GPU benchmark")
    parser.add_argument("--name", default="zero-bubble", help="result file name: <name>-<device>.json")
    parser.add_argument("--single-gpu", action="store_true", help="the one-GPU cost of splitting the backward")
    parser.add_argument("--blocks", type=int, default=6, help="--single-gpu: 1.3B-shaped blocks in the stack")
    parser.add_argument("--iters", type=int, default=5, help="--single-gpu: steps per timing round")
    parser.add_argument("--rounds", type=int, default=3, help="--single-gpu: timing rounds")
    parser.add_argument("--smoke", action="store_true", help="tiny configurations, CPU allowed, no result file")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="join the result files of separate runs")
    parser.add_argument("--speed-rounds", metavar="JSON",
                        help="with --merge: take the seq-2048, 4-micro-batch ratio from this bench_rounds record")
    opts = parser.parse_args()
    if opts.speed_rounds and not opts.merge:
        parser.error("--speed-rounds goes with --merge")
    if opts.merge:
        return merge(opts)
    if opts.single_gpu:
        return single_gpu(opts)
    if opts.steps < 8:
        print("bench_zero_bubble: --steps must be at least 8 (warmup, capture, then timed and profiled steps)",
              file=sys.stderr)
        return 2

    import torch
    import torch.distributed.pipelining as pipelining

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2 and not opts.smoke:
        print(f"bench_zero_bubble: needs 2 GPUs, found {gpus}; run it on a 2-GPU machine (or --single-gpu, "
              f"--smoke)", file=sys.stderr)
        return 2
    schedules = [s for s in opts.schedules if hasattr(pipelining, ZERO_BUBBLE[s])]
    if not schedules:
        print(f"bench_zero_bubble: torch {torch.__version__} has none of {list(ZERO_BUBBLE.values())}", file=sys.stderr)
        return 2
    return two_gpu(opts, schedules)


if __name__ == "__main__":
    sys.exit(main())
