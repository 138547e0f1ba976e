"""What paddle_graphpp will do on this machine: ``python -m paddle_graphpp`` (``--json`` for scripts).

The report lists the frameworks and libraries found (against their supported ranges), the GPU
and its driver, whether a small CUDA graph captures and replays here (PyTorch), the allocator
settings in force, and which optional features are available or would fall back; a feature that
cannot apply here (the GPU features on a machine without a working capture) is not listed, and
neither is advice for it. Also installed as the console script ``paddle-graphpp-report``. Without a GPU
(no ``/dev/nvidia*`` device and no ``nvidia-smi``) no framework is imported, so the report takes
a fraction of a second on a CPU machine.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from typing import Any, Optional

from .core.flags import env_flag
from .support import report as support_report

__all__ = ["environment_report", "format_report", "main"]

# Settings that change what the package does, read from the environment.
_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "FLAGS_use_cuda_malloc_async_allocator",
             "FLAGS_graphpp_pool_expandable", "FLAGS_graphpp_reserve_pool", "FLAGS_graphpp_replay_timeout",
             "FLAGS_graphpp_allreduce_timeout", "FLAGS_graphpp_capture_agreement", "NCCL_NVLS_ENABLE",
             "TORCH_SYMM_MEM_DISABLE_MULTICAST")


def _gpu_visible() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


def _nvidia_smi() -> Optional[list]:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [dict(zip(("name", "driver", "memory"), (p.strip() for p in line.split(",")))) for line in
            out.splitlines() if line.strip()]


def _torch_checks() -> dict:
    """Capture and replay a tiny graph; the features that depend on PyTorch and the device."""
    import torch

    found: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        found["capture"] = "not tried: PyTorch sees no CUDA device (graphed layers run eagerly)"
        return found
    found["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    found["allocator_backend"] = torch.cuda.get_allocator_backend()
    try:
        x = torch.ones(8, device="cuda")
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        from .torch.graphs import capturing

        with torch.cuda.stream(stream), capturing(graph):
            y = x * 2
        torch.cuda.current_stream().wait_stream(stream)
        x.fill_(3)
        graph.replay()
        torch.cuda.synchronize()
        found["capture"] = "works" if torch.equal(y, torch.full_like(y, 6)) else "replay gave wrong values"
    except Exception as exc:  # noqa: BLE001 - the report says what failed
        found["capture"] = f"fails: {type(exc).__name__}: {exc}"
    return found


def _flag(name: str, default: bool) -> bool:
    """A boolean setting as the library reads it; one it cannot read counts as its default
    here (the library raises on it where it is used; the report lists its raw value)."""
    try:
        return env_flag(name, default)
    except ValueError:
        return default


_GPU_FEATURES = "custom all-reduce, expandable graph pools, stream-ordered allocator, capture agreement, watchdog"


def _features(torch_found: Optional[dict], *, gpu_visible: bool) -> dict:
    """The optional features that apply on this machine: available, or what they fall back to.

    ``cuda_graphs`` is always there; the GPU features are listed only where a graph captured
    here (PyTorch), since none of them does anything elsewhere, and the advice on enabling the
    custom all-reduce only where it could run (2 GPUs or more)."""
    if torch_found is None:
        if not gpu_visible:
            return {"cuda_graphs": f"falls back to eager (no GPU visible); the GPU features ({_GPU_FEATURES}) "
                                   f"do not apply"}
        found = {"cuda_graphs": "not checked (the report tries a capture through PyTorch where it is installed, "
                                "without --no-device)"}
        if _flag("FLAGS_use_cuda_malloc_async_allocator", False):
            found["stream_ordered_allocator"] = "asked for (FLAGS_use_cuda_malloc_async_allocator)"
        return found
    if torch_found.get("capture") != "works":
        return {"cuda_graphs": f"falls back to eager ({torch_found.get('capture')})"}
    n = len(torch_found.get("devices", []))
    async_on = torch_found.get("allocator_backend") == "cudaMallocAsync" or \
        _flag("FLAGS_use_cuda_malloc_async_allocator", False)
    multicast_off = os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") == "1"
    if n < 2:
        all_reduce = f"falls back to NCCL/the framework's all-reduce (needs 2 or 4 GPUs; {n} here)"
    elif multicast_off:
        all_reduce = "available for groups of 2 or 4 ranks"
    else:
        all_reduce = ("falls back to NCCL/the framework's all-reduce (set TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and "
                      "NCCL_NVLS_ENABLE=0 for it)")
    expandable = _flag("FLAGS_graphpp_pool_expandable", True)
    return {
        "cuda_graphs": "available",
        "custom_all_reduce": all_reduce,
        "expandable_graph_pools": ("on" if expandable and not async_on else
                                   "off" + (" (stream-ordered allocator)" if async_on else
                                            " (FLAGS_graphpp_pool_expandable=0)")),
        "stream_ordered_allocator": "active" if async_on else "not active (the caching allocator)",
        "capture_agreement_and_replay_watchdog": ("on by default once torch.distributed runs with several ranks"
                                                  " (FLAGS_graphpp_capture_agreement=0, "
                                                  "FLAGS_graphpp_replay_timeout=0 turn them off)"),
    }


def environment_report(*, check_device: Optional[bool] = None) -> dict:
    """The report as a dict (what ``--json`` prints). ``check_device``: import PyTorch and try a
    capture (default: when a GPU is visible and PyTorch is installed)."""
    versions = support_report()
    gpus = _nvidia_smi()
    gpu_visible = _gpu_visible()
    if check_device is None:
        check_device = gpu_visible and versions["torch"]["installed"] is not None
    torch_found = _torch_checks() if check_device else None
    settings = {name: os.environ[name] for name in _SETTINGS if name in os.environ}
    from . import __version__

    return {"paddle_graphpp": __version__, "integrations": versions, "gpus": gpus, "torch": torch_found,
            "settings": settings, "features": _features(torch_found, gpu_visible=gpu_visible)}


def format_report(report: dict) -> str:
    """A short readable text of :func:`environment_report`."""
    lines = [f"paddle_graphpp {report['paddle_graphpp']}", "", "integrations (installed / supported / tested):"]
    for name, row in report["integrations"].items():
        lines.append(f"  {name:14} {row['installed'] or '-':14} >= {row['oldest']:6} tested to "
                     f"{row['newest_tested']:8} {row['status']}")
    lines += ["", "GPUs:"] + ([f"  {g['name']}, driver {g['driver']}, {g['memory']}" for g in report["gpus"]]
                              if report["gpus"] else ["  none visible"])
    if report["torch"] is not None:
        lines.append(f"  PyTorch: CUDA {report['torch'].get('cuda')}, capture {report['torch'].get('capture')}")
    lines += ["", "settings in force:"] + ([f"  {k}={v}" for k, v in report["settings"].items()] or ["  none set"])
    lines += ["", "features:"] + [f"  {k}: {v}" for k, v in report["features"].items()]
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m paddle_graphpp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-device", action="store_true", help="do not import a framework or try a capture")
    args = parser.parse_args(argv)
    report = environment_report(check_device=False if args.no_device else None)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
