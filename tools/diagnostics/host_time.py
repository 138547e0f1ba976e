#!/usr/bin/env python
"""Where the host's time goes in a training step of ``tools/compile_worker.py``'s Llama.

    python tools/diagnostics/host_time.py --variant ours_compiled --shape 1b [--steps 3 --top 30]

A graphed step is as fast as its kernels only while the host launches work ahead of the GPU;
where the host falls behind (a synchronising call, Python slower than the kernels it launches)
the GPU idles (``busy.py`` shows where). This builds one variant as ``bench_compile`` does,
warms it up, then times ``--steps`` steps twice: with the GPU synchronised after each step
(wall time per step) and under ``cProfile`` (host time by function). It prints the per-step
times, the host time per call of the engine's forward and backward, and the functions that
took the most time themselves and in total, and the lines of one step that synchronise.
"""

from __future__ import annotations

import argparse
import cProfile
import io
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
        if "synchroniz" in str(w.message):
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
