#!/usr/bin/env python
"""Run the benchmarks behind the published records (benchmarks/README.md) on this GPU machine.

    python benchmarks/reproduce.py              # the single-GPU records
    python benchmarks/reproduce.py --gpus 2     # and the 2-GPU ones
    python benchmarks/reproduce.py --gpus 4     # and the 4-GPU ones
    python benchmarks/reproduce.py --list       # print the commands, run nothing
    python benchmarks/reproduce.py --only hf    # one step by name
    python benchmarks/reproduce.py --only gpu-suite,engine --budget 570   # these, in ~10 minutes
    python benchmarks/reproduce.py --lanes 0:gpu-suite 1:engine,hf 2,3:allreduce --budget 570
                                                # side by side, each lane on its own GPUs
    python benchmarks/reproduce.py --baseline ../old --lanes 0:engine,engine@baseline,hf,hf@baseline
                                                # a step and the same step of an older checkout

Each step is one tool command from the repository root (settings written before it,
``NAME=VALUE`` as in a shell, go into its environment), run in its own process with
``NCCL_NVLS_ENABLE=0`` (NVLink multicast off). Its output goes to ``<log-dir>/<step>.log``, and
every 30 s a line says how long it has run and what it last logged; a failed step is reported and
the others go on. Each tool writes its record to
``benchmarks/results/<name>-<device>.json``. With ``--budget`` the steps share that many seconds:
each runs under what is left (stopped at its end), the ones after it are skipped, and the
summary still prints (a machine that allows 10 minutes a command: ``--budget 570``). With
``--lanes`` several lists of steps run at the same time, each on the GPUs it names
(``CUDA_VISIBLE_DEVICES``), each under the whole budget: for correctness runs and for ratios
measured side by side inside one step, not for absolute figures compared across steps. A summary
table ends the run; the exit status is 1 if a step failed or was skipped. Without lanes a step
sees as many GPUs as it needs, the first ones. So the gpu-suite step runs the whole GPU suite in
one process on one GPU (the 2-GPU tests skip), gpu-suite-2gpu the same suite on two (about 570 s
on 2 x H200).

A step named ``NAME@baseline`` runs step ``NAME``'s command from the checkout given by
``--baseline DIR`` (an older code version, e.g. ``git archive <rev> | tar -x -C DIR``), with
that checkout first on ``PYTHONPATH`` and ``GRAPHPP_CODE_VERSION`` from ``DIR/CODE_VERSION`` if
the file exists: the baseline of a "no figure got worse" check, run on the same machine. Its record
lands in ``DIR/benchmarks/results``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from testing import launch  # noqa: E402

ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")  # a step's setting before its command
STOP_GRACE_S = 30.0  # a multi-rank tool stops its ranks one by one, a few seconds each
PROGRESS_S = 30.0  # a running step reports its time (and its log's last line) this often
STARTED = time.monotonic()

# (name, GPUs, command, the record it writes: <device> is this machine's)
STEPS = [
    ("engine", 1, "python tools/gpu_check.py", "engine-<device>.json"),
    ("call-overhead", 1, "python tools/bench_call_overhead.py --rounds 9 --iters 10", "call-overhead-<device>.json"),
    ("optimizer", 1, "python tools/bench_optimizer.py --rounds 12 "
     "--profile eager_fused,graphed_foreach,graphed_fused,graphed_foreach_compiled", "optimizer-<device>.json"),
    ("hf", 1, "python tools/bench_hf.py", "hf-<device>.json"),
    ("memory", 1, "python tools/bench_memory.py", "memory-<device>.json"),
    ("compile", 1, "python tools/bench_compile.py --shapes tiny,small,1b --variants compile,reduce_overhead,"
     "ours_compiled,ours_whole,ours_whole_compiled,ours_whole_step --groups one --profile-steps 0",
     "compile-<device>.json"),
    ("stacks", 1, "python tools/bench_stacks.py", "stacks-<device>.json"),
    ("moe", 1, "python tools/bench_moe.py --rounds 5 --iters 3 --memory-trace --variants eager_loop around "
     "eager_grouped whole_grouped model_grouped eager_capacity whole_capacity",
     "moe-<device>.json"),
    ("moe-capacity", 1, "python tools/bench_moe.py --skip exact --rounds 5 --iters 3 --memory-trace --variants "
     "eager_capacity whole_capacity model_capacity --name moe-capacity", "moe-capacity-<device>.json"),
    ("moe-around", 1, "python tools/bench_moe.py --name moe-around --skip exact memory --variants eager_loop around "
     "--rounds 15 --iters 3", "moe-around-<device>.json"),
    ("zero-bubble-split", 1, "python tools/bench_zero_bubble.py --single-gpu", "zero-bubble-split-<device>.json"),
    ("peer-megatron-pp1", 1, "python tools/bench_peer_megatron.py --pp 1 --profile", "peer-megatron-pp1-<device>.json"),
    ("peer-megatron-moe", 1, "python tools/bench_peer_megatron.py --moe --budget 400", "peer-megatron-moe-<device>.json"),
    ("peer-megatron-moe-ddp", 1, "python tools/bench_peer_megatron.py --moe --ddp --variants eager,ours --repeats 1 "
     "--budget 110", "peer-megatron-moe-ddp-<device>.json"),
    ("peer-megatron-moe-fused-adam", 1, "python tools/bench_peer_megatron.py --moe --optimizer fused "
     "--variants eager,megatron,ours --repeats 1 --budget 280", "peer-megatron-moe-fused-adam-<device>.json"),
    ("gpu-suite", 1, "python tools/gpu_suite.py", "gpu-suite-<device>.json"),
    ("gpu-suite-probe", 1, "python tools/gpu_suite.py --probe --name gpu-suite-probe",
     "gpu-suite-probe-<device>.json"),
    ("pool-kept", 1, "python tools/diagnostics/pool_kept.py", "pool-kept-<device>.json"),
    ("memory-trace-peer-megatron-moe", 1, "python tools/bench_peer_megatron.py --moe --memory-trace "
     "--variants eager,ours --budget 420", "memory-trace-peer-megatron-moe-<device>.json"),
    ("memory-trace-peer-megatron-pp1", 1, "python tools/bench_peer_megatron.py --pp 1 --seqs 2048 "
     "--variants eager,ours --rounds 2 --memory-trace", "memory-trace-peer-megatron-pp1-<device>.json"),
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
    ("memory-trace-peer-megatron-pp2", 2, "python tools/bench_peer_megatron.py --pp 2 --seqs 2048 "
     "--variants eager,ours,ours_segments --rounds 2 --memory-trace", "memory-trace-peer-megatron-pp2-<device>.json"),
    ("memory-pipeline-pp4", 4, "python tools/bench_pipeline_memory.py --preset gpt1.3b-pp4 --variants eager,default",
     "memory-pipeline-gpt1.3b-pp4-<device>.json"),
    ("allreduce-4r", 4, "python tools/bench_allreduce.py --ranks 4", "allreduce-4r-<device>.json"),
    ("hybrid-tp2pp2", 4, "python tools/bench_hybrid.py", "hybrid-tp2pp2-<device>.json"),
    ("peer-megatron-pp4", 4, "python tools/bench_peer_megatron.py --pp 4", "peer-megatron-pp4-<device>.json"),
    ("peer-megatron-tp2pp2", 4, "python tools/bench_peer_megatron.py --tp 2 --pp 2",
     "peer-megatron-tp2pp2-<device>.json"),
    ("memory-trace-peer-megatron-pp4", 4, "python tools/bench_peer_megatron.py --pp 4 --seqs 512 "
     "--variants eager,ours,ours_segments --rounds 2 --memory-trace", "memory-trace-peer-megatron-pp4-<device>.json"),
    ("profile-peer-megatron-pp4", 4, "python tools/bench_peer_megatron.py --pp 4 --seqs 512 --variants megatron,ours "
     "--rounds 2 --repeats 1 --profile --name profile-peer-megatron-pp4", "profile-peer-megatron-pp4-<device>.json"),
]
BASELINE = "@baseline"  # a step's name with this suffix: the step, run from the --baseline checkout
# Run only when named: they look for a fault or break memory down, they record no published figure.
DIAGNOSTIC = {"gpu-suite-probe", "pool-kept", "memory-trace-peer-megatron-pp1", "memory-trace-peer-megatron-pp2",
              "memory-trace-peer-megatron-pp4", "profile-peer-megatron-pp4"}


def selected(gpus: int, only: str | None) -> list:
    """The steps to run: those named in ``only`` (comma-separated, in that order), else every
    step that needs at most ``gpus`` GPUs, diagnostics left out."""
    if only is not None:
        by_name = {s[0]: s for s in STEPS}
        names = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in names if n.removesuffix(BASELINE) not in by_name]
        if unknown or not names:
            raise SystemExit(f"reproduce.py: no step {', '.join(map(repr, unknown)) or repr(only)}; "
                             f"steps: {', '.join(by_name)} (each also as NAME{BASELINE})")
        return [(n, *by_name[n.removesuffix(BASELINE)][1:]) for n in names]
    return [s for s in STEPS if s[1] <= gpus and s[0] not in DIAGNOSTIC]


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_lanes(specs: list, have: int) -> list:
    """``[(GPU ids, steps)]`` from ``IDS:STEP[,STEP...]`` specs (``0:engine,hf``, ``2,3:allreduce``):
    the ids are this machine's, no two lanes share one, and each step fits its lane's GPUs."""
    lanes, taken = [], set()
    for spec in specs:
        ids_text, sep, names = spec.partition(":")
        try:
            ids = [int(i) for i in ids_text.split(",")]
        except ValueError:
            ids = []
        if not sep or not ids or not names:
            raise SystemExit(f"reproduce.py: --lanes {spec!r}: write GPU ids, a colon and steps, e.g. 2,3:allreduce")
        bad = [i for i in ids if not 0 <= i < have]
        if bad or len(set(ids)) < len(ids) or taken & set(ids):
            raise SystemExit(f"reproduce.py: --lanes {spec!r}: GPU ids must be distinct among all lanes and "
                             f"below this machine's {have} GPU(s)")
        taken.update(ids)
        steps = selected(have, names)
        big = [s[0] for s in steps if s[1] > len(ids)]
        if big:
            raise SystemExit(f"reproduce.py: --lanes {spec!r}: {', '.join(big)} need more GPUs than the lane's {len(ids)}")
        lanes.append((ids, steps))
    return lanes


class Runner:
    """Starts the steps' processes and stops them all when told to (a SIGTERM, the end of the
    run): a step asked to start after that is not started."""

    def __init__(self):
        self._lock = threading.Lock()
        self._running: set = set()
        self.stopping = threading.Event()

    def run_step(self, name: str, command: str, log_dir: Path, timeout: float, gpus: list | None = None,
                 checkout: Path = REPO) -> tuple:
        """``(exit code or a word, seconds, log path)``; the step's output goes to its log only;
        ``gpus``: the GPU ids (this process's numbering) it sees, all by default; ``checkout``:
        the code it runs (another one goes first on ``PYTHONPATH``)."""
        words = shlex.split(command)
        settings = {}
        while words and ASSIGNMENT.fullmatch(words[0]):  # NAME=VALUE before the command, as in a shell
            key, value = words.pop(0).split("=", 1)
            settings[key] = value
        argv = [sys.executable if words[0] == "python" else words[0], *words[1:]]
        env = {**os.environ, "NCCL_NVLS_ENABLE": "0", **settings}
        if checkout != REPO:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), env.get("PYTHONPATH")) if p)
            version = checkout / "CODE_VERSION"
            if version.is_file():
                env["GRAPHPP_CODE_VERSION"] = version.read_text().strip()
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_ids(gpus))
        log = log_dir / f"{name}.log"
        start = time.monotonic()
        with open(log, "w") as out:
            out.write(f"$ {command}\n")
            out.flush()
            with self._lock:
                if self.stopping.is_set():
                    return "not started (stopping)", 0.0, log
                try:
                    proc = launch.start(argv, env=env, cwd=checkout, stdout=out, stderr=subprocess.STDOUT)
                except OSError as exc:
                    out.write(f"could not start: {exc}\n")
                    return "not started", time.monotonic() - start, log
                self._running.add(proc)
            try:
                code = self._wait(proc, name, log, start, timeout)
            finally:  # the step's own clean-up gets SIGTERM and time to stop its ranks
                launch.stop(proc, grace=STOP_GRACE_S)
                with self._lock:
                    self._running.discard(proc)
        return code if not self.stopping.is_set() or code == 0 else "stopped", time.monotonic() - start, log

    @staticmethod
    def _wait(proc, name: str, log: Path, start: float, timeout: float):
        """``proc``'s exit code, or ``"timeout"``; every :data:`PROGRESS_S` seconds a line with the
        step's time, the run's, and the last line the step wrote to its log."""
        while True:
            left = start + timeout - time.monotonic()
            try:
                return proc.wait(timeout=max(0.0, min(PROGRESS_S, left)))
            except subprocess.TimeoutExpired:
                if left <= PROGRESS_S:
                    return "timeout"
            now = time.monotonic()
            print(f"    {name}: {now - start:.0f} s (run {elapsed()}){last_line(log)}", flush=True)

    def stop_all(self) -> None:
        """No new step starts; every running one gets SIGTERM at once, then SIGKILL after the
        grace (one deadline for all, so a few lanes do not add up their graces)."""
        with self._lock:
            self.stopping.set()
            procs = list(self._running)
        for proc in procs:
            launch.terminate(proc)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            launch.stop(proc, grace=max(0.0, deadline - time.monotonic()))


def elapsed() -> str:
    """The time since this run started, as ``12 min 5 s``."""
    minutes, seconds = divmod(int(time.monotonic() - STARTED), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def last_line(log: Path, width: int = 100) -> str:
    """``": <the log's last non-empty line>"`` (cut to ``width``), or nothing."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = [line.strip() for line in f.read().decode(errors="replace").replace("\r", "\n").splitlines()]
    except OSError:
        return ""
    lines = [line for line in lines if line]
    return f": {lines[-1][:width]}" if lines else ""


def visible_ids(gpus: list) -> list:
    """``gpus`` (indices among the GPUs this process sees) as ``CUDA_VISIBLE_DEVICES`` entries: the
    same numbers, or the entries of this process's own ``CUDA_VISIBLE_DEVICES`` they index."""
    mine = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return [mine[i] if i < len(mine) else str(i) for i in gpus] if mine else [str(i) for i in gpus]


def run_lane(runner: Runner, steps: list, gpus: list | None, args, end: float | None) -> list:
    """Run ``steps`` one after the other (on ``gpus``; without them each step on the first GPUs,
    as many as it needs), each under what is left of the budget; ``[(name, result, seconds, record)]``."""
    rows, where = [], "" if gpus is None else f" [GPU {','.join(map(str, gpus))}]"
    for i, (name, need, command, record) in enumerate(steps, 1):
        left = args.timeout if end is None else min(args.timeout, end - time.monotonic() - STOP_GRACE_S)
        if left <= 0 or runner.stopping.is_set():
            why = "the budget is spent" if left <= 0 else "stopping"
            print(f"[{i}/{len(steps)}]{where} {name}: skipped ({why})", flush=True)
            rows.append((name, "skipped", 0.0, record))
            continue
        checkout = args.baseline if name.endswith(BASELINE) else REPO
        print(f"[{i}/{len(steps)}]{where} {name} (run {elapsed()}): {command}"
              + (f" (in {checkout})" if checkout != REPO else ""), flush=True)
        code, seconds, log = runner.run_step(name, command, args.log_dir, left,
                                             gpus if gpus is not None else list(range(need)), checkout=checkout)
        print(f"    {name}: {'ok' if code == 0 else f'FAILED ({code})'} in {seconds:.0f} s, log {log}", flush=True)
        rows.append((name, "ok" if code == 0 else f"failed ({code})", seconds, record))
    return rows


def run_lanes(runner: Runner, lanes: list, args, end: float | None) -> list:
    """Each lane in a thread of its own; the rows of all, lane by lane (a lane whose thread
    raised: one failed row per step)."""
    results: dict = {}

    def lane(i, ids, steps):
        try:
            results[i] = run_lane(runner, steps, ids, args, end)
        except BaseException as exc:  # noqa: BLE001 - reported in the summary
            results[i] = [(s[0], f"failed (lane: {type(exc).__name__})", 0.0, s[3]) for s in steps]

    threads = [threading.Thread(target=lane, args=(i, ids, steps), daemon=True)
               for i, (ids, steps) in enumerate(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [row for i in range(len(lanes)) for row in results[i]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, choices=[1, 2, 4], default=1, help="run the steps that need at most this many GPUs")
    p.add_argument("--only", metavar="NAME[,NAME...]", help="run these steps, in this order (any GPU count)")
    p.add_argument("--lanes", nargs="+", metavar="IDS:STEP[,STEP...]",
                   help="run these lists of steps side by side, each on the GPUs it names (e.g. 0:engine 2,3:allreduce)")
    p.add_argument("--baseline", type=Path, metavar="DIR",
                   help=f"an older checkout: steps named NAME{BASELINE} run their command there")
    p.add_argument("--list", action="store_true", help="print the steps' commands and exit")
    p.add_argument("--log-dir", type=Path, default=REPO / "benchmarks" / "logs")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per step")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all the steps together (those that do not fit are skipped)")
    args = p.parse_args(argv)
    if args.budget is not None and not args.budget > 0:
        p.error(f"--budget must be > 0 seconds, got {args.budget:g}")
    if args.lanes and args.only:
        p.error("--lanes names its own steps; leave --only out")
    wants_baseline = BASELINE in " ".join([args.only or "", *(args.lanes or [])])
    if wants_baseline and not args.list and (args.baseline is None or not (args.baseline / "tools").is_dir()):
        p.error(f"steps named NAME{BASELINE} need --baseline DIR, a checkout with a tools/ folder"
                + (f" ({args.baseline} has none)" if args.baseline is not None else ""))
    if args.baseline is not None:
        args.baseline = args.baseline.resolve()
    steps = selected(args.gpus, args.only) if not args.lanes else [s for spec in args.lanes for s in selected(
        4, spec.partition(":")[2] or spec)]
    if args.list:
        for name, gpus, command, record in steps:
            print(f"{name:<20} {gpus} GPU  {command}  -> benchmarks/results/{record}")
        return 0
    print(f"reproduce.py: {len(steps)} step(s): {', '.join(s[0] for s in steps)}; logs in {args.log_dir}", flush=True)
    have, need = gpu_count(), max(s[1] for s in steps)
    lanes = parse_lanes(args.lanes, have) if args.lanes else []
    if have < need:
        print(f"reproduce.py: these steps need {need} GPU(s), this machine has {have}", file=sys.stderr)
        return 2
    args.log_dir.mkdir(parents=True, exist_ok=True)
    end = None if args.budget is None else time.monotonic() + args.budget
    runner = Runner()
    try:
        with launch.sigterm_raises():  # a SIGTERM here stops the running steps
            rows = run_lane(runner, steps, None, args, end) if not lanes else run_lanes(runner, lanes, args, end)
    finally:
        runner.stop_all()
    print(f"\n{'step':<20} {'result':<16} {'seconds':>8}  record  (run {elapsed()})")
    for name, result, seconds, record in rows:
        where = f"{args.baseline}/benchmarks/results" if name.endswith(BASELINE) else "benchmarks/results"
        print(f"{name:<20} {result:<16} {seconds:>8.0f}  {where}/{record}")
    return 0 if all(r[1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
