#!/usr/bin/env python
"""Where the host's time goes in a training step of ``tools/compile_worker.py``'s Llama.

    python tools/diagnostics/host_time.py --variant ours_compiled --shape 1b [--steps 3 --top 30]

A graphed step is as fast as its kernels only while the host launches work ahead of the GPU;
where the host falls behind (a synchronising call, Python slower than the kernels it launches)
the GPU idles (``busy.py`` shows where). This builds one variant as ``bench_compile`` does,
warms it up, then times ``--steps`` steps twice: with the GPU synchronised after each step
(wall time per step) and under ``cProfile`` (host time by function). It prints the per-step
times, the host time per call of the engine's forward and backward, and the functions that
took the most time themselves and in total, the lines of one step that synchronise, and
the host's microseconds per call of a decoder block, the engine's entry, a graphed backward and
the decoder model's forward (timers patched on their classes, no profiler).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tools import compile_worker as cw  # noqa: E402


def per_call(stats: pstats.Stats, suffix: str, func: str):
    """(calls, cumulative ms per call) of the function ``func`` in a file ending with ``suffix``."""
    for (path, _, name), (cc, nc, tt, ct, callers) in stats.stats.items():
        if path.endswith(suffix) and name == func:
            return nc, round(ct / nc * 1e3, 4) if nc else None
    return 0, None


def function_rows(prof) -> list:
    """``(file:line:function, calls, self seconds, total seconds)`` of each function a
    ``cProfile.Profile`` saw: what the benchmarks sort and scale into their profiles."""
    return [(f"{Path(path).name}:{line}:{name}", nc, tt, ct)
            for (path, line, name), (_cc, nc, tt, ct, _) in pstats.Stats(prof).stats.items()]


class Timers:
    """Host time spent inside chosen methods (patched on their classes while active): total
    seconds and calls per label. Calls nested in an already-timed call of the same label count once."""

    def __init__(self):
        self.total: dict = {}
        self._patched: list = []

    def wrap(self, label: str, owner, attr: str) -> None:
        original = owner.__dict__[attr]
        fn = original.__func__ if isinstance(original, staticmethod) else original
        timers, depth = self, [0]

        def timed(*a, **k):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    t, n = timers.total.get(label, (0.0, 0))
                    timers.total[label] = (t + time.perf_counter() - start, n + 1)

        setattr(owner, attr, staticmethod(timed) if isinstance(original, staticmethod) else timed)
        self._patched.append((owner, attr, original))

    def restore(self) -> None:
        for owner, attr, original in reversed(self._patched):
            setattr(owner, attr, original)
        self._patched.clear()

    def per_call_us(self) -> dict:
        return {k: {"calls": n, "us_per_call": round(t / n * 1e6, 1)} for k, (t, n) in self.total.items()}


def time_engine_parts(timers: Timers) -> None:
    """Put ``timers`` on the parts of the engine's forward entry and its replay (labels
    ``forward: ...``, ``replay: ...``, ``call: ...``)."""
    from paddle_graphpp.core import engine, replay, replay_watch, state
    from paddle_graphpp.torch import autograd as graphed_autograd
    from paddle_graphpp.torch import runtime

    for label, owner, attr in (
            ("forward: autograd function apply", graphed_autograd, "apply_graphed_function"),
            ("forward: engine forward", engine.GraphedCallable, "forward"),
            ("forward: replay (all of it)", replay.Replays, "forward"),
            ("replay: copy inputs", runtime.TorchRuntime, "copy_many"),
            ("replay: graph launch", runtime.TorchRuntime, "replay_graph"),
            ("replay: watchdog note", replay_watch.ReplayWatch, "launched"),
            ("replay: hand out", replay.Replays, "hand_out"),
            ("replay: held outputs", replay.Replays, "keep_held_outputs"),
            ("replay: state check", state.LayerStateCheck, "check"),
            ("call: watchdog check", replay_watch.ReplayWatch, "check"),
            ("call: flatten", engine, "flatten"),
            ("call: unavailable reason", runtime.TorchRuntime, "graphs_unavailable_reason")):
        timers.wrap(label, owner, attr)


def timed_calls(trainer, model, steps: int, detail: bool = False) -> dict:
    """Host microseconds per call of a decoder block (as the model calls it), of the engine's
    forward entry, of a graphed backward, and of the whole decoder model's forward; with
    ``detail``, of the parts of the engine's forward too."""
    import torch

    from paddle_graphpp.core.engine import GraphedCallable
    from paddle_graphpp.torch import autograd as graphed_autograd

    timers = Timers()
    block_type = type(model.model.layers[0])
    owner = next(c for c in block_type.__mro__ if "__call__" in c.__dict__)
    if owner is torch.nn.Module:  # timing it would time every module call, the whole model's included
        raise SystemExit(f"host_time.py: {block_type.__name__} has no __call__ of its own below nn.Module to time")
    timers.wrap("block call", owner, "__call__")
    timers.wrap("decoder model forward", type(model.model), "forward")
    timers.wrap("engine forward", GraphedCallable, "__call__")
    timers.wrap("graphed backward", graphed_autograd._GraphedFunction, "backward")
    if detail:  # the forward's parts
        time_engine_parts(timers)
    try:
        for _ in range(steps):
            trainer.step()
    finally:
        timers.restore()
    return timers.per_call_us()


def syncs_in_step(trainer) -> dict:
    """Where one step makes the host wait for the GPU: ``torch.cuda.set_sync_debug_mode``'s
    warnings, counted by the Python line that raised them."""
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where: dict = {}
    for w in caught:
        if "synchronizing CUDA operation" in str(w.message):  # not the mode's own notice
            key = f"{Path(w.filename).name}:{w.lineno}"
            where[key] = where.get(key, 0) + 1
    return where


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="ours_compiled", choices=cw.VARIANTS)
    p.add_argument("--shape", default="1b", choices=list(cw.SHAPES))
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--detail", action="store_true", help="time the parts of the engine's forward as well")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("host_time.py needs a CUDA device", file=sys.stderr)
        return 2
    shape = cw.SHAPES[args.shape]
    model = cw.build(shape)
    trainer = cw.Trainer(model, cw.wrap(model, args.variant), cw.make_data(shape, args.micro_batches))
    for _ in range(args.warmup + 1):
        trainer.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        trainer.step()
    host = time.perf_counter() - start  # the host's time to issue the steps (it may wait on syncs inside)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    print("synchronising calls in one step:", syncs_in_step(trainer))
    print("host time per call:", json.dumps(timed_calls(trainer, model, args.steps, args.detail), indent=1))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        trainer.step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    fwd = per_call(stats, "core/engine.py", "__call__")
    bwd = per_call(stats, "torch/autograd.py", "backward")
    print(f"{args.variant} at {args.shape}: {wall / args.steps * 1e3:.2f} ms per step, host returned after "
          f"{host / args.steps * 1e3:.2f} ms per step; under cProfile, engine forward calls {fwd[0]} "
          f"at {fwd[1]} ms each, graphed backward calls {bwd[0]} at {bwd[1]} ms each")
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
        print(out.getvalue()[out.getvalue().find("ncalls"):])
    return 0


if __name__ == "__main__":
    sys.exit(main())
