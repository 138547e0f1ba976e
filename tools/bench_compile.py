#!/usr/bin/env python
"""Training throughput of a Hugging Face Llama under torch.compile, reduce-overhead and ``graph_layers``, one GPU.

    python tools/bench_compile.py                            # both shapes, all six variants
    python tools/bench_compile.py --shapes small --budget 560
    python tools/bench_compile.py --shapes 1b --budget 560 --merge   # keeps the small shape's figures
    python tools/bench_compile.py --dry-run                  # the worker commands, nothing run

What it measures: an unmodified ``LlamaForCausalLM`` built from a config (no download; bf16,
``use_cache=False``, its own ``labels=`` loss, fused AdamW, ``--micro-batches`` micro-batches of
gradient accumulation per step; ``tools/compile_worker.py`` has the loop and the shapes: ``small``
hidden 512, 8 layers, 8 heads, 4 kv heads, intermediate 1376, vocab 8192, micro-batch 2 x 256;
``1b`` hidden 2048, 16 layers, 16 heads, 16 kv heads, intermediate 5504, vocab 32000, 1 x 2048)
trained as each of these variants:

* ``eager``: as built. ``compile``: ``torch.compile(model)``.
* ``reduce_overhead``: ``torch.compile(model, mode="reduce-overhead")``, which fails in a
  gradient-accumulation loop; the worker tries the usual remedies in turn and records each one's
  error (``compile_worker.APPROACHES``). Its failure is a result, not a stop.
* ``ours``: ``graph_layers(model.model.layers)``; ``ours_compiled``: ``graph_layers(...,
  compile=True)`` (compiled blocks inside the graphs; the summary's figure);
  ``ours_compiled_model``: the same inside ``torch.compile(model)`` (the graphed blocks are
  opaque to dynamo, so the embedding, final norm, head and loss compile around them).

Method: every variant runs in its own process (``tools/compile_worker.py``; dynamo's and the
allocator's state are per process), all of a group at once on the same GPU, from the same seed
and data. Each worker times its first step (compilation included), runs ``--warmup`` more steps
(graphs capture there), records the mean loss of steps 1..6 and its peak reserved memory, then
waits. The parent then alternates: round r asks each worker in turn for ``--iters`` steps between
two ``torch.cuda.synchronize()`` (the order reversed every round), ``--rounds`` rounds; tokens/s
come from the median round, spread = slowest round / fastest. Ratios are taken only between
variants of one group (side by side). The six 1b workers may not fit one 80 GB GPU together, so
by default the 1b variants run in two groups, one after the other, each with its own ``compile``
as the anchor: (compile, ours_compiled, ours) and (compile, eager, reduce_overhead,
ours_compiled_model); ``--groups`` changes that. First-step times are measured while the group's
other workers compile too (``--stagger`` warms them one at a time: cleaner, slower).

After the rounds each worker runs ``--profile-steps`` more steps under ``torch.profiler``
(``tools/diagnostics/busy.py``): the share of the span some compute kernel ran, and kernel time by
kind (GEMM, attention, Inductor's fused kernels, optimizer, other). Graphs remove only idle
time: the record's ``graphing_ceiling`` puts each variant's kernel time beside its (unprofiled)
step time, which bounds what removing idle time can give (see ``graphing_ceiling``).
``--resummarize RECORD`` recomputes a record's summary and ceiling from the runs it holds.

A worker that fails, exits or stops answering is recorded (its error, exit code and the tail of
its stderr) and the others go on; ``--worker-timeout`` limits a warmup, ``--budget`` the run.

Writes ``benchmarks/results/compile-<device>.json`` (and a copy under $OUT): command, device,
versions, code commit, settings, per shape and group each variant's figures, and a summary.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import queue
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)

from testing import launch  # noqa: E402
from tools import benchlib  # noqa: E402
from tools.compile_worker import RECORDED_STEPS, SHAPES, VARIANTS  # noqa: E402

WORKER = str(Path(REPO, "tools", "compile_worker.py"))
AUTO_GROUPS = {"1b": [["compile", "ours_compiled", "ours", "ours_whole", "ours_whole_compiled", "ours_whole_step"],
                      ["compile", "eager", "reduce_overhead", "ours_compiled_model"]]}
WHOLE = ("ours_whole", "ours_whole_compiled", "ours_whole_step")
RUN_REPLY_S = 120.0  # a "run N" that takes longer is a hang
DONE_REPLY_S = 30.0
STDERR_TAIL = 3000
METHOD = ("one process per variant, a group's processes at once on one GPU; first step timed (compilation "
          "included), --warmup more steps, then --rounds alternating rounds (order reversed every round) of "
          "--iters steps between torch.cuda.synchronize() calls; tokens/s from the median round, spread = "
          "slowest/fastest round; ratios only within a group")


class Worker:
    """One worker process: commands on its stdin, JSON replies from its stdout (read by a thread,
    so a silent worker cannot block the parent), stderr in a temporary file for its tail."""

    def __init__(self, cmd: list, env: dict | None = None):
        self.err = tempfile.TemporaryFile("w+", errors="replace")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     text=True, env=env, cwd=REPO, start_new_session=True)
        self.replies: queue.Queue = queue.Queue()
        self.failure: dict | None = None
        self.ready: dict = {}
        self.seconds: list[float] = []
        self.done: dict = {}
        self.profile: dict = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                self.replies.put(obj)
        self.replies.put(None)  # end of output: the process is ending

    def send(self, command: str) -> None:
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except OSError:  # it has exited; receive() reports how
            pass

    def receive(self, command: str, timeout: float) -> dict | None:
        """The reply to ``command``, or ``None`` once the failure is recorded (the worker then stopped)."""
        try:
            reply = self.replies.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return self.fail(f"no reply to {command!r} within {timeout:.0f} s", hung=True)
        if reply is None:
            return self.fail(f"exited before replying to {command!r}")
        if reply.get("event") == "failed":
            return self.fail(reply.get("error"), tried=reply.get("tried"))
        return reply

    def ask(self, command: str, timeout: float) -> dict | None:
        if self.failure is not None:
            return None
        self.send(command)
        return self.receive(command, timeout)

    def fail(self, error, *, tried=None, hung: bool = False) -> None:
        if not hung:
            try:
                self.proc.wait(timeout=5)  # one that failed exits by itself: its own exit code
            except subprocess.TimeoutExpired:
                pass
        self.stop()
        self.failure = {"error": error, "exit_code": self.proc.returncode, "stderr_tail": self.stderr_tail()}
        if tried is not None:
            self.failure["tried"] = tried

    def stderr_tail(self) -> str:
        self.err.seek(0)
        return self.err.read()[-STDERR_TAIL:]

    def stop(self) -> None:
        """End the worker and its process group (Inductor's compile workers), and reap it."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        launch.stop(self.proc)

    def record(self) -> dict:
        out = {k: v for k, v in self.ready.items() if k not in ("event", "variant", "shape")}
        out["round_seconds"] = self.seconds
        if self.profile:
            out["profile"] = {k: v for k, v in self.profile.items() if k != "event"}
        if "steady_peak_reserved_mib" in self.done:
            out["steady_peak_reserved_mib"] = self.done["steady_peak_reserved_mib"]
        return dict(out, **(self.failure or {}))


def round_orders(names: list, rounds: int) -> list[list]:
    """The turn order of each round: as given, then reversed, and so on."""
    return [list(names) if r % 2 == 0 else list(names)[::-1] for r in range(rounds)]


def warm_all(workers: dict, *, timeout: float, deadline: float, stagger: bool) -> None:
    """Every worker builds and warms up: all at once, or one after another with ``stagger``."""
    if not stagger:
        for w in workers.values():
            w.send("warm")
    until = min(time.monotonic() + timeout, deadline)
    for w in workers.values():
        if stagger:
            until = min(time.monotonic() + timeout, deadline)
            w.send("warm")
        w.ready = w.receive("warm", until - time.monotonic()) or {}


def alternate(workers: dict, *, iters: int, rounds: int, deadline: float, reply_timeout: float) -> bool:
    """The timed rounds; a failed worker drops out. ``False`` when the budget cut them short."""
    for order in round_orders(list(workers), rounds):
        for name in order:
            left = deadline - time.monotonic()
            if left <= 1:
                return False
            reply = workers[name].ask(f"run {iters}", min(reply_timeout, left))
            if reply is not None:
                workers[name].seconds.append(reply["seconds"])
    return True


def run_group(commands: dict, *, iters: int, rounds: int, warm_timeout: float, deadline: float,
              reply_timeout: float = RUN_REPLY_S, stagger: bool = False, env: dict | None = None,
              profile_steps: int = 0) -> dict:
    """Start one worker per command, warm them, time them in alternating rounds; their raw records.

    ``commands`` maps a variant's name to its worker's argv (any program speaking
    ``compile_worker``'s protocol). ``warm_timeout`` limits the warmup (all of it, or each one's
    with ``stagger``), ``reply_timeout`` each timed round, ``deadline`` (``time.monotonic()``) the
    whole. ``profile_steps`` > 0: then each worker profiles that many steps, one worker at a time.
    Every worker is stopped on the way out, whatever happens.
    """
    workers: dict[str, Worker] = {}
    try:
        for name, cmd in commands.items():
            workers[name] = Worker(cmd, env)
        warm_all(workers, timeout=warm_timeout, deadline=deadline, stagger=stagger)
        if not alternate(workers, iters=iters, rounds=rounds, deadline=deadline, reply_timeout=reply_timeout):
            for w in workers.values():
                w.ready["note"] = "rounds cut short: time budget spent"
        elif profile_steps:
            for w in workers.values():
                left = deadline - time.monotonic()
                if left > 1:
                    w.profile = w.ask(f"profile {profile_steps}", min(reply_timeout, left)) or {}
        for w in workers.values():
            w.done = w.ask("done", DONE_REPLY_S) or {}
            if w.failure is None:
                try:
                    w.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
    finally:
        for w in workers.values():
            w.stop()
    return {name: w.record() for name, w in workers.items()}


def variant_record(raw: dict, *, tokens_per_step: int, iters: int) -> dict:
    """A worker's raw record with its timing: tokens/s of the median round, and the spread."""
    if "error" in raw:
        return raw
    if not raw.get("round_seconds"):
        return dict(raw, error="no timed round")
    per_step = [s / iters for s in raw["round_seconds"]]
    median = statistics.median(per_step)
    return dict(raw, tokens_per_s=tokens_per_step / median, median_s_per_step=median,
                spread=max(per_step) / min(per_step), rounds=len(per_step), round_s_per_step=per_step)


def ok(rec) -> bool:
    return bool(rec) and "error" not in rec and rec.get("tokens_per_s") is not None


def side_by_side(shape_result: dict | None, a: str, b: str):
    """tokens/s of ``a`` over ``b`` from the first group where both ran; ``None`` if none did."""
    for group in (shape_result or {}).get("groups", []):
        if ok(group.get(a)) and ok(group.get(b)):
            return group[a]["tokens_per_s"] / group[b]["tokens_per_s"]
    return None


def loss_rel_err(rec: dict | None, ref: dict | None):
    """The largest |rec - ref| / |ref| over the recorded step losses both have."""
    return benchlib.max_rel_loss_diff((rec or {}).get("losses"), (ref or {}).get("losses"))


def first_record(shape_result: dict | None, name: str):
    return next((g[name] for g in (shape_result or {}).get("groups", []) if name in g), None)


def reduce_overhead_summary(shape_result: dict | None):
    rec = first_record(shape_result, "reduce_overhead")
    if rec is None:
        return None
    if "error" in rec:
        return {"error": rec["error"]}
    return {"tokens_per_s": rec.get("tokens_per_s"), "approach": rec.get("approach"),
            "vs_compile": side_by_side(shape_result, "reduce_overhead", "compile")}


def step_us(shape_result: dict | None, name: str):
    """Microseconds per step of ``name`` (the median round); at the tiny shape this is host time."""
    rec = first_record(shape_result, name)
    return round(rec["median_s_per_step"] * 1e6, 1) if ok(rec) else None


def summarize(shapes: dict) -> dict:
    """The headline figures; ``None`` where an input is missing (a variant failed or was not run).

    The whole-model figures (``ours_whole_*``) are those of ``graph_model(compile=True)``
    (variant ``ours_whole_compiled``), as ``ours_compiled`` is the blocks' headline; the one
    without Inductor is ``ours_whole_uncompiled_vs_reduce_overhead_small``."""
    errs = [loss_rel_err(first_record(r, "ours_compiled"), first_record(r, "compile")) for r in shapes.values()]
    errs = [e for e in errs if e is not None]
    whole_errs = {}
    for name in WHOLE:
        found = [loss_rel_err(first_record(r, name), first_record(r, "compile")) for r in shapes.values()]
        found = [e for e in found if e is not None]
        whole_errs[name] = max(found) if found else None
    return {
        "ours_whole_vs_reduce_overhead_small": side_by_side(shapes.get("small"), "ours_whole_compiled",
                                                            "reduce_overhead"),
        "ours_whole_step_vs_reduce_overhead_small": side_by_side(shapes.get("small"), "ours_whole_step",
                                                                 "reduce_overhead"),
        "ours_whole_vs_compile_1b": side_by_side(shapes.get("1b"), "ours_whole_compiled", "compile"),
        "ours_whole_uncompiled_vs_reduce_overhead_small": side_by_side(shapes.get("small"), "ours_whole",
                                                                       "reduce_overhead"),
        "whole_loss_max_rel_err_vs_compile": whole_errs,
        "tiny_us_per_step": {n: step_us(shapes.get("tiny"), n) for n in ("reduce_overhead", "ours_compiled", *WHOLE)}
        if shapes.get("tiny") else None,
        "ours_compiled_vs_compile_1b": side_by_side(shapes.get("1b"), "ours_compiled", "compile"),
        "ours_compiled_vs_ours_small": side_by_side(shapes.get("small"), "ours_compiled", "ours"),
        "ours_compiled_vs_compile_small": side_by_side(shapes.get("small"), "ours_compiled", "compile"),
        "loss_max_rel_err_vs_compile": max(errs) if errs else None,
        "reduce_overhead": {shape: reduce_overhead_summary(r) for shape, r in shapes.items()},
    }


def graphing_ceiling(shapes: dict) -> dict:
    """Per shape, the most that removing idle time could give over ``compile``, from each
    variant's step time (unprofiled, the median round) and its kernel time per step (the profiled
    steps' ``busy_ms``; the profiler slows the host, not the kernels). ``compile_idle_ms``: what
    compile's step spends beyond its kernels, so ``compile_graphed_max`` = its step over its
    kernels is all any graphing of compile's own kernels can gain; ``ours_compiled_max`` =
    compile's step over ``ours_compiled``'s kernel time is all ``ours_compiled`` can reach
    with no idle time at all; ``ours_compiled_idle_ms`` and ``reduce_overhead_idle_ms`` are
    their steps beyond their kernels. ``None`` where a variant or its profile is missing."""

    def step_and_kernels(r, name):
        rec = first_record(r, name) or {}
        busy = (rec.get("profile") or {}).get("busy_ms")
        step = rec.get("median_s_per_step")
        return (step * 1e3, busy) if ok(rec) and busy else (None, None)

    out = {}
    for shape, r in shapes.items():
        c_step, c_busy = step_and_kernels(r, "compile")
        o_step, o_busy = step_and_kernels(r, "ours_compiled")
        ro_step, ro_busy = step_and_kernels(r, "reduce_overhead")
        if c_step is None:
            out[shape] = None
            continue
        out[shape] = {"compile_step_ms": round(c_step, 2), "compile_kernel_ms": c_busy,
                      "compile_idle_ms": round(c_step - c_busy, 2), "compile_graphed_max": round(c_step / c_busy, 4),
                      "ours_compiled_kernel_ms": o_busy,
                      "ours_compiled_idle_ms": round(o_step - o_busy, 2) if o_busy else None,
                      "ours_compiled_max": round(c_step / o_busy, 4) if o_busy else None,
                      "reduce_overhead_idle_ms": round(ro_step - ro_busy, 2) if ro_busy else None}
    return out


def resummarize(path: str) -> int:
    """Rewrite the record at ``path`` with its summary and ceiling recomputed from its runs."""
    payload = json.loads(Path(path).read_text())
    payload["summary"] = summarize(payload["shapes"])
    payload["graphing_ceiling"] = graphing_ceiling(payload["shapes"])
    payload["summary_code_version"] = benchlib.code_version()
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps({"summary": payload["summary"], "graphing_ceiling": payload["graphing_ceiling"]}, indent=2))
    return 0


def plan_groups(shape: str, variants: list, spec: str) -> list[list]:
    """The groups of variants that run together at ``shape`` (see ``--groups``)."""
    if spec == "one" or (spec == "auto" and (shape not in AUTO_GROUPS or len(variants) <= 3)):
        return [list(variants)]
    raw = AUTO_GROUPS[shape] if spec == "auto" else [g.split(",") for g in spec.split(";")]
    groups = [[v for v in (n.strip() for n in g) if v in variants] for g in raw]
    groups = [g for g in groups if g]
    if sum("compile" in g for g in groups) > 1:
        groups = [g for g in groups if g != ["compile"]]  # an anchor alone compares nothing
    left = [v for v in variants if not any(v in g for g in groups)]
    if left:
        raise ValueError(f"--groups {spec!r} leaves out {', '.join(left)} at {shape}; name every variant")
    return groups


def worker_command(variant: str, shape: str, args) -> list:
    return [sys.executable, WORKER, "--variant", variant, "--shape", shape,
            "--micro-batches", str(args.micro_batches), "--warmup", str(args.warmup)]


def child_env() -> dict:
    return dict(os.environ, NCCL_NVLS_ENABLE="0")


def bench_shape(shape: str, args, deadline: float) -> dict:
    s = SHAPES[shape]
    tokens = args.micro_batches * s.micro_batch * s.seq
    groups = []
    for i, names in enumerate(plan_groups(shape, args.variants, args.groups)):
        print(f"[{shape}] group {i + 1}: {', '.join(names)}", file=sys.stderr, flush=True)
        if deadline - time.monotonic() < 30:
            groups.append({n: {"error": "skipped: time budget spent"} for n in names})
            continue
        raw = run_group({n: worker_command(n, shape, args) for n in names}, iters=args.iters, rounds=args.rounds,
                        warm_timeout=args.worker_timeout, deadline=deadline, stagger=args.stagger, env=child_env(),
                        profile_steps=args.profile_steps)
        recs = {n: variant_record(r, tokens_per_step=tokens, iters=args.iters) for n, r in raw.items()}
        for n, rec in recs.items():
            rec["vs_compile"] = side_by_side({"groups": [recs]}, n, "compile") if n != "compile" else None
            rec["loss_max_rel_err_vs_compile"] = loss_rel_err(rec, recs.get("compile")) if n != "compile" else None
        groups.append(recs)
    return {"config": asdict(s), "tokens_per_step": tokens, "groups": groups}


def merge_previous(payload: dict, path: Path) -> None:
    """Keep the shapes of an earlier result on the same device that this run did not measure."""
    if not path.exists():
        return
    prev = json.loads(path.read_text())
    if prev.get("device") != payload["device"] or prev.get("torch") != payload["torch"]:
        print(f"--merge: {path} is from {prev.get('device')} / torch {prev.get('torch')}; not merged",
              file=sys.stderr)
        return
    kept = {k: v for k, v in prev.get("shapes", {}).items() if k not in payload["shapes"]}
    if kept:
        payload["shapes"] = {**kept, **payload["shapes"]}
        payload["merged"] = [{"shapes": list(kept), "command": prev.get("command"), "date": prev.get("date"),
                              "paddle_graphpp": prev.get("paddle_graphpp")}] + prev.get("merged", [])


def fmt(x, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def print_table(payload: dict) -> None:
    print(f"\nLlama training, {payload['settings']['micro_batches']} micro-batches per step, bf16, "
          f"{payload['device']}")
    print(f"{'shape':6} {'grp':>3} {'variant':22} {'tokens/s':>10} {'spread':>7} {'vs comp':>8} {'first s':>8} "
          f"{'peak MiB':>9} {'steady MiB':>10} {'busy':>5}  error")
    for shape, r in payload["shapes"].items():
        for i, group in enumerate(r["groups"]):
            for name, rec in group.items():
                err = (rec.get("error") or "").splitlines()[0][:70] if rec.get("error") else ""
                print(f"{shape:6} {i + 1:3} {name:22} {fmt(rec.get('tokens_per_s'), '10.0f')} "
                      f"{fmt(rec.get('spread'), '7.3f')} {fmt(rec.get('vs_compile'), '8.3f')} "
                      f"{fmt(rec.get('first_step_s'), '8.1f')} {fmt(rec.get('peak_reserved_mib'), '9.0f')} "
                      f"{fmt(rec.get('steady_peak_reserved_mib'), '10.0f')} "
                      f"{fmt((rec.get('profile') or {}).get('compute_busy'), '5.3f')}  {err}")
    print("summary:", json.dumps(payload["summary"], indent=2))
    print("graphing ceiling over compile:", json.dumps(payload.get("graphing_ceiling")))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="small,1b", help=f"comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=6, help="untimed steps after the first")
    p.add_argument("--iters", type=int, default=3, help="steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--groups", default="auto",
                   help="'auto' (1b in two groups, see above), 'one' (all at once), or groups 'a,b;c,d'")
    p.add_argument("--profile-steps", type=int, default=2,
                   help="steps each worker profiles after the rounds (0: none)")
    p.add_argument("--stagger", action="store_true", help="warm the workers one at a time")
    p.add_argument("--worker-timeout", type=float, default=420.0, help="seconds for one group's warmup")
    p.add_argument("--budget", type=float, default=1500.0, help="seconds for the whole run")
    p.add_argument("--merge", action="store_true", help="keep other shapes of this device's earlier result")
    p.add_argument("--dry-run", action="store_true", help="print the worker commands, run nothing")
    p.add_argument("--resummarize", metavar="RECORD", default=None,
                   help="recompute a written record's summary and ceiling from the runs it holds; run nothing")
    args = p.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [s for s in args.shapes if s not in SHAPES] + [v for v in args.variants if v not in VARIANTS]
    if bad or not args.shapes or not args.variants:
        p.error(f"unknown or missing shapes/variants: {bad or 'none given'}")
    if min(args.micro_batches, args.iters, args.rounds) < 1 or args.warmup < RECORDED_STEPS - 1:
        p.error(f"--micro-batches, --iters, --rounds must be >= 1 and --warmup >= {RECORDED_STEPS - 1}")
    if args.profile_steps < 0:
        p.error("--profile-steps must be >= 0")
    try:
        args.plan = {s: plan_groups(s, args.variants, args.groups) for s in args.shapes}
    except ValueError as e:
        p.error(str(e))
    return args


def dry_run(args) -> int:
    for shape, groups in args.plan.items():
        for i, names in enumerate(groups):
            print(f"# {shape}, group {i + 1}: {', '.join(names)}")
            for n in names:
                print(shlex.join(worker_command(n, shape, args)))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.resummarize:
        return resummarize(args.resummarize)
    if args.dry_run:
        return dry_run(args)
    import torch

    if not torch.cuda.is_available():
        print("bench_compile.py needs a CUDA device", file=sys.stderr)
        return 2
    with launch.sigterm_raises():  # the workers are stopped on the way out
        return _measure(args)


def _measure(args) -> int:
    deadline = time.monotonic() + args.budget
    versions = {"transformers": importlib.metadata.version("transformers"), "paddle_graphpp": benchlib.code_version()}
    shapes = {shape: bench_shape(shape, args, deadline) for shape in args.shapes}
    payload = {"command": benchlib.command(), **benchlib.environment(), **versions,
               "settings": {k: v for k, v in vars(args).items() if k not in ("dry_run", "plan")},
               "groups": args.plan, "method": METHOD, "shapes": shapes}
    if args.merge:
        merge_previous(payload, benchlib.RESULTS / f"compile-{benchlib.device_slug()}.json")
    payload["summary"] = summarize(payload["shapes"])
    payload["graphing_ceiling"] = graphing_ceiling(payload["shapes"])
    path = benchlib.write_result("compile", payload)
    print_table(payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
