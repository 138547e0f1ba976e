#!/usr/bin/env python
"""Graphed blocks inside the training stacks users run, each against the same stack eager, on one GPU.

    python tools/bench_stacks.py                          # every stack, 3 rounds; ~6 min on an H200
    python tools/bench_stacks.py --stacks plain,checkpoint --rounds 2
    python tools/bench_stacks.py --dry-run                # the worker commands in run order, nothing run
    python tools/bench_stacks.py --worker plain graphed   # one run, one JSON line (what the driver starts)

The model is an unmodified Hugging Face ``LlamaForCausalLM`` built from a config, no download:
``tools/compile_worker.py``'s ``small`` shape (hidden 512, 8 layers, 8 heads, 4 kv heads,
intermediate 1376, vocab 8192), micro-batch 2 x 256 tokens, 4 micro-batches per optimizer step,
``use_cache=False``, fp32 weights trained in bf16 (autocast, or the stack's own bf16 setting),
the same seeds and token ids in every run. ``graphed`` is the stack with one line added before
training, as a user adds it: ``graph_layers(model.model.layers)``. The stacks:

* ``plain``: a hand-written loop under ``torch.autocast(bf16)``, ``clip_grad_norm_(1.0)``, fused
  AdamW, a cosine schedule (``torch.optim.lr_scheduler.CosineAnnealingLR``).
* ``hf_trainer``: transformers' ``Trainer`` (``bf16=True``, ``gradient_accumulation_steps=4``,
  ``max_grad_norm=1.0``, cosine schedule with one warmup step, ``logging_steps=1``,
  ``report_to=[]``); the per-step losses are its log history's.
* ``lightning``: a ``LightningModule`` under ``lightning`` (or ``pytorch_lightning``) with
  ``precision="bf16-mixed"``, ``accumulate_grad_batches=4``, ``gradient_clip_val=1.0``, AdamW;
  ``graph_layers`` in the module's ``__init__``. Skipped, with the reason, where neither is installed.
* ``checkpoint``: the plain loop with ``model.gradient_checkpointing_enable()`` (non-reentrant)
  and attention dropout 0.1 (so the recomputation must replay the same masks); three variants:
  ``eager`` and ``graphed`` checkpointed (the graphs recompute inside their backward graphs),
  and ``graphed_no_checkpoint``.
* ``fsdp2``: the plain loop over a one-rank NCCL group, ``fully_shard`` on every decoder block and
  on the root (``graph_layers`` before it).

Method: every run is its own process (``--worker STACK VARIANT``; allocator statistics and
the process group are per process) under ``--worker-timeout``; a run that fails or times out
is recorded with the tail of its stderr and the others go on. Runs go round by round, every
stack in each round, its variants in turn with the order reversed every round (eager,
graphed; graphed, eager; ...). A run trains ``--steps`` optimizer steps; the first
:data:`WARM_STEPS` (warmup, recording and capture) are not timed: tokens/s is the tokens of the
later steps over their time (CUDA synchronised at every step's end, in every variant). Memory:
``peak``: ``torch.cuda.max_memory_allocated()`` over the whole run, the capture included;
``steady``: the peak over the later steps (the statistics reset after the warm steps). The
``*_reserved_*`` figures beside them are the allocator's reserved memory
(``tools/benchlib.DeviceMemory``): graphs keep their activations in a private pool whose blocks
the allocated counters see as free between replays, so reserved is the figure that holds them.
Per variant the record gives the median over its runs and the spread (slowest run over the
fastest); losses: each run's per-step losses against the first eager run's (bit-for-bit flag,
largest absolute and relative difference), and the same among the eager runs (bf16 eager runs
may differ from each other). ``--budget`` stops starting runs once what is left cannot hold the
next one (the longest earlier run of its stack and variant); what ran is recorded.

Writes ``benchmarks/results/<name>-<device>.json`` (``--name``, default ``stacks``; a copy under
$OUT): command, device, date, versions, code version, settings, per stack every run, the
variants' medians and spreads, speed and memory ratios against eager, loss agreement, and a
``summary`` of the headline figures; prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)

from testing import launch  # noqa: E402
from tools import benchlib  # noqa: E402
from tools.compile_worker import SHAPES, error_text, reply_channel  # noqa: E402

SCRIPT = str(Path(__file__).resolve())
SHAPE = SHAPES["small"]
MICRO_BATCHES = 4
TOKENS_PER_STEP = MICRO_BATCHES * SHAPE.micro_batch * SHAPE.seq
WARM_STEPS = 3  # untimed: eager warmup, the recorded step, the capture (graph_layers' defaults)
LR = 1e-3
DEVICE = "cuda"
DROPOUT = {"checkpoint": 0.1}  # attention dropout per stack; 0.0 elsewhere
VARIANTS = {
    "plain": ("eager", "graphed"),
    "hf_trainer": ("eager", "graphed"),
    "lightning": ("eager", "graphed"),
    "checkpoint": ("eager", "graphed", "graphed_no_checkpoint"),
    "fsdp2": ("eager", "graphed"),
}
STACKS = tuple(VARIANTS)
MEMORY_KEYS = ("peak_allocated_mib", "steady_peak_allocated_mib", "peak_reserved_mib", "steady_peak_reserved_mib")
STDERR_TAIL = 3000
MIB = 2 ** 20
METHOD = ("one process per run; runs round by round over the stacks, each stack's variants in turn, the order "
          "reversed every round; --steps optimizer steps per run, the first 3 untimed; tokens/s = tokens of the "
          "later steps / their time, CUDA synchronised at every step's end; peak = max_memory_allocated over the "
          "whole run, steady = over the later steps; medians over runs, spread = max/min over runs; losses against "
          "the first eager run")


# ---------------------------------------------------------------------------------------------
# The driver: plan, runs, budget
# ---------------------------------------------------------------------------------------------

def plan(stacks: list, rounds: int) -> list[tuple]:
    """``(round, stack, variant)`` in run order: round by round, every stack in each, its
    variants as listed in even rounds and reversed in odd ones."""
    runs = []
    for r in range(rounds):
        for stack in stacks:
            variants = VARIANTS[stack] if r % 2 == 0 else VARIANTS[stack][::-1]
            runs += [(r, stack, v) for v in variants]
    return runs


def unavailable(stack: str):
    """Why ``stack`` cannot run here (a missing package), or ``None``. Looked up without importing it."""
    found = importlib.util.find_spec
    if stack == "lightning" and not (found("lightning") or found("pytorch_lightning")):
        return "neither lightning nor pytorch_lightning is installed (pip install lightning)"
    if stack == "hf_trainer" and found("accelerate") is None:
        return "transformers' Trainer needs accelerate, which is not installed (pip install accelerate)"
    if stack == "fsdp2":
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_nccl_available():
            return "this torch build has no NCCL process group"
    return None


def worker_command(stack: str, variant: str, args) -> list:
    return [sys.executable, SCRIPT, "--worker", stack, variant, "--steps", str(args.steps)]


def child_env() -> dict:
    """The workers' environment: one GPU (the first this process sees: the Trainer would wrap the
    model in DataParallel over several), NVLink multicast off, no hub look-ups."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", HF_HUB_OFFLINE="1")
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    env["CUDA_VISIBLE_DEVICES"] = visible[0] if visible else "0"
    return env


def run_worker(cmd: list, *, timeout: float, env: dict | None = None) -> dict:
    """Run one worker to its end (or ``timeout``); its JSON record, or an error record with its
    exit code and stderr tail."""
    done = launch.run(cmd, timeout=timeout, env=env, cwd=REPO)
    record = benchlib.last_json_line(done.stdout)
    if not isinstance(record, dict):
        record = {"error": f"timed out after {timeout:g} s" if done.timed_out
                  else f"exit code {done.returncode} without a result line"}
    elif done.timed_out:
        record["error"] = f"timed out after {timeout:g} s"
    if "error" in record or done.returncode != 0:
        record["exit_code"] = done.returncode
        record["stderr_tail"] = done.stderr[-STDERR_TAIL:]
    return record


def run_plan(runs: list, run, *, budget: float, skipped: dict | None = None, clock=time.monotonic,
             log=None) -> tuple[list, dict]:
    """Run ``runs`` (:func:`plan`) with ``run(stack, variant) -> record``; every planned run gets
    an entry, ``not_run`` saying why where it did not start. A run starts only while the time
    spent plus its expected length (the longest earlier run of its stack and variant, else of
    its stack, else 0) stays within ``budget`` seconds. A stack in ``skipped`` (name: reason), or
    whose run reports ``skipped``, runs no more. A ``KeyboardInterrupt`` or ``SystemExit`` in a run
    (a SIGTERM under ``launch.sigterm_raises``) ends the plan: that run and the rest are marked
    ``stopped``. Returns the entries and the skipped stacks."""
    skipped = dict(skipped or {})
    took: dict = {}
    start = clock()
    entries = []
    stopped = None
    for i, (rnd, stack, variant) in enumerate(runs):
        entry = {"round": rnd, "stack": stack, "variant": variant}
        if stopped is not None:
            entries.append(dict(entry, not_run=f"stopped: {stopped}"))
            continue
        if stack in skipped:
            entries.append(dict(entry, not_run=f"stack skipped: {skipped[stack]}"))
            continue
        spent = clock() - start
        expected = max(took.get((stack, variant)) or took.get(stack) or [0.0])
        if spent + expected > budget:
            entries.append(dict(entry, not_run=f"time budget: {spent:.0f} of {budget:.0f} s spent, "
                                               f"the run takes about {expected:.0f} s"))
            continue
        t0 = clock()
        try:
            record = run(stack, variant)
        except (KeyboardInterrupt, SystemExit) as exc:  # a SIGTERM (launch.sigterm_raises): keep what ran
            stopped = f"{type(exc).__name__} {exc}".strip()
            record = {"error": f"stopped: {stopped}"}
        wall = clock() - t0
        took.setdefault((stack, variant), []).append(wall)
        took.setdefault(stack, []).append(wall)
        if record.get("skipped"):
            skipped[stack] = record["skipped"]
        entries.append({**entry, **record, "wall_s": round(wall, 1)})
        if log is not None:
            log(f"[{i + 1}/{len(runs)}] round {rnd} {stack} {variant}: {outcome(entries[-1])} ({wall:.0f} s)")
    return entries, skipped


def outcome(entry: dict) -> str:
    if entry.get("skipped"):
        return f"skipped ({entry['skipped']})"
    if "error" in entry:
        return "failed: " + first_line(entry["error"])
    return f"{entry.get('tokens_per_s', 0):.0f} tokens/s"


def first_line(text, limit: int = 200):
    """The first line of ``text``, at most ``limit`` characters (``None`` stays ``None``)."""
    if text is None:
        return None
    lines = str(text).strip().splitlines()
    return lines[0][:limit] if lines else ""


# ---------------------------------------------------------------------------------------------
# Figures from the runs
# ---------------------------------------------------------------------------------------------

def ok(run: dict) -> bool:
    return "error" not in run and not run.get("skipped") and "not_run" not in run \
        and run.get("tokens_per_s") is not None


def ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None


def spread_stats(values: list):
    """Median, min, max and spread (max / min) of ``values``; ``None`` when there are none."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "spread": ratio(max(values), min(values)), "n": len(values)}


def median_of(runs: list, key: str):
    values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def variant_stats(runs: list) -> dict:
    """One variant's figures over its runs (those that did not start left out)."""
    ran = [r for r in runs if "not_run" not in r and not r.get("skipped")]
    good = [r for r in ran if ok(r)]
    errors = []
    for r in ran:
        if not ok(r) and r.get("error", "no tokens/s") not in errors:
            errors.append(r.get("error", "no tokens/s"))
    replays = [r["replays"] for r in good if isinstance(r.get("replays"), int)]
    return {"runs": len(ran), "ok": len(good),
            "tokens_per_s": spread_stats([r["tokens_per_s"] for r in good]),
            **{key: median_of(good, key) for key in (*MEMORY_KEYS, "steady_base_allocated_mib")},
            "replays_min": min(replays) if replays else None,
            "errors": errors}


def loss_agreement(reference: list, runs: list) -> dict:
    """Per-step losses of ``runs`` against the first of the ``reference`` runs (lists of floats),
    and the reference runs among themselves (their spread: bf16 eager runs may differ).

    ``bitwise_equal``: every run has the reference's number of steps and the same floats;
    ``max_abs_diff`` / ``max_rel_diff``: the largest difference over the steps both have;
    ``within_eager_spread``: ``max_abs_diff`` is at most the reference runs' own; ``None`` where
    there is nothing to compare."""
    reference = [r for r in reference if r]
    runs = [r for r in runs if r]
    first = reference[0] if reference else None

    def compare(group):
        if first is None or not group:
            return None, None, None
        equal = all(r == first for r in group)
        abs_diff = max(max((abs(x - y) for x, y in zip(r, first)), default=0.0) for r in group)
        rel_diff = max(benchlib.max_rel_loss_diff(r, first) or 0.0 for r in group)
        return equal, abs_diff, rel_diff

    equal, abs_diff, rel_diff = compare(runs)
    e_equal, e_abs, e_rel = compare(reference[1:])
    return {"runs": len(runs), "eager_runs": len(reference), "steps": len(first) if first else 0,
            "same_steps": all(len(r) == len(first) for r in runs) if first and runs else None,
            "bitwise_equal": equal, "max_abs_diff": abs_diff, "max_rel_diff": rel_diff,
            "eager_bitwise_equal": e_equal, "eager_max_abs_diff": e_abs, "eager_max_rel_diff": e_rel,
            "within_eager_spread": abs_diff <= e_abs if abs_diff is not None and e_abs is not None else None}


def stack_result(stack: str, runs: list, *, skipped: str | None = None) -> dict:
    """One stack's figures: per variant its statistics, and the others against ``eager``."""
    out = {"dropout": DROPOUT.get(stack, 0.0), "skipped": skipped}
    variants = {v: variant_stats([r for r in runs if r["variant"] == v]) for v in VARIANTS[stack]}
    eager = variants["eager"]
    eager_losses = [r.get("losses") for r in runs if r["variant"] == "eager" and ok(r)]
    others = [v for v in VARIANTS[stack] if v != "eager"]
    speed = {v: ratio((variants[v]["tokens_per_s"] or {}).get("median"), (eager["tokens_per_s"] or {}).get("median"))
             for v in others}
    losses = {v: loss_agreement(eager_losses, [r.get("losses") for r in runs if r["variant"] == v and ok(r)])
              for v in others}
    memory = {"vs_eager": {v: {k: ratio(variants[v][k], eager[k]) for k in MEMORY_KEYS} for v in others}}
    if stack == "checkpoint":
        memory["graphed_over_graphed_no_checkpoint"] = {
            k: ratio(variants["graphed"][k], variants["graphed_no_checkpoint"][k]) for k in MEMORY_KEYS}
    return {**out, "variants": variants, "speed_vs_eager": speed, "losses_vs_eager": losses, "memory": memory,
            "runs": runs}


def summarize(stacks: dict) -> dict:
    """The headline figures, one key each; ``None`` where a run failed or did not run.

    Per stack: ``<stack>_skipped``, ``<stack>_eager_tokens_per_s``, ``<stack>_eager_losses_equal``
    and ``<stack>_eager_loss_spread`` (among the eager runs, absolute); per variant other than
    eager, prefixed ``<stack>`` for ``graphed`` and ``<stack>_<variant>`` for the others:
    ``_speed`` (tokens/s over eager's), ``_losses_equal``, ``_loss_max_rel_diff``, ``_peak_ratio``
    and ``_steady_peak_ratio`` (allocated), ``_peak_reserved_ratio``, ``_error`` (the first line of
    its first error where no run of it succeeded). ``checkpoint_peak_vs_graphed_no_checkpoint``
    (and its steady twin): graphed checkpointed over graphed without checkpointing."""
    out = {}
    for stack, res in stacks.items():
        variants = res.get("variants", {})
        eager = variants.get("eager", {})
        eager_losses = next(iter(res.get("losses_vs_eager", {}).values()), {})
        out[f"{stack}_skipped"] = res.get("skipped")
        out[f"{stack}_eager_tokens_per_s"] = (eager.get("tokens_per_s") or {}).get("median")
        out[f"{stack}_eager_losses_equal"] = eager_losses.get("eager_bitwise_equal")
        out[f"{stack}_eager_loss_spread"] = eager_losses.get("eager_max_abs_diff")
        for v in VARIANTS[stack][1:]:
            prefix = stack if v == "graphed" else f"{stack}_{v}"
            stats = variants.get(v, {})
            agree = res.get("losses_vs_eager", {}).get(v, {})
            mem = res.get("memory", {}).get("vs_eager", {}).get(v, {})
            out[f"{prefix}_speed"] = res.get("speed_vs_eager", {}).get(v)
            out[f"{prefix}_losses_equal"] = agree.get("bitwise_equal")
            out[f"{prefix}_loss_max_rel_diff"] = agree.get("max_rel_diff")
            out[f"{prefix}_peak_ratio"] = mem.get("peak_allocated_mib")
            out[f"{prefix}_steady_peak_ratio"] = mem.get("steady_peak_allocated_mib")
            out[f"{prefix}_peak_reserved_ratio"] = mem.get("peak_reserved_mib")
            errors = stats.get("errors") or []
            out[f"{prefix}_error"] = first_line(errors[0], 300) if errors and not stats.get("ok") else None
        if stack == "checkpoint":
            own = res.get("memory", {}).get("graphed_over_graphed_no_checkpoint", {})
            out["checkpoint_peak_vs_graphed_no_checkpoint"] = own.get("peak_allocated_mib")
            out["checkpoint_steady_peak_vs_graphed_no_checkpoint"] = own.get("steady_peak_allocated_mib")
    return out


def fmt(x, spec: str) -> str:
    """``x`` formatted by ``spec`` (``"9.0f"``), or ``-`` as wide where it is not a number."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return format(x, spec)
    width = spec.split(".")[0]
    return "-".rjust(int(width) if width.isdigit() else 0)


def print_table(payload: dict) -> None:
    s = payload["settings"]
    print(f"\nLlama (small) in training stacks, {s['micro_batches']} micro-batches x {s['micro_batch']} x {s['seq']}, "
          f"{s['steps']} steps ({s['warm_steps']} untimed), {payload['device']}")
    print(f"{'stack':11} {'variant':22} {'ok':>5} {'tokens/s':>9} {'spread':>7} {'vs eager':>8} {'peak MiB':>9} "
          f"{'steady':>8} {'reserved':>9} {'equal':>6} {'max rel':>8}  error")
    for stack, res in payload["stacks"].items():
        if res.get("skipped") and not any(v["runs"] for v in res["variants"].values()):
            print(f"{stack:11} skipped: {res['skipped']}")
            continue
        for v, stats in res["variants"].items():
            tps = stats["tokens_per_s"] or {}
            agree = res["losses_vs_eager"].get(v, {})
            equal = agree.get("bitwise_equal")
            if v == "eager":
                agree = next(iter(res["losses_vs_eager"].values()), {})
                equal, rel = agree.get("eager_bitwise_equal"), agree.get("eager_max_rel_diff")
            else:
                rel = agree.get("max_rel_diff")
            err = first_line(stats["errors"][0], 60) if stats["errors"] else ""
            print(f"{stack:11} {v:22} {stats['ok']:>2}/{stats['runs']:<2} {fmt(tps.get('median'), '9.0f')} "
                  f"{fmt(tps.get('spread'), '7.3f')} {fmt(res['speed_vs_eager'].get(v), '8.3f')} "
                  f"{fmt(stats['peak_allocated_mib'], '9.0f')} {fmt(stats['steady_peak_allocated_mib'], '8.0f')} "
                  f"{fmt(stats['peak_reserved_mib'], '9.0f')} {'-' if equal is None else str(equal):>6} "
                  f"{fmt(rel, '8.1e')}  {err}")
    print("(eager rows: equal / max rel among the eager runs)")
    print("summary:", json.dumps(payload["summary"], indent=2))


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stacks", default=",".join(STACKS), help="comma-separated, of: " + ", ".join(STACKS))
    p.add_argument("--rounds", type=int, default=3, help="runs of each variant (alternating order)")
    p.add_argument("--steps", type=int, default=12, help=f"optimizer steps per run, the first {WARM_STEPS} untimed")
    p.add_argument("--budget", type=float, default=340.0,
                   help="seconds: no run starts that would end past this (the runs so far are recorded)")
    p.add_argument("--worker-timeout", type=float, default=120.0, help="seconds for one run")
    p.add_argument("--name", default="stacks", help="record name: benchmarks/results/<name>-<device>.json")
    p.add_argument("--dry-run", action="store_true", help="print the worker commands in run order, run nothing")
    p.add_argument("--worker", nargs=2, metavar=("STACK", "VARIANT"), default=None,
                   help="run one variant of one stack in this process and print its JSON line (the driver's use)")
    args = p.parse_args(argv)
    args.stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    bad = [s for s in args.stacks if s not in VARIANTS]
    if bad or not args.stacks:
        p.error(f"--stacks takes {', '.join(STACKS)}; got {bad or 'none'}")
    if len(set(args.stacks)) < len(args.stacks):
        p.error("--stacks names a stack twice")
    if args.worker is not None:
        stack, variant = args.worker
        if stack not in VARIANTS or variant not in VARIANTS[stack]:
            p.error(f"--worker {stack} {variant}: the variants are "
                    + "; ".join(f"{s}: {', '.join(v)}" for s, v in VARIANTS.items()))
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.steps < WARM_STEPS + 2:
        p.error(f"--steps must be >= {WARM_STEPS + 2} (the first {WARM_STEPS} are not timed)")
    if not args.budget > 0 or not args.worker_timeout > 0:
        p.error("--budget and --worker-timeout must be > 0 seconds")
    return args


def settings(args) -> dict:
    return {"stacks": args.stacks, "rounds": args.rounds, "steps": args.steps, "warm_steps": WARM_STEPS,
            "budget": args.budget, "worker_timeout": args.worker_timeout, "name": args.name,
            "shape": dataclasses.asdict(SHAPE), "micro_batch": SHAPE.micro_batch,
            "seq": SHAPE.seq, "micro_batches": MICRO_BATCHES, "tokens_per_step": TOKENS_PER_STEP, "lr": LR,
            "attention_dropout": {s: DROPOUT.get(s, 0.0) for s in args.stacks}}


def versions() -> dict:
    found = {}
    for dist in ("transformers", "accelerate", "lightning", "pytorch_lightning"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    return found


def dry_run(args) -> int:
    for rnd, stack, variant in plan(args.stacks, args.rounds):
        print(f"# round {rnd}: {stack} {variant}")
        print(shlex.join(worker_command(stack, variant, args)))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    if args.dry_run:
        return dry_run(args)
    import torch

    if not torch.cuda.is_available():
        print("bench_stacks.py needs a CUDA device", file=sys.stderr)
        return 2
    with launch.sigterm_raises():  # a run in progress is stopped on the way out
        return measure(args)


def measure(args) -> int:
    start = time.monotonic()
    skipped = {s: why for s in args.stacks if (why := unavailable(s))}
    env = child_env()

    def run(stack, variant):
        return run_worker(worker_command(stack, variant, args), timeout=args.worker_timeout, env=env)

    entries, skipped = run_plan(plan(args.stacks, args.rounds), run, budget=args.budget, skipped=skipped,
                                log=lambda line: print(line, file=sys.stderr, flush=True))
    stacks = {s: stack_result(s, [e for e in entries if e["stack"] == s], skipped=skipped.get(s))
              for s in args.stacks}
    env_info = benchlib.environment()
    payload = {"device": env_info["device"], "date": env_info["date"],
               "versions": {**{k: v for k, v in env_info.items() if k not in ("date", "settings")}, **versions()},
               "settings": {**settings(args), "environment": env_info["settings"]},
               "method": METHOD, "wall_s": round(time.monotonic() - start, 1),
               "not_run": sum("not_run" in e for e in entries), "stacks": stacks}
    payload["summary"] = summarize(stacks)
    path = benchlib.write_result(args.name, payload)
    print_table(payload)
    print(f"wrote {path}")
    return 1 if any(str(e.get("not_run", "")).startswith("stopped") for e in entries) else 0


# ---------------------------------------------------------------------------------------------
# The worker: one stack, one variant, one process
# ---------------------------------------------------------------------------------------------

class Unavailable(Exception):
    """The stack needs a package this machine lacks: the run is skipped, not failed."""


def timing(stamps: list, *, warm: int, tokens_per_step: int) -> dict:
    """Tokens/s of the steps after the first ``warm`` from ``stamps`` (the start, then the end of
    every step, in seconds), and every step's milliseconds."""
    steps = max(len(stamps) - 1, 0)
    step_ms = [round((b - a) * 1e3, 3) for a, b in zip(stamps, stamps[1:])]
    if steps <= warm:
        return {"error": f"{steps} steps ran; the first {warm} are not timed", "step_ms": step_ms}
    timed = stamps[-1] - stamps[warm]
    return {"tokens_per_s": tokens_per_step * (steps - warm) / timed, "timed_steps": steps - warm,
            "timed_s": timed, "step_ms": step_ms}


class Clock:
    """A run's step clock and memory: the stack calls :meth:`start` before its first step and
    :meth:`step_end` after every optimizer step; after the warm steps the peak statistics reset."""

    def __init__(self, warm: int):
        import torch

        self.torch, self.warm = torch, warm
        self.memory = benchlib.DeviceMemory()
        self.stamps: list = []
        self.losses: list = []
        self.warm_peaks = None  # (allocated, reserved) before the reset
        self.steady_base = None

    def start(self) -> None:
        self.torch.cuda.synchronize()
        self.stamps = [time.perf_counter()]

    def step_end(self, loss=None) -> None:
        self.torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        if loss is not None:
            self.losses.append(float(loss))
        if len(self.stamps) - 1 == self.warm:
            cuda = self.torch.cuda
            self.warm_peaks = (cuda.max_memory_allocated() / MIB, self.memory.peak_mib())
            self.memory.reset_peak()  # torch.cuda.reset_peak_memory_stats, and the driver's graph memory
            self.steady_base = cuda.memory_allocated() / MIB

    def record(self) -> dict:
        out = timing(self.stamps, warm=self.warm, tokens_per_step=TOKENS_PER_STEP)
        now = (self.torch.cuda.max_memory_allocated() / MIB, self.memory.peak_mib())
        steady = now if self.warm_peaks is not None else (None, None)
        peak = (max(now[0], self.warm_peaks[0]), max(now[1], self.warm_peaks[1])) if self.warm_peaks else now
        return {**out, "steps_done": max(len(self.stamps) - 1, 0), "losses": self.losses,
                "peak_allocated_mib": round(peak[0], 1), "steady_peak_allocated_mib": rnd(steady[0]),
                "peak_reserved_mib": round(peak[1], 1), "steady_peak_reserved_mib": rnd(steady[1]),
                "steady_base_allocated_mib": rnd(self.steady_base)}


def rnd(x):
    return None if x is None else round(x, 1)


def build(stack: str):
    """The model, seeded (the same weights in every run), fp32 on the GPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPE
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                         num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                         max_position_embeddings=s.seq, attention_dropout=DROPOUT.get(stack, 0.0), use_cache=False)
    return LlamaForCausalLM(config).to(DEVICE)


def graph_if(model, variant: str) -> None:
    """The one line a user adds."""
    if variant.startswith("graphed"):
        from paddle_graphpp.torch import graph_layers

        graph_layers(model.model.layers)


def token_ids(steps: int):
    """Every micro-batch's token ids of ``steps`` steps, on the CPU: ``(steps * 4 * 2, 256)``."""
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(0, SHAPE.vocab, (steps * MICRO_BATCHES * SHAPE.micro_batch, SHAPE.seq), generator=g)


def train_loop(model, clock: Clock, steps: int) -> None:
    """The plain loop: autocast bf16, accumulation, clipping, fused AdamW, cosine schedule."""
    import torch

    ids = token_ids(steps).to(DEVICE).split(SHAPE.micro_batch)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    model.train()
    torch.manual_seed(3)
    clock.start()
    for step in range(steps):
        losses = []
        for tokens in ids[step * MICRO_BATCHES:(step + 1) * MICRO_BATCHES]:
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=tokens).loss  # the model shifts the labels
            (loss / MICRO_BATCHES).backward()
            losses.append(loss.detach().float())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        clock.step_end(torch.stack(losses).mean())


def run_plain(variant: str, clock: Clock, steps: int):
    model = build("plain")
    graph_if(model, variant)
    train_loop(model, clock, steps)
    return model, {}


def run_checkpoint(variant: str, clock: Clock, steps: int):
    model = build("checkpoint")
    if variant != "graphed_no_checkpoint":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    graph_if(model, variant)
    train_loop(model, clock, steps)
    return model, {"gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False))}


def run_fsdp2(variant: str, clock: Clock, steps: int):
    import torch
    import torch.distributed as dist

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError as exc:
            raise Unavailable(f"this torch has no fully_shard (FSDP2): {exc}") from exc
    if not dist.is_available() or not dist.is_nccl_available():
        raise Unavailable("this torch build has no NCCL process group")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(launch.free_port())
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    model = build("fsdp2")
    graph_if(model, variant)  # before fully_shard, as the blocks are graphed where they sit
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    train_loop(model, clock, steps)
    return model, {"world_size": dist.get_world_size()}  # no destroy_process_group: see worker_main


def run_hf_trainer(variant: str, clock: Clock, steps: int):
    import torch

    if importlib.util.find_spec("accelerate") is None:
        raise Unavailable("transformers' Trainer needs accelerate, which is not installed (pip install accelerate)")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    ids = token_ids(steps)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    class Timing(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.start()

        def on_step_end(self, args, state, control, **kwargs):  # after the optimizer step
            clock.step_end()

    model = build("hf_trainer")
    graph_if(model, variant)
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, per_device_train_batch_size=SHAPE.micro_batch,
                                  gradient_accumulation_steps=MICRO_BATCHES, max_steps=steps, bf16=True,
                                  max_grad_norm=1.0, learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=1,
                                  logging_steps=1, report_to=[], save_strategy="no", seed=3,
                                  dataloader_num_workers=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=[Timing()])
        result = trainer.train()
    clock.losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return model, {"optim": str(getattr(targs.optim, "value", targs.optim)),
                   "trainer_samples_per_s_all_steps": result.metrics.get("train_samples_per_second")}


def lightning_package():
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl
        except ImportError as exc:
            raise Unavailable("neither lightning nor pytorch_lightning is installed (pip install lightning)") from exc
    return pl


def run_lightning(variant: str, clock: Clock, steps: int):
    import torch

    pl = lightning_package()

    class Module(pl.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model, self.window = model, []
            graph_if(self.model, variant)  # the recipe: in the module's __init__

        def training_step(self, tokens, batch_idx):
            loss = self.model(input_ids=tokens, labels=tokens).loss
            self.window.append(loss.detach().float())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=LR)

    class Timing(pl.Callback):
        def on_train_start(self, trainer, module):
            clock.start()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if (batch_idx + 1) % MICRO_BATCHES == 0:  # the window's last: its optimizer step has run
                clock.step_end(torch.stack(module.window).mean())
                module.window.clear()

    module = Module(build("lightning"))
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed",
                             accumulate_grad_batches=MICRO_BATCHES, gradient_clip_val=1.0, max_steps=steps,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
                             callbacks=[Timing()])
        torch.manual_seed(3)
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(token_ids(steps),
                                                                          batch_size=SHAPE.micro_batch))
    return module.model, {"lightning": pl.__version__}


STACK_RUNS = {"plain": run_plain, "hf_trainer": run_hf_trainer, "lightning": run_lightning,
              "checkpoint": run_checkpoint, "fsdp2": run_fsdp2}


def engine_counts(model) -> dict:
    """The first block's graph replays and graphs (``{}`` for an eager block)."""
    try:
        engine = model.model.layers[0].engine
        return {"replays": engine.replays, "graphs": engine.graph_count()}
    except AttributeError:
        return {}


def worker_main(args) -> int:
    """Run one stack's variant; print its record as the one JSON line on stdout (everything else the
    libraries print goes to stderr), then leave with ``os._exit``: destroying an NCCL group after
    captured work can hang, and nothing after the record matters."""
    reply = reply_channel()
    stack, variant = args.worker
    labels = {"stack": stack, "variant": variant}
    clock, code = None, 0
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("bench_stacks.py --worker needs a CUDA device")
        clock = Clock(WARM_STEPS)
        model, extra = STACK_RUNS[stack](variant, clock, args.steps)
        record = {**labels, **clock.record(), **engine_counts(model), "extra": extra}
    except Unavailable as exc:
        record = {**labels, "skipped": str(exc)}
    except BaseException as exc:  # noqa: BLE001 - the failure is the run's result
        traceback.print_exc()  # the driver keeps the tail of stderr
        partial = {}
        if clock is not None:
            try:  # what ran before the failure: its steps, losses, memory
                partial = {k: v for k, v in clock.record().items() if k not in ("error", "tokens_per_s")}
            except Exception:  # noqa: BLE001 - a broken CUDA context: the error alone
                pass
        record = {**labels, **partial, "error": error_text(exc), "error_type": type(exc).__name__}
        code = 1
    reply(record)
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
