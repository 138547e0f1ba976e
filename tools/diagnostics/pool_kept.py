#!/usr/bin/env python
"""What stays allocated in the graphs' pools between replays, and who holds it (one GPU).

    python tools/diagnostics/pool_kept.py          # -> benchmarks/results/pool-kept-<device>.json
    python tools/diagnostics/pool_kept.py --variants qwen3_moe:whole_grouped

Each variant (``model:variant`` of ``tools/bench_moe.py``, at its launch-bound shape) trains
``--steps`` steps in a process of its own; then every block still allocated in a graph pool is
listed with the tensors that point into it (shape, dtype, and the types holding them). Blocks no
Python tensor holds are then tested against torch's cuBLAS workspaces: torch keeps one workspace
per (cuBLAS handle, stream), and a capture stream's would be allocated inside the first capture
that runs a matmul (one on the thread that captures forwards, one on autograd's device thread,
which captures backwards). Captures free them before and after
(``paddle_graphpp.torch.graphs.free_blas_workspaces``), so none should be found; clearing the
workspaces (``torch._C._cuda_clearCublasWorkspaces()``) would free any that is, and is done last.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])
if REPO not in sys.path:
    sys.path.insert(0, REPO)

DEFAULT = ("qwen3_moe:whole_grouped", "qwen3_moe:around", "qwen3_moe:model_grouped")
MIB = 2**20


def kept_blocks():
    """(address, size) of every block allocated in a graph pool (not the default pool)."""
    import torch

    return sorted((b["address"], b["size"]) for seg in torch.cuda.memory_snapshot()
                  if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
                  for b in seg["blocks"] if b["state"] == "active_allocated")


def holders(blocks):
    """For each block: the tensors whose storage starts inside it, and the types of the objects
    that refer to them (this search's own list and frames left out)."""
    import inspect

    import torch

    found = {addr: [] for addr, _ in blocks}
    objects = gc.get_objects()
    for obj in objects:
        try:
            if not isinstance(obj, torch.Tensor) or not obj.is_cuda:
                continue
            ptr = obj.untyped_storage().data_ptr()
        except Exception:  # noqa: BLE001 - a tensor subclass without storage
            continue
        for addr, size in blocks:
            if addr <= ptr < addr + size:
                referrers = [r for r in gc.get_referrers(obj) if r is not objects and not inspect.isframe(r)]
                found[addr].append({"shape": list(obj.shape), "dtype": str(obj.dtype),
                                    "held_by": sorted({type(r).__name__ for r in referrers})[:6]})
    return found


def child(spec: str, steps: int) -> dict:
    import torch

    from tools import bench_moe

    model_type, name = spec.split(":")
    implementation, door = bench_moe.VARIANTS[name]
    model = bench_moe.build(model_type, implementation, launch_bound=True)
    bench_moe.graph(model, door)
    step = bench_moe.trainer(model)
    data = bench_moe.batches(bench_moe.parse_args([]), model.config.vocab_size, 1, seed=1)[0]  # its shape
    for _ in range(steps):
        step(data)
    torch.cuda.synchronize()
    gc.collect()
    blocks = kept_blocks()
    held = holders(blocks)
    torch._C._cuda_clearCublasWorkspaces()  # last: the graphs' workspaces are gone after this
    left = {addr for addr, _ in kept_blocks()}
    rows = [{"mib": round(size / MIB, 2), "tensors": held[addr],
             "cublas_workspace": addr not in left and not held[addr]} for addr, size in blocks]
    return {"kept_mib": round(sum(size for _, size in blocks) / MIB, 2),
            "cublas_workspaces_mib": round(sum(r["mib"] for r in rows if r["cublas_workspace"]), 2),
            "blocks": rows, "device_capability": list(torch.cuda.get_device_capability())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="*", default=list(DEFAULT), help="model:variant of tools/bench_moe.py")
    p.add_argument("--steps", type=int, default=3, help="training steps before looking (capture included)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    from testing import launch
    from tools import benchlib

    results = {}
    for spec in args.variants:
        end = launch.run([sys.executable, __file__, "--child", spec, "--steps", str(args.steps)], timeout=300)
        results[spec] = benchlib.last_json_line(end.stdout) or {
            "error": ("timed out after 300 s: " if end.timed_out else "") + (end.stderr or end.stdout)[-400:]}
        print(spec, {k: v for k, v in results[spec].items() if k != "blocks"}, flush=True)
    path = benchlib.write_result("pool-kept", {"environment": benchlib.environment(), "settings": vars(args),
                                               "variants": results})
    print(path)


if __name__ == "__main__":
    main()
