#!/usr/bin/env python
"""Graph memory modes in a real interleaved pipeline (2 GPUs): eager vs each memory mode.

    python tools/bench_pipeline_memory.py

Runs ``tools/train_gpt.py --framework torch --pp 2 --vpp 2`` (hidden 2048, 4 layers, micro-batch
4 x 512, 8 micro-batches, 12 steps) eagerly and with ``--cudagraph --graph-memory MODE`` for
``per_graph``, ``shared`` and ``shared_reuse``, and records each run's ``peak_mem_mib`` (max
reserved over the run, capture step included) and ``steady_peak_mem_mib`` (after warmup and
capture), max over ranks, in ``benchmarks/results/memory-pipeline-<device>.json``.
"""

from __future__ import annotations

import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)
from tools import benchlib  # noqa: E402
from tools.bench_pipeline import run_one  # noqa: E402

CONFIG = ["--framework", "torch", "--pp", "2", "--vpp", "2", "--hidden", "2048", "--layers", "4",
          "--micro-batch-size", "4", "--seq-len", "512", "--micro-batches", "8", "--steps", "12",
          "--seed", "1234", "--timeout", "120"]
VARIANTS = {"eager": [], "per_graph": ["--cudagraph", "--graph-memory", "per_graph"],
            "shared": ["--cudagraph", "--graph-memory", "shared"],
            "shared_reuse": ["--cudagraph", "--graph-memory", "shared_reuse"]}


def main() -> int:
    import torch

    if torch.cuda.device_count() < 2:
        print("bench_pipeline_memory: needs 2 GPUs", file=sys.stderr)
        return 2
    deadline = time.monotonic() + 300
    runs = {}
    for name, extra in VARIANTS.items():
        remaining = deadline - time.monotonic()
        if remaining < 20:
            runs[name] = {"error": "skipped: time budget spent"}
            continue
        print(f"[{name}] ...", flush=True)
        runs[name] = run_one(CONFIG + extra, timeout=min(150.0, remaining - 5))
    eager = runs["eager"]
    print(f"{'variant':<14}{'peak MiB':>10}{'x eager':>9}{'steady MiB':>12}{'x eager':>9}{'tok/s':>10}")
    for name, r in runs.items():
        if "error" in r:
            print(f"{name:<14} FAILED: {r['error']}\n{r.get('stderr_tail', '')[-800:]}")
            continue
        x = r["peak_mem_mib"] / eager.get("peak_mem_mib", float("nan"))
        y = r["steady_peak_mem_mib"] / eager.get("steady_peak_mem_mib", float("nan"))
        print(f"{name:<14}{r['peak_mem_mib']:>10.0f}{x:>9.2f}{r['steady_peak_mem_mib']:>12.0f}{y:>9.2f}"
              f"{r['tokens_per_s']:>10.0f}")
    keep = ("command", "error", "peak_mem_mib", "steady_peak_mem_mib", "tokens_per_s", "losses", "graphs_active")
    payload = {"command": benchlib.command(), **benchlib.environment(), "config": CONFIG,
               "runs": {k: {f: v[f] for f in keep if f in v} for k, v in runs.items()}}
    path = benchlib.write_result("memory-pipeline", payload)
    print(f"wrote {path}")
    return 0 if all("error" not in r for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
