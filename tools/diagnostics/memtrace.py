"""Where GPU memory goes: replay PyTorch's allocator trace and break the peak down.

    from tools.diagnostics import memtrace
    memtrace.start()                      # first thing after torch.cuda.set_device
    ...                                   # the run
    summary = memtrace.analyze(torch.cuda.memory._snapshot())

:func:`analyze` replays the allocation history (``alloc`` / ``free_completed`` /
``segment_alloc`` / ``segment_free`` events) from the start of recording, finds the moment
reserved memory peaked and the moment allocated memory peaked, and at each lists what was
alive, grouped by memory pool (the default pool or a graph pool) and by the allocating code:
the innermost frame in this project, the trainer, ``torch.optim`` or ``torch.distributed``.
Free space held in segments (reserved but unallocated) is shown per pool too: that is the
memory one pool caches and another cannot use. ``growth`` lists every segment a graph pool
grew by, with the request that needed it and the pool's largest free block at that moment: a
request larger than that block grew the pool although the pool had room in holes.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

__all__ = ["start", "analyze", "raw_events", "write_raw"]

MIB = 2**20
_OURS = ("paddle_graphpp/", "train_gpt.py", "gpt_torch.py")
_MODELS = ("megatron/", "transformers/models/")  # the model's own code, before torch's
_LIBS = ("torch/optim/", "torch/distributed/", "torch/autograd/", "torch/nn/")


def start(max_entries: int = 400_000) -> None:
    """Record every allocation with its Python stack from now on."""
    import torch

    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=max_entries)


def _label(frames: list) -> str:
    """The innermost frame of our code, else of the model's library (Megatron-Core, transformers),
    else of a torch library we care about, else the innermost."""
    for wanted in (_OURS, _MODELS, _LIBS):
        for f in frames:
            name = f.get("filename", "")
            if any(w in name for w in wanted):
                short = name.rsplit("/", 2)
                return f"{'/'.join(short[-2:])}:{f.get('line')}:{f.get('name')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line')}:{f.get('name')}"
    return "(no stack)"


def _pool(entry: dict) -> str:
    if "pool_id" not in entry:  # older traces: graph captures run on a side stream
        return f"stream{entry.get('stream', 0)}"
    pool = tuple(entry["pool_id"] or (0, 0))
    return "default" if pool == (0, 0) else f"graph{pool}"


def analyze(snapshot: dict, device: int | None = None, top: int = 14, steady_since_us: float | None = None,
            step_starts_us: list | None = None) -> dict:
    """Peak reserved and peak allocated moments of the recorded history, broken down.

    Returns ``{"complete": bool, "events": int, "peak_reserved": {...}, "peak_allocated": {...},
    "end": {...}}``; each moment holds ``reserved_mib`` and ``allocated_mib`` per pool and the
    ``top`` allocation sites alive then (MiB). ``complete`` is False when the history ring
    dropped early events (then baselines such as parameters may be missing): the first event
    kept is no allocation, or a block is freed that the history never allocated. With
    ``steady_since_us`` (a ``time.time() * 1e6`` stamp) the peak reserved after that moment is
    broken down too, as ``steady_peak_reserved``, and so is the moment each pool's allocated
    memory peaked after it, as ``steady_peak_allocated <pool>``. Each moment also splits every
    pool's free space into ``free_in_empty_segments_mib`` (segments with nothing allocated,
    which ``empty_cache`` would return) and ``free_in_used_segments_mib`` (holes beside live
    tensors, which only that pool's own later allocations can use).
    """
    import torch

    dev = torch.cuda.current_device() if device is None else device
    traces = snapshot.get("device_traces", [])
    events = traces[dev] if dev < len(traces) else []
    # Pass 1: where the two peaks are. Pass 2: replay up to each and take the picture there.
    peaks = _replay(events, None, since_us=steady_since_us)
    complete = bool(events) and events[0].get("action") in ("segment_alloc", "alloc") and not peaks["unknown_frees"]
    marks = {peaks["reserved_index"]: "peak_reserved", peaks["allocated_index"]: "peak_allocated"}
    if peaks.get("steady_index", -1) >= 0:
        marks.setdefault(peaks["steady_index"], "steady_peak_reserved")
    for pool, index in sorted(peaks.get("steady_pool_index", {}).items()):
        marks.setdefault(index, f"steady_peak_allocated {pool}")
    return {"complete": complete, "events": len(events), **_replay(events, marks, top, steps=step_starts_us)}


def raw_events(snapshot: dict, device: int | None = None) -> list:
    """The recorded history as compact rows, for offline study of the allocator (such as
    replaying a capture's requests under another layout): ``[action, addr, size, stream,
    pool, time_us, engine frame, site]``. ``pool`` is "default" or "graph(a, b)" where the
    event names its pool, else "stream<N>": torch 2.11's events name none, and a graph pool is
    then its capture stream, with what else is allocated on that stream (a capture's own
    random-number state, in the default pool; ``tools/diagnostics/pool_model.py`` leaves it out). The
    snapshot's segments cannot stand in: an address range changes pools over a run. ``engine
    frame`` is the innermost frame in ``paddle_graphpp/`` ("" when none), ``site`` as in
    :func:`analyze`."""
    import torch

    dev = torch.cuda.current_device() if device is None else device
    traces = snapshot.get("device_traces", [])
    rows = []
    for e in traces[dev] if dev < len(traces) else []:
        frames = e.get("frames") or []
        ours = next((f"{f.get('filename', '').rsplit('paddle_graphpp/', 1)[-1]}:{f.get('name')}" for f in frames
                     if "paddle_graphpp/" in f.get("filename", "")), "")
        rows.append([e.get("action"), e.get("addr"), e.get("size"), e.get("stream"), _pool(e),
                     e.get("time_us"), ours, _label(frames)])
    return rows


def write_raw(snapshot: dict, name: str, step_starts_us: list, folder: str | None = None) -> str | None:
    """Write :func:`raw_events` with the steps' start times to ``<folder>/<name>.json.gz`` (the
    folder: ``folder``, else the ``GRAPHPP_MEMTRACE_RAW`` environment variable; neither: nothing
    written), the input of ``tools/diagnostics/pool_model.py``. Returns the path written."""
    import gzip
    import json
    import os

    folder = folder or os.environ.get("GRAPHPP_MEMTRACE_RAW")
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.json.gz")
    with gzip.open(path, "wt") as f:
        json.dump({"step_starts_us": step_starts_us, "events": raw_events(snapshot)}, f)
    return path


def _largest_hole(pool: str, live: dict, seg_pool: dict) -> tuple:
    """(largest free block, free bytes) among ``pool``'s segments, from the live blocks."""
    segs = sorted((addr, size) for addr, (size, p) in seg_pool.items() if p == pool)
    blocks = sorted((addr, size) for addr, (size, p, _l, _t) in live.items() if p == pool)
    largest = free = 0
    j = 0
    for start, size in segs:
        cursor, end = start, start + size
        while j < len(blocks) and blocks[j][0] < end:
            addr, bsize = blocks[j]
            if addr >= start:
                largest, free = max(largest, addr - cursor), free + max(0, addr - cursor)
                cursor = max(cursor, addr + bsize)
            j += 1
        largest, free = max(largest, end - cursor), free + max(0, end - cursor)
    return largest, free


def _where(time_us: float, steps: list) -> tuple:
    """(step index, fraction of that step) of a moment; the last step ends at its start plus
    the previous step's length."""
    i = bisect.bisect_right(steps, time_us) - 1
    if i < 0:
        return -1, 0.0
    end = steps[i + 1] if i + 1 < len(steps) else steps[i] + (steps[i] - steps[i - 1] if i else 0)
    frac = (time_us - steps[i]) / (end - steps[i]) if end > steps[i] else 0.0
    return i, round(frac, 3)


def _replay(events: list, marks, top: int = 14, since_us: float | None = None, steps: list | None = None,
            segments_listed: int = 10) -> dict:
    live: dict[int, tuple] = {}  # addr -> (size, pool, label, time_us)
    seg_pool: dict[int, tuple] = {}  # segment addr -> (size, pool)
    reserved = allocated = 0
    best_res = best_alloc = best_steady = (-1, -1)
    pool_alloc: dict = defaultdict(int)  # pool -> allocated now
    best_pool: dict = {}  # pool -> (allocated, index), after since_us
    out: dict = {}
    growth: list = []  # graph-pool segments: [segment MiB, request MiB, largest hole MiB, free MiB, site]
    growing: dict = {}  # pool -> index into growth of a segment whose request is next
    unknown_frees = 0  # frees of blocks allocated before the history starts

    def moment(time_us: float | None = None) -> dict:
        alloc_pool: dict = defaultdict(int)
        sites: dict = defaultdict(int)
        sizes: dict = defaultdict(lambda: defaultdict(int))
        for size, pool, label, _t in live.values():
            alloc_pool[pool] += size
            sites[f"{pool} {label}"] += size
            sizes[f"{pool} {label}"][round(size / MIB, 1)] += 1
        res_pool: dict = defaultdict(int)
        for size, pool in seg_pool.values():
            res_pool[pool] += size
        # which segment each live block sits in: free space in used vs empty segments
        starts = sorted(seg_pool)
        used_in_seg: dict = defaultdict(int)
        for addr, (size, _pool_name, _label, _t) in live.items():
            i = bisect.bisect_right(starts, addr) - 1
            if i >= 0:
                used_in_seg[starts[i]] += size
        free_empty: dict = defaultdict(int)
        free_used: dict = defaultdict(int)
        segments: dict = defaultdict(list)
        for seg, (size, pool) in seg_pool.items():
            used = used_in_seg.get(seg, 0)
            (free_used if used else free_empty)[pool] += size - used
            segments[pool].append((round(size / MIB, 1), round(used / MIB, 1)))
        top_sites = sorted(sites.items(), key=lambda kv: -kv[1])[:top]
        out_m = {
            "reserved_mib": round(reserved / MIB, 1),
            "allocated_mib": round(allocated / MIB, 1),
            "reserved_by_pool_mib": {k: round(v / MIB, 1) for k, v in sorted(res_pool.items())},
            "allocated_by_pool_mib": {k: round(v / MIB, 1) for k, v in sorted(alloc_pool.items())},
            "free_in_empty_segments_mib": {k: round(v / MIB, 1) for k, v in sorted(free_empty.items())},
            "free_in_used_segments_mib": {k: round(v / MIB, 1) for k, v in sorted(free_used.items())},
            "top_sites_mib": {k: round(v / MIB, 1) for k, v in top_sites},
            "top_site_sizes": {k: dict(sorted(sizes[k].items(), key=lambda kv: -kv[1])[:6]) for k, _ in top_sites},
            # per pool, the segments with the most free space: [segment MiB, allocated in it MiB]
            "segments_most_free_mib": {k: sorted(v, key=lambda su: su[1] - su[0])[:segments_listed]
                                       for k, v in sorted(segments.items())},
            "segments": {k: len(v) for k, v in sorted(segments.items())},
        }
        if steps and time_us is not None:
            step, frac = _where(time_us, steps)
            before: dict = defaultdict(int)
            start = steps[step] if step >= 0 else float("-inf")
            for size, pool, _label, t in live.values():
                if t < start:
                    before[pool] += size
            out_m.update(step=step, step_fraction=frac,
                         allocated_before_step_by_pool_mib={k: round(v / MIB, 1) for k, v in sorted(before.items())})
        return out_m

    for index, ev in enumerate(events):
        action = ev.get("action")
        if action == "alloc":
            size = ev["size"]
            label = _label(ev.get("frames") or []) if marks is not None else ""
            live[ev["addr"]] = (size, _pool(ev), label, ev.get("time_us", 0))
            if _pool(ev) in growing:
                grown = growth[growing.pop(_pool(ev))]
                grown[1], grown[4] = round(size / MIB, 1), label
            allocated += size
            pool_alloc[_pool(ev)] += size
        elif action == "free_completed":
            entry = live.pop(ev["addr"], None)
            if entry is not None:
                allocated -= entry[0]
                pool_alloc[entry[1]] -= entry[0]
            else:
                unknown_frees += 1
        elif action in ("segment_alloc", "segment_map"):
            if marks is not None and _pool(ev) != "default" and not _pool(ev).startswith("stream0"):
                hole, free = _largest_hole(_pool(ev), live, seg_pool)
                growing[_pool(ev)] = len(growth)
                growth.append([round(ev["size"] / MIB, 1), None, round(hole / MIB, 1), round(free / MIB, 1), ""])
            seg_pool[ev["addr"]] = (ev["size"], _pool(ev))
            reserved += ev["size"]
        elif action in ("segment_free", "segment_unmap"):
            entry = seg_pool.pop(ev["addr"], None)
            reserved -= entry[0] if entry else ev["size"]  # an expandable segment unmaps other ranges than it mapped
        if marks is None:
            if reserved > best_res[0]:
                best_res = (reserved, index)
            if allocated > best_alloc[0]:
                best_alloc = (allocated, index)
            if since_us is not None and ev.get("time_us", 0) >= since_us:
                if reserved > best_steady[0]:
                    best_steady = (reserved, index)
                if action == "alloc":
                    pool = _pool(ev)
                    if pool_alloc[pool] > best_pool.get(pool, (-1, -1))[0]:
                        best_pool[pool] = (pool_alloc[pool], index)
        elif index in marks:
            out[marks[index]] = moment(ev.get("time_us"))
    if marks is None:
        return {"reserved_index": best_res[1], "allocated_index": best_alloc[1], "steady_index": best_steady[1],
                "unknown_frees": unknown_frees,
                "steady_pool_index": {pool: index for pool, (_, index) in best_pool.items()}}
    out["end"] = moment(events[-1].get("time_us") if events else None)
    out["growth"] = growth
    return out


def describe(trace: dict, sites: int = 8) -> str:
    """A few lines per moment of an :func:`analyze` result."""
    lines = [f"  trace: {trace.get('events')} events, complete={trace.get('complete')}"]
    keys = ["peak_reserved", "steady_peak_reserved", "peak_allocated",
            *sorted(k for k in trace if k.startswith("steady_peak_allocated ")), "end"]
    for key in keys:
        m = trace.get(key)
        if not m:
            continue
        where = (f" at step {m['step']} +{m['step_fraction']}, allocated before that step "
                 f"{m.get('allocated_before_step_by_pool_mib')}" if "step" in m else "")
        lines.append(f"  {key}: reserved {m['reserved_mib']} MiB {m['reserved_by_pool_mib']}, "
                     f"allocated {m['allocated_mib']} MiB {m['allocated_by_pool_mib']}, free in empty "
                     f"segments {m.get('free_in_empty_segments_mib')}, in used {m.get('free_in_used_segments_mib')}"
                     f"{where}")
        for site, mib in list(m["top_sites_mib"].items())[:sites]:
            lines.append(f"      {mib:>9.1f}  {site}  {m.get('top_site_sizes', {}).get(site, '')}")
        for pool, segs in m.get("segments_most_free_mib", {}).items():
            lines.append(f"      {pool}: {m['segments'][pool]} segments; most free [MiB, allocated]: {segs}")
    grew = [g for g in trace.get("growth", []) if g[1] is not None and g[1] > g[2]]
    if trace.get("growth"):
        lines.append(f"  graph pools grew by {len(trace['growth'])} segments; {len(grew)} of them for a request larger "
                     f"than the largest hole [segment, request, largest hole, free MiB, site]: {grew[:12]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m tools.diagnostics.memtrace RUN.txt ...``: summarise train_gpt --memory-trace output files."""
    import json
    import sys

    for path in (argv if argv is not None else sys.argv[1:]):
        with open(path) as f:
            lines = [line for line in f.read().splitlines() if line.startswith("{")]
        if not lines:
            print(f"{path}: no JSON line")
            continue
        record = json.loads(lines[-1])
        print(f"== {path}: tokens/s {record.get('tokens_per_s')}, peak {record.get('peak_mem_mib')} MiB, "
              f"steady {record.get('steady_peak_mem_mib')} MiB")
        for rank, r in enumerate(record.get("per_rank") or []):
            print(f" rank {rank}: peak {r['peak_mem_mib']} steady {r['steady_peak_mem_mib']} "
                  f"report {r.get('memory_report')}")
            if r.get("memory_trace"):
                print(describe(r["memory_trace"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
