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
    return slug_of(torch.cuda.get_device_name())


def slug_of(name: str) -> str:
    """The file-name form of a device name ("NVIDIA H200" -> "h200")."""
    if name == "cpu":
        return name
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
    env["settings"] = settings()
    return env


def settings() -> dict:
    """The environment variables that change what a run measures: the library's flags and the
    CUDA allocator's configuration (a run under a non-default one says so in its record)."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith("FLAGS_graphpp_") or k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}


def code_version() -> str:
    """The checkout's commit (with ``+dirty`` when files differ from it); ``GRAPHPP_CODE_VERSION``
    names it where the tree was copied without its git history (the GPU machine); without
    either, ``files:<digest>`` of the code (:func:`code_digest`), which a checkout can match."""
    import subprocess

    if os.environ.get("GRAPHPP_CODE_VERSION"):
        return os.environ["GRAPHPP_CODE_VERSION"]

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "files:" + code_digest()
    return commit + ("+dirty" if dirty else "")


def code_digest(root: Path | None = None) -> str:
    """A digest (12 hex digits) of the Python files under ``paddle_graphpp/``, ``tools/`` and
    ``testing/`` (the launcher and parity check the tools run) of ``root`` (default: this
    checkout): their paths and contents, in path order. To find the commit of a record that says
    ``files:<digest>``, compute it on candidate checkouts (one without ``testing/``, older than
    it, digests as before)."""
    import hashlib

    root = Path(root or ROOT)
    digest = hashlib.sha256()
    for path in sorted(p for top in ("paddle_graphpp", "tools", "testing") for p in (root / top).rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


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


def max_loss_diff(a: dict, b: dict):
    """The largest per-step difference between two runs' ``losses`` (``None`` when either run has
    none); a run that stopped early is compared over the steps both have."""
    if not a.get("losses") or not b.get("losses"):
        return None
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))


#: The loss tolerance of bf16 runs that compute in another order than their reference (a tensor-
#: parallel split, fused compiled kernels): a few units of bf16's relative precision (2**-8) on the
#: fp32 mean loss. Two identical eager runs may agree bit for bit, so their spread alone cannot
#: judge such runs; :func:`loss_check` takes the larger of the two.
BF16_LOSS_RTOL = 1e-2


def max_rel_loss_diff(a: list, b: list, *, same_steps: bool = False):
    """The largest per-step relative difference ``|x - y| / |y|`` between loss lists ``a`` and
    ``b`` (``b`` the reference), over the steps both have; ``None`` when either is empty, or
    with ``same_steps`` when their numbers of steps differ (a run that stopped early)."""
    if not a or not b or (same_steps and len(a) != len(b)):
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def rank_result(compute: Callable[[], dict], labels: dict) -> int:
    """A worker rank's end: print ``compute()``'s record as the last JSON line (the driver reads
    it, :func:`last_json_line`), or on an error a line of ``labels``, the error and its
    traceback. Returns the exit status (0, or 1 after an error)."""
    import traceback

    try:
        record = compute()
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, then exit 1
        sys.stdout.flush()
        print(json.dumps({**labels, "error": f"{type(exc).__name__}: {exc}"[:4000],
                          "traceback": traceback.format_exc()[-6000:]}), flush=True)
        return 1
    sys.stdout.flush()
    print(json.dumps(record), flush=True)
    sys.stderr.flush()
    return 0


def loss_check(reference: list, others: list, *, floor: float) -> dict:
    """Losses of runs under test against a reference run, judged by the reference's own spread.

    Args:
        reference: loss lists of identical runs of the reference configuration; the first is
            what ``others`` are compared with, two or more give the spread.
        others: loss lists of the runs under test.
        floor: the smallest tolerance (relative): identical runs can be bit-identical (spread
            0) while the runs under test compute in another order, which no rerun shows.

    Returns:
        ``reference_spread`` (largest relative difference between reference runs; ``None``
        with fewer than two), ``max_rel_err`` (the worst run under test against the first
        reference run; ``None`` when none compares), ``tolerance`` (``max(spread, floor)``),
        ``judged_by`` (``"reference_spread"`` or ``"floor"``: which of the two set it),
        ``within`` (``max_rel_err <= tolerance``; ``False`` when nothing compared or a run
        has another number of steps than the reference).
    """
    reference = [r for r in reference if r]
    spreads = [max_rel_loss_diff(r, reference[0]) for r in reference[1:]]
    spread = max(spreads) if spreads else None
    tolerance = max(spread or 0.0, floor)
    errors = [max_rel_loss_diff(o, reference[0]) for o in others] if reference else []
    complete = bool(others) and all(o and len(o) == len(reference[0]) for o in others) if reference else False
    worst = max((e for e in errors if e is not None), default=None)
    return {"reference_spread": spread, "max_rel_err": worst, "tolerance": tolerance,
            "judged_by": "reference_spread" if spread is not None and spread > floor else "floor",
            "within": complete and worst is not None and worst <= tolerance}


def loss_falls(losses: list) -> bool:
    """Every loss list ends below where it started (``False`` when there is none, or one is empty)."""
    return bool(losses) and all(bool(run) and run[-1] < run[0] for run in losses)


def last_json_line(text: str):
    """The last non-blank line of ``text`` parsed as JSON (a tool's result line), or ``None``
    when ``text`` is blank or that line is not JSON."""
    lines = [line for line in text.splitlines() if line.strip()]
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        return None


def write_result(name: str, payload: dict, *, slug: str | None = None) -> Path:
    """Write ``benchmarks/results/<name>-<device>.json`` (and a copy under $OUT if set); ``slug``
    names the device where the figures were measured elsewhere (default: this machine's).
    Every record says which code measured it: ``code_version`` (:func:`code_version`) and the
    ``command`` (:func:`command`) are added where the payload does not give them."""
    payload = {"command": command(), "code_version": code_version(), **payload}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{slug or device_slug()}.json"
    text = json.dumps(payload, indent=2, sort_keys=False) + "\n"
    path.write_text(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, path.name).write_text(text)
    return path


class DeviceMemory:
    """This process's reserved device memory on ``device``: the caching allocator's and, under
    the stream-ordered allocator (``backend:cudaMallocAsync``), the driver's graph memory too,
    which torch's counters leave out (there graphs allocate from the driver, not from torch).

    Under that allocator :meth:`peak_mib` adds two peaks that need not fall at the same moment:
    an upper bound of the true peak."""

    def __init__(self, device=None):
        import torch

        from paddle_graphpp.torch.memory.allocator import async_allocator_active

        device = torch.device("cuda") if device is None else torch.device(device)
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self.graphs = None
        if async_allocator_active():
            from paddle_graphpp.core.driver_memory import GraphMemory

            self.graphs = GraphMemory(self.device.index)
            if self.graphs.get(GraphMemory.RESERVED_CURRENT) is None:
                raise RuntimeError(
                    "DeviceMemory: the stream-ordered allocator is active but the CUDA driver's graph-memory "
                    "counters cannot be read (libcuda's cuDeviceGetGraphMemAttribute); without them graph "
                    "memory would be left out of every figure")

    def _graph(self, attr: int) -> float:
        value = self.graphs.get(attr) if self.graphs is not None else None
        return (value or 0) / 2**20

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self.device)
        if self.graphs is not None:
            self.graphs.reset_high()

    def peak_mib(self) -> float:
        import torch

        return torch.cuda.max_memory_reserved(self.device) / 2**20 + self._graph(3)  # RESERVED_HIGH

    def current_mib(self) -> float:
        import torch

        return torch.cuda.memory_reserved(self.device) / 2**20 + self._graph(2)  # RESERVED_CURRENT

    def graph_mib(self) -> float:
        """The driver's graph memory now (0 outside the stream-ordered allocator)."""
        return self._graph(2)
