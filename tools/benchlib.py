"""Shared helpers of the GPU benchmark scripts: device slug, versions, timing, result files.

Timing follows the project's method: side-by-side variants in one process, alternating
rounds (A B C, C B A, ...), CUDA events around each round, the median of the per-iteration
round times, and the spread (slowest round median over fastest) reported with it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def device_slug() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    for chip in ("H200", "H100", "A100", "L40S", "L4", "A10"):
        if chip in name:
            return chip.lower()
    return name.lower().replace(" ", "-")


def environment() -> dict:
    import torch

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    try:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - a CPU build has no NCCL
        env["nccl"] = None
    return env


def command() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def time_rounds(variants: dict[str, Callable[[], None]], *, iters: int, rounds: int) -> dict:
    """Per-iteration milliseconds of each variant: median over rounds, and the round spread.

    Each round runs ``iters`` calls of one variant between two CUDA events; the variants take
    turns, and the turn order reverses every round so no variant always follows another.
    """
    import torch

    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            fn = variants[name]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / iters)
    out = {}
    for name, ts in times.items():
        out[name] = {
            "median_ms": statistics.median(ts),
            "min_ms": min(ts),
            "max_ms": max(ts),
            "spread": max(ts) / min(ts),
            "rounds": len(ts),
            "iters_per_round": iters,
        }
    return out


def last_json_line(text: str):
    """The last non-blank line of ``text`` parsed as JSON (a tool's result line), or ``None``
    when ``text`` is blank or that line is not JSON."""
    lines = [line for line in text.splitlines() if line.strip()]
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        return None


def write_result(name: str, payload: dict) -> Path:
    """Write ``benchmarks/results/<name>-<device>.json`` (and a copy under $OUT if set)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{device_slug()}.json"
    text = json.dumps(payload, indent=2, sort_keys=False) + "\n"
    path.write_text(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, path.name).write_text(text)
    return path
