"""How busy a GPU is with compute: the share of a stretch of steps that some kernel runs.

A pipeline stage's GPU idles in the schedule's bubble (waiting for a neighbour's activations
or gradients) and, eagerly, between kernels the CPU has not launched yet. Graphs remove the
second; zero-bubble schedules shrink the first. This measures what is left::

    from tools import busy

    prof = busy.start()          # before the steps to measure
    ...                          # the steps
    share = busy.stop(prof)      # in [0, 1]

``stop`` synchronises the device, then takes every CUDA kernel the profiler saw except NCCL's
(communication, which spins while it waits), merges their intervals, and divides the merged
time by the span from the first kernel's start to the last kernel's end. Copies and memsets are
not kernels and do not count.
"""

from __future__ import annotations

__all__ = ["start", "stop", "busy_share"]


def start():
    """A running ``torch.profiler`` recording CUDA activity."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    prof.__enter__()
    return prof


def stop(prof) -> float | None:
    """End ``prof``; the compute-busy share of what it recorded (``None``: no kernel ran)."""
    import torch

    torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    intervals = []
    for evt in prof.events():
        if evt.device_type.name != "CUDA" or "nccl" in evt.name.lower():
            continue
        if "memcpy" in evt.name.lower() or "memset" in evt.name.lower():
            continue
        intervals.append((evt.time_range.start, evt.time_range.end))
    return busy_share(intervals)


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
