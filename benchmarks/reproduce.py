#!/usr/bin/env python
"""Run the benchmarks behind the published records (benchmarks/README.md) on this GPU machine.

    python benchmarks/reproduce.py              # the single-GPU records
    python benchmarks/reproduce.py --gpus 2     # and the 2-GPU ones
    python benchmarks/reproduce.py --gpus 4     # and the 4-GPU ones
    python benchmarks/reproduce.py --list       # print the commands, run nothing
    python benchmarks/reproduce.py --only hf    # one step by name
    python benchmarks/reproduce.py --only gpu-suite,engine --budget 570   # these, in ~10 minutes

Each step is one tool command from the repository root, run in its own process with
``NCCL_NVLS_ENABLE=0`` (NVLink multicast off). Its output goes to ``<log-dir>/<step>.log``; a
failed step is reported and the others go on. Each tool writes its record to
``benchmarks/results/<name>-<device>.json``. With ``--budget`` the steps share that many seconds:
each runs under what is left (stopped at its end), the ones after it are skipped, and the
summary still prints (a machine that allows 10 minutes a command: ``--budget 570``). A summary
table ends the run; the exit status is 1 if a step failed or was skipped. The GPU test suite step runs the 2-GPU tests too where two GPUs are present.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from tools import launch  # noqa: E402

STOP_GRACE_S = 30.0  # a multi-rank tool stops its ranks one by one, a few seconds each

# (name, GPUs, command, the record it writes: <device> is this machine's)
STEPS = [
    ("engine", 1, "python tools/gpu_check.py", "engine-<device>.json"),
    ("optimizer", 1, "python tools/bench_optimizer.py --rounds 12 "
     "--profile eager_fused,graphed_foreach,graphed_fused,graphed_foreach_compiled", "optimizer-<device>.json"),
    ("hf", 1, "python tools/bench_hf.py", "hf-<device>.json"),
    ("memory", 1, "python tools/bench_memory.py", "memory-<device>.json"),
    ("compile", 1, "python tools/bench_compile.py", "compile-<device>.json"),
    ("zero-bubble-split", 1, "python tools/bench_zero_bubble.py --single-gpu", "zero-bubble-split-<device>.json"),
    ("peer-megatron-pp1", 1, "python tools/bench_peer_megatron.py --pp 1 --profile", "peer-megatron-pp1-<device>.json"),
    ("gpu-suite", 1, "python tools/gpu_suite.py", "gpu-suite-<device>.json"),
    ("pipeline", 2, "python tools/bench_pipeline.py", "pipeline-<device>.json"),
    ("memory-pipeline-pp2", 2, "python tools/bench_pipeline_memory.py --preset gpt1.3b",
     "memory-pipeline-gpt1.3b-pp2-<device>.json"),
    ("zero-bubble", 2, "python tools/bench_zero_bubble.py --trainer-args=--no-return-outputs",
     "zero-bubble-<device>.json"),
    ("allreduce", 2, "python tools/bench_allreduce.py", "allreduce-<device>.json"),
    ("hybrid-tp2", 2, "python tools/bench_hybrid.py --pp 1", "hybrid-tp2pp1-<device>.json"),
    ("peer-megatron-pp2", 2, "python tools/bench_peer_megatron.py --pp 2", "peer-megatron-pp2-<device>.json"),
    ("hf-pipeline-pp2", 2, "python tools/bench_hf_pipeline.py", "hf-pipeline-pp2-<device>.json"),
    ("compile-pipeline-pp2", 2, "python tools/bench_compile_pipeline.py", "compile-pipeline-pp2-<device>.json"),
    ("gpu-suite-2gpu", 2, "python tools/gpu_suite.py --name gpu-suite-2gpu", "gpu-suite-2gpu-<device>.json"),
    ("memory-pipeline-pp4", 4, "python tools/bench_pipeline_memory.py --preset gpt1.3b-pp4 --variants eager,default",
     "memory-pipeline-gpt1.3b-pp4-<device>.json"),
    ("allreduce-4r", 4, "python tools/bench_allreduce.py --ranks 4", "allreduce-4r-<device>.json"),
    ("hybrid-tp2pp2", 4, "python tools/bench_hybrid.py", "hybrid-tp2pp2-<device>.json"),
    ("peer-megatron-pp4", 4, "python tools/bench_peer_megatron.py --pp 4", "peer-megatron-pp4-<device>.json"),
    ("peer-megatron-tp2pp2", 4, "python tools/bench_peer_megatron.py --tp 2 --pp 2",
     "peer-megatron-tp2pp2-<device>.json"),
]


def selected(gpus: int, only: str | None) -> list:
    """The steps to run: those named in ``only`` (comma-separated, in that order), else every
    step that needs at most ``gpus`` GPUs."""
    if only is not None:
        by_name = {s[0]: s for s in STEPS}
        names = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in names if n not in by_name]
        if unknown or not names:
            raise SystemExit(f"reproduce.py: no step {', '.join(map(repr, unknown)) or repr(only)}; "
                             f"steps: {', '.join(by_name)}")
        return [by_name[n] for n in names]
    return [s for s in STEPS if s[1] <= gpus]


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_step(name: str, command: str, log_dir: Path, timeout: float) -> tuple:
    """``(exit code or a word, seconds, log path)``; the step's output goes to its log only."""
    words = shlex.split(command)
    argv = [sys.executable if words[0] == "python" else words[0], *words[1:]]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    log = log_dir / f"{name}.log"
    start = time.monotonic()
    with open(log, "w") as out:
        out.write(f"$ {command}\n")
        out.flush()
        try:
            proc = launch.start(argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        except OSError as exc:
            out.write(f"could not start: {exc}\n")
            return "not started", time.monotonic() - start, log
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = "timeout"
        finally:  # the step's own clean-up gets SIGTERM and time to stop its ranks
            launch.stop(proc, grace=STOP_GRACE_S)
    return code, time.monotonic() - start, log


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, choices=[1, 2, 4], default=1, help="run the steps that need at most this many GPUs")
    p.add_argument("--only", metavar="NAME[,NAME...]", help="run these steps, in this order (any GPU count)")
    p.add_argument("--list", action="store_true", help="print the steps' commands and exit")
    p.add_argument("--log-dir", type=Path, default=REPO / "benchmarks" / "logs")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per step")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all the steps together (those that do not fit are skipped)")
    args = p.parse_args(argv)
    if args.budget is not None and not args.budget > 0:
        p.error(f"--budget must be > 0 seconds, got {args.budget:g}")
    steps = selected(args.gpus, args.only)
    if args.list:
        for name, gpus, command, record in steps:
            print(f"{name:<20} {gpus} GPU  {command}  -> benchmarks/results/{record}")
        return 0
    have, need = gpu_count(), max(s[1] for s in steps)
    if have < need:
        print(f"reproduce.py: these steps need {need} GPU(s), this machine has {have}", file=sys.stderr)
        return 2
    args.log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    end = None if args.budget is None else time.monotonic() + args.budget
    for i, (name, _, command, record) in enumerate(steps, 1):
        left = args.timeout if end is None else min(args.timeout, end - time.monotonic() - STOP_GRACE_S)
        if left <= 0:
            print(f"[{i}/{len(steps)}] {name}: skipped (the budget is spent)", flush=True)
            rows.append((name, "skipped", 0.0, record))
            continue
        print(f"[{i}/{len(steps)}] {name}: {command}", flush=True)
        with launch.sigterm_raises():  # a SIGTERM here still stops the running step
            code, seconds, log = run_step(name, command, args.log_dir, left)
        print(f"    {'ok' if code == 0 else f'FAILED ({code})'} in {seconds:.0f} s, log {log}", flush=True)
        rows.append((name, "ok" if code == 0 else f"failed ({code})", seconds, record))
    print(f"\n{'step':<20} {'result':<16} {'seconds':>8}  record")
    for name, result, seconds, record in rows:
        print(f"{name:<20} {result:<16} {seconds:>8.0f}  benchmarks/results/{record}")
    return 0 if all(r[1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
