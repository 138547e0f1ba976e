"""What each graph launch costs the host in a step graphed around a mixture of experts' dispatch,
against the graph's size.

Graphed around a host-reading dispatch (docs/moe.md), a Qwen3-MoE step's launches held the host
many times longer each (``graph launch`` in `moe-around-profile-<device>.json`) than one replay of
a small block's forward graph timed alone (``floor: graph replay`` in
`call-overhead-<device>.json`). The graphs differ in size: this measures, in one process on one GPU,

- the model of ``tools/bench_moe.py`` (``--model``, its launch-bound shape, bf16) graphed around
  the dispatch: every graph's nodes by type (read from the driver, the graphs kept for it) and the
  host time of each of its launches over ``--steps`` steps, forward graphs (launched from the
  caller's thread) and backward ones (autograd's) apart;
- graphs of tiny kernels (in-place adds) as large as the model's, each launched alone onto an idle
  GPU (``tools/bench_call_overhead.py``'s ``replay_host_us_by_kernels``);
- the model's own graphs again after the steps, the one of median size of each kind, each
  launched alone (``replayed_alone``): onto an idle GPU (a synchronisation before each launch),
  back to back (the GPU busy with the ones before), and onto an idle GPU after the host has
  streamed 64 MiB through its caches (``cold``, as after the step's own Python).

If launches cost about what same-sized graphs of tiny kernels cost alone, the in-step figure is
the graphs' size and not the step around them; if the model's graphs alone cost what they cost in
the step, it is those graphs (their node kinds, their parameters), not the step around them.

    python tools/diagnostics/launch_sizes.py            # -> benchmarks/results/moe-launch-sizes-<device>.json
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])
if REPO not in sys.path:
    sys.path.insert(0, REPO)

#: CUgraphNodeType values (cuda.h) by name
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
              7: "event_record", 10: "mem_alloc", 11: "mem_free"}


def node_counts(graph, cuda) -> dict:
    """``{type: count}`` of a kept ``torch.cuda.CUDAGraph``'s nodes, read through ``cuda`` (the
    driver library, ``ctypes.CDLL("libcuda.so.1")``)."""
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    n = ctypes.c_size_t(0)
    if cuda.cuGraphGetNodes(handle, None, ctypes.byref(n)) != 0:
        return {"error": "cuGraphGetNodes failed"}
    nodes = (ctypes.c_void_p * n.value)()
    cuda.cuGraphGetNodes(handle, nodes, ctypes.byref(n))
    kinds = Counter()
    for node in nodes:
        t = ctypes.c_int(-1)
        cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t))
        kinds[NODE_TYPES.get(t.value, str(t.value))] += 1
    return dict(kinds)


def replayed_alone(graph, torch, launches: int = 20) -> dict:
    """Host µs (medians) of launching the kept model graph ``graph`` onto an idle GPU, back to
    back, and onto an idle GPU after streaming 64 MiB through the host's caches. Its outputs
    are overwritten: only for the end of a run."""
    import numpy as np

    from tools.bench_call_overhead import idle_launch_us

    scratch = np.ones(64 << 18, dtype=np.float32)  # 64 MiB
    idle = idle_launch_us(graph, torch, launches)
    cold = idle_launch_us(graph, torch, launches, before=lambda: np.add(scratch, 1.0, out=scratch))
    t0 = time.perf_counter()
    for _ in range(launches):
        graph.replay()
    queued = (time.perf_counter() - t0) / launches * 1e6
    torch.cuda.synchronize()
    return {"idle_us": round(statistics.median(idle), 2), "back_to_back_us": round(queued, 2),
            "cold_us": round(statistics.median(cold), 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3_moe")
    p.add_argument("--steps", type=int, default=5, help="timed steps after warmup and capture")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)

    import torch

    from paddle_graphpp.torch.runtime import TorchRuntime
    from tools import bench_moe, benchlib
    from tools.bench_call_overhead import _replay_by_kernels

    graphs = []

    def kept_graph(self):  # the driver's graph kept after instantiation, to count its nodes
        g = torch.cuda.CUDAGraph(keep_graph=True)
        graphs.append(g)
        return g

    launches: dict = defaultdict(list)  # id(graph) -> host seconds of each launch
    threads: dict = {}
    timing = [False]

    def timed_replay(self, graph):
        t0 = time.perf_counter()
        graph.replay()
        if timing[0]:
            launches[id(graph)].append(time.perf_counter() - t0)
            threads[id(graph)] = threading.get_ident()

    TorchRuntime.create_graph = kept_graph
    TorchRuntime.replay_graph = timed_replay

    margs = bench_moe.parse_args([])
    model = bench_moe.build(args.model, "eager", launch_bound=True)
    bench_moe.graph(model, "layers")
    step = bench_moe.trainer(model)
    data = bench_moe.batches(margs, model.config.vocab_size, 1, seed=1)[0]
    for _ in range(4):  # warm up, record, capture, first replays
        step(data)
    torch.cuda.synchronize()
    timing[0] = True
    for _ in range(args.steps):
        step(data)
    torch.cuda.synchronize()
    timing[0] = False

    main_thread = threading.get_ident()
    cuda = ctypes.CDLL("libcuda.so.1")
    rows = {"forward": [], "backward": []}
    for g in graphs:
        if id(g) not in launches:
            continue
        kind = "forward" if threads[id(g)] == main_thread else "backward"
        rows[kind].append({"nodes": node_counts(g, cuda), "launch_us": [t * 1e6 for t in launches[id(g)]],
                           "graph": g})
    summary = {}
    for kind, rs in rows.items():
        if not rs:
            continue
        kernels = [r["nodes"].get("kernel", 0) for r in rs]
        us = [t for r in rs for t in r["launch_us"]]
        deciles = statistics.quantiles(us, n=10)
        summary[kind] = {"graphs": len(rs), "kernel_nodes_median": statistics.median(kernels),
                         "kernel_nodes_range": [min(kernels), max(kernels)],
                         "nodes_by_type": dict(sum((Counter(r["nodes"]) for r in rs), Counter())),
                         "launches": len(us), "launch_us_median": round(statistics.median(us), 2),
                         "launch_us_p10_p90": [round(deciles[0], 2), round(deciles[-1], 2)]}
        middle = sorted(rs, key=lambda r: r["nodes"].get("kernel", 0))[len(rs) // 2]
        summary[kind]["replayed_alone"] = {"kernel_nodes": middle["nodes"].get("kernel", 0),
                                           "in_step_us_median": round(statistics.median(middle["launch_us"]), 2),
                                           **replayed_alone(middle["graph"], torch)}
    sizes = sorted({int(s["kernel_nodes_median"]) for s in summary.values()} | {12, 48, 192})
    alone = _replay_by_kernels(torch, sizes=tuple(sizes))
    result = {"benchmark": "moe_launch_sizes", **benchlib.environment(), "model": args.model,
              "shape": "tools/bench_moe.py's launch-bound shape, bf16, graphed around the dispatch",
              "steps": args.steps, "in_step": summary, "alone_replay_host_us_by_kernels": alone,
              "note": "in_step: host µs of each launch in the timed steps (torch.cuda.CUDAGraph.replay, "
                      "perf_counter around it), per graph kind; nodes read with cuGraphGetNodes. alone: "
                      "one graph of that many in-place adds, launched onto an idle GPU. replayed_alone: the model's "
                      "graph of median size per kind after the steps, launched alone (idle GPU, back to "
                      "back, idle GPU after 64 MiB streamed through the host's caches)."}
    print(f"{'graphs':10} {'count':>5} {'kernels':>9} {'launch us (median)':>19}")
    for kind, s in summary.items():
        print(f"{kind:10} {s['graphs']:5} {s['kernel_nodes_median']:9} {s['launch_us_median']:19}")
    print("alone, by kernels:", {k: v["median_us"] for k, v in alone.items()})
    for kind, s in summary.items():
        print(f"{kind} graph of median size, replayed alone:", s["replayed_alone"])
    if not args.no_write:
        print("wrote", benchlib.write_result("moe-launch-sizes", result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
