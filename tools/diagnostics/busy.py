"""How busy a GPU is with compute: the share of a stretch of steps that some kernel runs.

A pipeline stage's GPU idles in the schedule's bubble (waiting for a neighbour's activations
or gradients) and, eagerly, between kernels the CPU has not launched yet. Graphs remove the
second; zero-bubble schedules shrink the first. This measures what is left::

    from tools.diagnostics import busy

    prof = busy.start()          # before the steps to measure
    ...                          # the steps
    share = busy.stop(prof)      # in [0, 1]

``stop`` synchronises the device, then takes every CUDA kernel the profiler saw except NCCL's
(communication, which spins while it waits), merges their intervals, and divides the merged
time by the span from the first kernel's start to the last kernel's end. Copies and memsets are
not kernels and do not count.
"""

from __future__ import annotations

__all__ = ["start", "stop", "report", "busy_share", "idle_gaps", "kind_of", "time_by_kind"]

# Kernel kinds by name, first match wins: attention before GEMM (memory-efficient attention's
# kernels are CUTLASS ones), Inductor's matmul templates (``triton_tem``) before its fused
# kernels (the other ``triton_`` ones).
KINDS = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "triton_tem")),
    ("optimizer", ("adam", "sgd", "lamb", "lion")),  # not the foreach copy/add/zero the engine launches
    ("triton", ("triton_",)),
)


def start():
    """A running ``torch.profiler`` recording CUDA activity."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    prof.__enter__()
    return prof


def stop(prof, gaps: bool = False):
    """End ``prof``; the compute-busy share of what it recorded (``None``: no kernel ran).
    With ``gaps``: ``(share, idle_gaps(...))``, where the idle time went."""
    kernels, comm = _kernels(prof)
    share = busy_share([(a, b) for a, b, _ in kernels])
    return (share, idle_gaps(kernels, comm)) if gaps else share


def report(prof, steps: int) -> dict:
    """End ``prof``, which recorded ``steps`` steps; per step, in ms: the span from the first
    kernel's start to the last one's end, the time some compute kernel ran (``busy_ms``) and
    the rest (``idle_ms``), kernel time by :func:`kind_of`; the compute-busy share and the
    largest idle gaps (:func:`idle_gaps`). Removing launch gaps, as graphs do, can speed these
    steps up by at most ``1 / compute_busy``: the kernels themselves stay."""
    kernels, comm = _kernels(prof)
    if not kernels:
        return {"compute_busy": None}
    share = busy_share([(a, b) for a, b, _ in kernels])
    span = max(b for _, b, _ in kernels) - min(a for a, _, _ in kernels)
    per_step = 1e-3 / steps  # us over the stretch -> ms per step
    by_kind = time_by_kind(kernels + [(a, b, "nccl") for a, b in comm])
    return {"steps": steps, "compute_busy": share, "span_ms": round(span * per_step, 3),
            "busy_ms": round(span * share * per_step, 3), "idle_ms": round(span * (1 - share) * per_step, 3),
            "kernel_ms": {k: round(v * per_step, 3) for k, v in by_kind.items()},
            "kernels_per_step": round(len(kernels) / steps, 1), "gaps": idle_gaps(kernels, comm)}


def kind_of(name: str) -> str:
    """What a kernel does, from its name: one of :data:`KINDS`' names, or ``"other"`` (ATen's
    elementwise kernels, reductions, embedding, loss)."""
    low = name.lower()
    for kind, marks in KINDS:
        if any(m in low for m in marks):
            return kind
    return "other"


def time_by_kind(kernels) -> dict:
    """Total duration of ``(start, end, name)`` kernels per :func:`kind_of`, largest first
    (overlapping kernels each count in full)."""
    out: dict = {}
    for a, b, n in kernels:
        k = kind_of(n)
        out[k] = out.get(k, 0.0) + max(0.0, b - a)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _kernels(prof):
    """End ``prof``; its compute kernels ``(start, end, name)`` and communication ``(start, end)``."""
    import torch

    torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    kernels, comm = [], []
    for evt in prof.events():
        if evt.device_type.name != "CUDA":
            continue
        name = evt.name.lower()
        if "nccl" in name:
            comm.append((evt.time_range.start, evt.time_range.end))
            continue
        if "memcpy" in name or "memset" in name:
            continue
        kernels.append((evt.time_range.start, evt.time_range.end, evt.name))
    return kernels, comm


def idle_gaps(kernels, comm=(), min_us: float = 20.0, top: int = 10) -> dict:
    """Where a GPU idled between compute kernels: ``kernels`` are ``(start, end, name)``,
    ``comm`` the ``(start, end)`` of communication kernels (times in us). Gaps of at least
    ``min_us`` are grouped by the kernel before and the kernel after (names cut to 50
    characters); each group gives its count, total and the share of it during which a
    communication kernel ran (waiting for a peer rather than for the CPU). Returns
    ``{"idle_us", "gaps_us" (gaps of at least min_us), "span_us", "groups": [...]}``."""
    ks = sorted((a, b, n) for a, b, n in kernels if b > a)
    if not ks:
        return {"idle_us": 0.0, "gaps_us": 0.0, "span_us": 0.0, "groups": []}
    cs = sorted(comm)
    groups: dict = {}
    idle = counted = 0.0
    end, last = ks[0][1], ks[0][2]
    for a, b, n in ks[1:]:
        if a > end:
            gap = a - end
            idle += gap
            if gap >= min_us:
                counted += gap
                overlap = sum(max(0.0, min(ce, a) - max(cs_, end)) for cs_, ce in cs if cs_ < a and ce > end)
                g = groups.setdefault((last[:50], n[:50]), [0, 0.0, 0.0])
                g[0] += 1
                g[1] += gap
                g[2] += min(overlap, gap)
        if b >= end:
            end, last = b, n
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    return {"idle_us": round(idle, 1), "gaps_us": round(counted, 1), "span_us": round(end - ks[0][0], 1),
            "groups": [{"after": k[0], "before": k[1], "count": c, "total_us": round(t, 1),
                        "comm_share": round(o / t, 3) if t else 0.0} for k, (c, t, o) in rows]}


def busy_share(intervals) -> float | None:
    """Merged length of ``(start, end)`` intervals over their overall span (``None`` if empty)."""
    intervals = sorted((a, b) for a, b in intervals if b > a)
    if not intervals:
        return None
    busy, cur_start, cur_end = 0.0, intervals[0][0], intervals[0][1]
    for a, b in intervals[1:]:
        if a > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    busy += cur_end - cur_start
    span = max(b for _, b in intervals) - intervals[0][0]
    return round(busy / span, 4) if span > 0 else None
