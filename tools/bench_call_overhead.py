"""Host time per graphed call: what a graphed layer's forward and backward cost the CPU.

A launch-bound step (small layers, or a model whose eager code between graphs waits on the GPU,
as a mixture of experts' host-reading dispatch does) runs as fast as the host issues it. This
measures, on one GPU, the host microseconds per call of a stack of small blocks that read three
tensors (a hidden state and two position tensors, as a decoder's attention does) and return two:

- ``eager``: the blocks as they are;
- ``ours``: the blocks graphed in place by ``graph_layers`` (one micro-batch per step);
- ``torch_graphed``: ``torch.cuda.make_graphed_callables`` over the same blocks;

and the floors under any graphed call, each alone: a ``CUDAGraph.replay()`` of one block's
forward, the copy of three inputs into static buffers (one ``torch._foreach_copy_``), and one
alias of an output with a storage of its own (what hands an output out watched). Beside them, a
replay's host cost as the graph grows: graphs of 12 to 768 tiny kernels, each launched alone onto
an idle GPU (``replay_host_us_by_kernels``).

Host time is read with ``time.perf_counter`` around the calls, without a synchronisation inside:
the blocks are small enough that the GPU keeps up (the script checks: ``gpu_bound`` in the
record is the share of iterations whose synchronisation after the timed calls waited long).
Variants alternate in rounds; medians over rounds and the spread (slowest round over fastest).

``--compare DIR`` first measures another checkout (``git worktree add DIR <commit>``) the same
way, in a process of its own, and keeps its table in the record (``--code DIR`` alone measures
that checkout). ``ours_profile_us_per_call``: cProfile's view of the graphed calls. The record:
``benchmarks/results/call-overhead-<device>.json``.

    python tools/bench_call_overhead.py
    python tools/bench_call_overhead.py --compare /tmp/before
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=16, help="blocks in the stack (default 16)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256, help="tokens per micro-batch (default 256)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=20, help="steps per round (default 20)")
    p.add_argument("--code", default=None, help="import paddle_graphpp from this directory")
    p.add_argument("--compare", default=None, metavar="DIR",
                   help="first measure the checkout DIR the same way (in its own process), and keep its table beside")
    p.add_argument("--name", default="call-overhead")
    p.add_argument("--no-write", action="store_true", help="print the JSON only")
    return p.parse_args(argv)


def _block_class(nn, torch):
    class Block(nn.Module):
        """Three inputs (one carrying a gradient), two outputs; a dozen kernels forward."""

        def __init__(self, hidden):
            super().__init__()
            self.norm = nn.LayerNorm(hidden)
            self.q = nn.Linear(hidden, hidden)
            self.o = nn.Linear(hidden, hidden)

        def forward(self, x, cos, sin):
            h = self.q(self.norm(x))
            h = torch.softmax(h * cos + h.flip(-1) * sin, dim=-1)
            return self.o(h) + x, h

    return Block


def _host_timed(step, iters):
    """Host seconds per iteration of ``step() -> (forward_s, backward_s)``, and how long the
    synchronisation after the iterations waited (the GPU behind the host)."""
    import torch

    fwd = bwd = 0.0
    torch.cuda.synchronize()
    for _ in range(iters):
        f, b = step()
        fwd += f
        bwd += b
    t = time.perf_counter()
    torch.cuda.synchronize()
    return fwd / iters, bwd / iters, time.perf_counter() - t


def _compared(args) -> dict:
    """The same measurement of the checkout ``args.compare``, run first in a process of its own."""
    import subprocess

    cmd = [sys.executable, str(Path(__file__).resolve()), "--code", args.compare, "--no-write",
           "--blocks", str(args.blocks), "--hidden", str(args.hidden), "--tokens", str(args.tokens),
           "--rounds", str(args.rounds), "--iters", str(args.iters)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:  # say why, not only that it failed
        raise SystemExit(f"bench_call_overhead: measuring {args.compare} failed (exit {done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    text = done.stdout  # the record's JSON first, then the printed table
    other, _ = json.JSONDecoder().raw_decode(text[text.index("{"):])
    version = subprocess.run(["git", "rev-parse", "HEAD"], cwd=args.compare, capture_output=True, text=True).stdout.strip()
    return {"code": args.compare, "code_version": version or None, "measured": "before this record's rounds, "
            "in its own process on the same machine", "host_us_per_call": other["host_us_per_call"],
            "ours_fwd_plus_bwd_us": other["ours_fwd_plus_bwd_us"]}


def _profile(step, steps, n, function_rows, top=25):
    """cProfile over ``steps`` steps of ``step``: the functions with the most self time, in host
    microseconds per block call (cProfile slows Python-heavy code: read the shares, not the sums)."""
    import cProfile

    import torch

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    calls = steps * n
    return [{"function": f, "calls_per_call": round(c / calls, 2), "self_us": round(tt / calls * 1e6, 2)}
            for f, c, tt, _total in sorted(function_rows(prof), key=lambda r: -r[2])[:top]]


def idle_launch_us(graph, torch, reps: int, *, before=None, warmup: int = 3) -> list:
    """Host microseconds of each of ``reps`` ``graph.replay()`` calls (after ``warmup`` untimed
    ones), each onto an idle GPU (synchronised before it, outside the timing), as after a host
    sync in a model's own code; ``before()``, if given, runs after each synchronisation, untimed."""
    times = []
    for i in range(reps + warmup):
        torch.cuda.synchronize()
        if before is not None:
            before()
        t0 = time.perf_counter()
        graph.replay()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return times


def _replay_by_kernels(torch, sizes=(12, 48, 192, 768), reps=31) -> dict:
    """Host microseconds per ``CUDAGraph.replay()`` of a graph of ``n`` tiny kernels (in-place adds
    on 1,024 floats), for each ``n`` of ``sizes``: the median of ``reps`` launches, each onto an
    idle GPU (:func:`idle_launch_us`). What a launch costs the host as the graph grows."""
    out = {}
    x = torch.zeros(1024, device="cuda")
    for n in sizes:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                x.add_(1.0)
        times = idle_launch_us(graph, torch, reps)
        out[str(n)] = {"median_us": round(statistics.median(times), 2), "min_us": round(min(times), 2)}
        del graph
    return out


def main(argv=None) -> int:
    args = _args(argv)
    sys.path.insert(0, str(ROOT))
    from tools import benchlib  # this checkout's tools, imported before --code puts another checkout first
    from tools.diagnostics.host_time import function_rows

    if args.code:
        sys.path.insert(0, str(Path(args.code).resolve()))
    import torch
    from torch import nn

    import paddle_graphpp
    from paddle_graphpp.torch import graph_layers

    if not torch.cuda.is_available():
        print("bench_call_overhead: needs a CUDA GPU", file=sys.stderr)
        return 2
    compared = _compared(args) if args.compare else None
    torch.manual_seed(0)
    dev = torch.device("cuda")
    Block = _block_class(nn, torch)
    n, d, t = args.blocks, args.hidden, args.tokens

    def stack():
        torch.manual_seed(0)
        return nn.ModuleList(Block(d) for _ in range(n)).to(dev)

    x0 = torch.randn(t, d, device=dev)
    cos, sin = torch.randn(t, d, device=dev), torch.randn(t, d, device=dev)

    def runner(blocks):
        def step():
            x = x0.detach().requires_grad_(True)
            t0 = time.perf_counter()
            h = x
            for b in blocks:
                h, _ = b(h, cos, sin)
            t1 = time.perf_counter()
            h.backward(torch.ones_like(h))
            t2 = time.perf_counter()
            return t1 - t0, t2 - t1
        return step

    eager, ours, peer = stack(), stack(), stack()
    graph_layers(ours, num_warmup_steps=1)
    sample = tuple((x0.detach().requires_grad_(True), cos, sin) for _ in range(n))
    peer_calls = torch.cuda.make_graphed_callables(tuple(peer), sample)
    variants = {"eager": runner(eager), "ours": runner(ours), "torch_graphed": runner(peer_calls)}

    # floors: one block's forward graph replayed alone; the input copy; one watched alias
    floor_block = Block(d).to(dev)
    static = [x0.clone().requires_grad_(False), cos.clone(), sin.clone()]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            floor_block(*static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        floor_block(*static)
    srcs = [x0, cos, sin]
    from torch.utils.dlpack import from_dlpack, to_dlpack

    def floor(fn, reps=16):
        def step():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t0) / reps * n, 0.0  # per stack of n calls, as the variants
        return step

    with torch.no_grad():
        floors = {
            "floor: graph replay": floor(graph.replay),
            "floor: copy 3 inputs": floor(lambda: torch._foreach_copy_(static, srcs)),
            "floor: own-storage alias": floor(lambda: from_dlpack(to_dlpack(static[0].detach()))),
        }
    variants.update(floors)

    for fn in variants.values():  # warmup (ours captures here)
        for _ in range(4):
            fn()
    per = {k: {"fwd": [], "bwd": [], "waits": []} for k in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            f, b, wait = _host_timed(variants[name], args.iters)
            per[name]["fwd"].append(f / n * 1e6)
            per[name]["bwd"].append(b / n * 1e6)
            per[name]["waits"].append(wait * 1e6 / args.iters)

    profile = _profile(variants["ours"], args.iters * 2, n, function_rows)
    by_kernels = _replay_by_kernels(torch)

    def summary(xs):
        return {"median_us": round(statistics.median(xs), 2), "spread": round(max(xs) / min(xs), 3) if min(xs) else None}

    table = {}
    for name, v in per.items():
        row = {"forward": summary(v["fwd"])}
        if not name.startswith("floor"):
            row["backward"] = summary(v["bwd"])
            row["sync_wait_us_per_step"] = round(statistics.median(v["waits"]), 1)
        table[name] = row
    ours_fb = table["ours"]["forward"]["median_us"] + table["ours"]["backward"]["median_us"]
    peer_fb = table["torch_graphed"]["forward"]["median_us"] + table["torch_graphed"]["backward"]["median_us"]
    eager_fb = table["eager"]["forward"]["median_us"] + table["eager"]["backward"]["median_us"]
    result = {
        "benchmark": "call_overhead",
        **benchlib.environment(),
        "paddle_graphpp": str(Path(paddle_graphpp.__file__).resolve().parent),
        "config": {"blocks": n, "hidden": d, "tokens": t, "rounds": args.rounds, "iters": args.iters,
                   "block": "LayerNorm, Linear, rotate-like mix of 2 position tensors, softmax, Linear, residual; "
                            "3 inputs (1 with grad), 2 outputs; fp32"},
        "host_us_per_call": table,
        "ours_fwd_plus_bwd_us": round(ours_fb, 2),
        "ours_vs_torch_graphed": round(ours_fb / peer_fb, 3),
        "ours_vs_eager": round(ours_fb / eager_fb, 3),
        "ours_profile_us_per_call": profile,
        "replay_host_us_by_kernels": by_kernels,
        **({"compared": compared} if compared else {}),
        "note": "host microseconds per block call (forward) and per block in the backward; the floors are "
                "one operation each, per call. replay_host_us_by_kernels: one replay of a graph of that many tiny "
                "kernels, alone, onto an idle GPU. sync_wait_us_per_step: how long the synchronisation after "
                "a round's steps waited, per step (near zero: the host, not the GPU, set the pace).",
    }
    text = json.dumps(result, indent=2) + "\n"
    if args.no_write:
        print(text)
    else:
        path = benchlib.write_result(args.name, result)
        print(text)
        print(f"wrote {path}")
    print("replay host us by kernels in the graph:", {k: v["median_us"] for k, v in by_kernels.items()})
    print(f"{'variant':26} {'fwd us':>9} {'bwd us':>9}")
    for name, row in table.items():
        print(f"{name:26} {row['forward']['median_us']:9.1f} {row.get('backward', {}).get('median_us', 0):9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
