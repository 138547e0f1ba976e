"""Graph memory by mode on one GPU: eager, per_graph, shared, the async allocator.

    python tools/bench_memory.py                 # all modes; ~2-3 min on an H100/H200
    python tools/bench_memory.py --plot-only benchmarks/results/memory-h200.json   # re-plot (CPU is fine)
    python tools/bench_memory.py --smoke --out /tmp/memory-smoke.json   # tiny run, checks the script on CPU

Workload (the issue's): one pipeline stage of a GPT, hidden 2048, 8 layers in 2 virtual chunks
of 4 (each chunk one ``CUDAGraphedModule``), micro-batch 2 x 1024 tokens, bf16, 8 micro-batches
in flight per chunk, so 16 slots. Each step runs the interleaved order of a stage whose warmup
covers every micro-batch (groups of 4, as with pp=4):

    F c0 mb1-4, F c1 mb1-4, F c0 mb5-8, F c1 mb5-8, B c1 mb1-4, B c0 mb1-4, B c1 mb5-8, B c0 mb5-8

The chunks are joined as pipeline chunks are: chunk 1 gets chunk 0's output detached, and its
input gradient is handed back to chunk 0's backward later, as a receive would.

Every mode runs in its own subprocess (the allocator backend is process-global); the async
mode's process gets ``backend:cudaMallocAsync`` in ``PYTORCH_CUDA_ALLOC_CONF`` before torch is
imported, and the others have any ``backend:`` option removed. Per mode:

  peak_reserved_incl_capture_mib  peak reserved from the model's creation to the end of the
                                  capture step (step 1 eager warmup, step 2 capture)
  peak_reserved_steady_mib        after one replay step, ``torch.cuda.empty_cache()``, peaks
                                  reset: the peak over the timed steps (what the mode keeps)
  step.median_ms                  one whole step (16 forwards + 16 backwards), CUDA events,
                                  median over rounds (tools/benchlib.time_rounds)

"Reserved" is PyTorch's reserved memory plus the driver's graph memory (reserved high
watermark, ``cuDeviceGetGraphMemAttribute``): with ``cudaMallocAsync`` the graphs' allocations
live there and PyTorch's counters do not see them. For the other modes the graph memory is 0.
``device_used_*_mib`` (cudaMemGetInfo, minus the figure before the model was built) is the
cross-check that sees everything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)
from paddle_graphpp.core.driver_memory import GraphMemory  # noqa: E402
from testing import launch  # noqa: E402
from tools import benchlib  # noqa: E402

MODES = ("eager", "per_graph", "shared", "async")
GRAPHED = ("per_graph", "shared", "async")
ENGINE_MODE = {"per_graph": "per_graph", "shared": "shared", "async": "shared"}
LABEL = {"eager": "eager", "per_graph": "per_graph", "shared": "shared", "async": "async alloc"}
RESULT_TAG = "BENCH_MEMORY_RESULT "
MIB = 2 ** 20


@dataclass(kw_only=True)
class Config:
    """The workload; the defaults are the issue's."""

    hidden: int = 2048
    heads: int = 16
    layers: int = 8
    chunks: int = 2
    micro_batch: int = 2
    seq: int = 1024
    in_flight: int = 8
    """Micro-batches in flight per chunk (and micro-batches per step)."""
    group: int = 4
    """Forwards per chunk before switching chunk (the pipeline size of the interleaved order)."""
    dtype: str = "bfloat16"
    rounds: int = 10
    """Timed steps (one step per round)."""

    def validate(self) -> None:
        checks = [
            (self.hidden % self.heads == 0, "hidden must be a multiple of heads"),
            (self.layers % self.chunks == 0, "layers must be a multiple of chunks"),
            (self.in_flight % self.group == 0, "in_flight must be a multiple of group"),
            (min(self.hidden, self.heads, self.layers, self.chunks, self.micro_batch, self.seq,
                 self.in_flight, self.group, self.rounds) >= 1, "every size must be >= 1"),
            (self.dtype in ("bfloat16", "float16", "float32"), "dtype must be bfloat16, float16 or float32"),
        ]
        for ok, why in checks:
            if not ok:
                raise SystemExit(f"bench_memory: bad config {asdict(self)}: {why}")


SMOKE = Config(hidden=64, heads=4, layers=4, chunks=2, micro_batch=2, seq=32, in_flight=4, group=2,
               dtype="float32", rounds=3)


def schedule(cfg: Config) -> list:
    """[("F"|"B", chunk, micro_batch)] for one step; see the module docstring."""
    groups = [list(range(g, g + cfg.group)) for g in range(0, cfg.in_flight, cfg.group)]
    order = [("F", c, mb) for grp in groups for c in range(cfg.chunks) for mb in grp]
    order += [("B", c, mb) for grp in groups for c in reversed(range(cfg.chunks)) for mb in grp]
    return order


def describe_schedule(cfg: Config) -> str:
    parts, order = [], schedule(cfg)
    for i in range(0, len(order), cfg.group):
        kind, c, mb = order[i]
        parts.append(f"{kind} c{c} mb{mb + 1}-{mb + cfg.group}")
    return ", ".join(parts)


# ----------------------------------------------------------------------------- device side
def build_chunk(cfg: Config, n_layers: int):
    """``n_layers`` blocks of the trainer's GPT (testing/gpt_torch.py): SDPA attention, no dropout."""
    import torch

    from testing.gpt_torch import Block, GPTShape

    shape = GPTShape(hidden=cfg.hidden, heads=cfg.heads, vocab=1, seq_len=cfg.seq, layers=cfg.layers,
                     attention="sdpa")
    return torch.nn.Sequential(*[Block(shape) for _ in range(n_layers)])


def child(mode: str, cfg: Config) -> dict:
    """One mode in this process; returns its figures."""
    if mode == "async":  # before torch is imported, through the library's own switch
        import paddle_graphpp

        switched = paddle_graphpp.use_cuda_malloc_async_allocator(frameworks=["torch"])
    import torch

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    out = {"mode": mode, "engine_memory": ENGINE_MODE.get(mode), "cuda": cuda,
           "alloc_conf": {v: os.environ.get(v) for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}}
    if mode == "async":
        out["switch"] = switched
    if cuda:
        torch.cuda.set_device(dev)
        backend = torch.cuda.get_allocator_backend()
        out["allocator_backend"] = backend
        want = "cudaMallocAsync" if mode == "async" else "native"
        if backend != want:
            raise RuntimeError(f"mode {mode}: torch allocator backend is {backend!r}, expected {want!r}")
        from paddle_graphpp.allocator import async_allocator_active

        out["async_allocator_active"] = async_allocator_active("torch")
    gm = GraphMemory(0) if cuda else None
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = getattr(torch, cfg.dtype)

    def used_mib():
        if not cuda:
            return 0.0
        free, total = torch.cuda.mem_get_info()
        return (total - free) / MIB

    def peaks():
        if not cuda:
            return {"torch_reserved_mib": 0.0, "torch_allocated_mib": 0.0, "graph_mem_reserved_mib": None,
                    "graph_mem_used_mib": None, "peak_reserved_mib": 0.0, "device_used_mib": 0.0}
        g_res, g_used = gm.get(GraphMemory.RESERVED_HIGH), gm.get(GraphMemory.USED_HIGH)
        t_res = torch.cuda.max_memory_reserved() / MIB
        t_alloc = torch.cuda.max_memory_allocated() / MIB
        return {"torch_reserved_mib": t_res, "torch_allocated_mib": t_alloc,
                "graph_mem_reserved_mib": None if g_res is None else g_res / MIB,
                "graph_mem_used_mib": None if g_used is None else g_used / MIB,
                "peak_reserved_mib": t_res + (g_res or 0) / MIB,
                "device_used_mib": used_mib() - baseline}

    def reset_peaks():
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            gm.reset_high()

    # Build
    torch.manual_seed(0)
    sync()
    baseline = used_mib()
    per_chunk = cfg.layers // cfg.chunks
    with dev:  # initialise the parameters on the device: 400M parameters are slow to initialise on a CPU
        chunks = [build_chunk(cfg, per_chunk).to(dtype) for _ in range(cfg.chunks)]
    if mode != "eager":
        from paddle_graphpp.torch import CUDAGraphedModule

        # capture starts at the first step boundary after in_flight eager forwards: step 2
        chunks = [CUDAGraphedModule(ch, num_warmup_steps=cfg.in_flight, memory=ENGINE_MODE[mode],
                                    name=f"chunk{c}") for c, ch in enumerate(chunks)]
    shape = (cfg.micro_batch, cfg.seq, cfg.hidden)
    xs = [torch.randn(shape, device=dev, dtype=dtype, requires_grad=True) for _ in range(cfg.in_flight)]
    dy = torch.randn(shape, device=dev, dtype=dtype) * 1e-2
    order = schedule(cfg)
    last = cfg.chunks - 1

    def step():
        acts, grads = {}, {}
        for x in xs:
            x.grad = None
        for kind, c, mb in order:
            if kind == "F":
                inp = xs[mb] if c == 0 else acts[(c - 1, mb)][1].detach().requires_grad_(True)
                acts[(c, mb)] = (inp, chunks[c](inp))
            else:
                inp, y = acts.pop((c, mb))
                torch.autograd.backward(y, dy if c == last else grads.pop((c + 1, mb)))
                if c > 0:
                    grads[(c, mb)] = inp.grad

    # Warmup (step 1, eager everywhere) and capture (step 2)
    sync()
    reset_peaks()
    t0 = time.perf_counter()
    step()
    sync()
    t1 = time.perf_counter()
    step()
    sync()
    t2 = time.perf_counter()
    out["incl_capture"] = peaks()
    out["warmup_step_s"], out["capture_step_s"] = t1 - t0, t2 - t1
    step()  # first replay step
    sync()

    # Steady state
    if cuda:
        torch.cuda.empty_cache()
        gm.trim()
    reset_peaks()
    if cuda:
        timing = benchlib.time_rounds({mode: step}, iters=1, rounds=cfg.rounds)[mode]
        out["timer"] = "cuda events (benchlib.time_rounds)"
    else:
        ts = []
        for _ in range(cfg.rounds):
            s = time.perf_counter()
            step()
            ts.append((time.perf_counter() - s) * 1e3)
        ts.sort()
        timing = {"median_ms": ts[len(ts) // 2], "min_ms": ts[0], "max_ms": ts[-1], "spread": ts[-1] / ts[0],
                  "rounds": len(ts), "iters_per_round": 1}
        out["timer"] = "perf_counter (no CUDA: smoke run)"
    sync()
    out["steady"] = peaks()
    out["step"] = timing
    if mode != "eager":
        out["graphs"] = sum(ch.engine.graph_count() for ch in chunks)
        out["replays"] = sum(ch.engine.replays for ch in chunks)
        out["captures"] = sum(ch.engine.captures for ch in chunks)
        if cuda and out["replays"] == 0:
            raise RuntimeError(f"mode {mode}: graphs were never replayed (captures: {out['captures']})")
        try:
            import paddle_graphpp

            out["memory_report"] = paddle_graphpp.memory_report()
        except Exception as exc:  # noqa: BLE001 - recorded, e.g. memory_snapshot under cudaMallocAsync
            out["memory_report"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    out["params_mib"] = sum(p.numel() * p.element_size() for ch in chunks for p in ch.parameters()) / MIB
    return out


# ----------------------------------------------------------------------------- parent side
def child_env(mode: str) -> dict:
    """The parent's environment, with the allocator backend chosen for ``mode`` and nothing else changed."""
    from paddle_graphpp.allocator import ENV_FLAG
    from paddle_graphpp.torch.memory.allocator import merge_async_backend, parse_alloc_conf

    env = dict(os.environ)
    env.pop(ENV_FLAG, None)
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if var in env:
            kept = ",".join(f"{k}:{v}" for k, v in parse_alloc_conf(env[var]) if k != "backend")
            if kept:
                env[var] = kept
            else:
                del env[var]
    if mode == "async":
        env["PYTORCH_CUDA_ALLOC_CONF"] = merge_async_backend(env.get("PYTORCH_CUDA_ALLOC_CONF"))
        if "PYTORCH_ALLOC_CONF" in env:
            env["PYTORCH_ALLOC_CONF"] = merge_async_backend(env["PYTORCH_ALLOC_CONF"], "PYTORCH_ALLOC_CONF")
    env["NCCL_NVLS_ENABLE"] = "0"
    env["PYTHONPATH"] = str(benchlib.ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_child(mode: str, cfg: Config, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--config", json.dumps(asdict(cfg))]
    end = launch.run(cmd, env=child_env(mode), cwd=benchlib.ROOT, timeout=timeout)
    if end.timed_out:
        return {"mode": mode, "error": f"timed out after {timeout:.0f} s", "stderr_tail": end.stderr[-2000:]}
    wall = end.seconds
    lines = [ln for ln in end.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if end.returncode != 0 or not lines:
        return {"mode": mode, "error": f"exit code {end.returncode}", "stderr_tail": end.stderr[-3000:],
                "wall_s": wall}
    result = json.loads(lines[-1][len(RESULT_TAG):])
    result["wall_s"] = wall
    warn = [ln for ln in end.stderr.splitlines() if "Warning" in ln or "warn" in ln.lower()]
    if warn:
        result["stderr_warnings"] = sorted(set(warn))[:10]
    return result


def summarize(modes: dict) -> dict:
    """Ratios against eager and the issue's targets (``None`` where a figure is missing)."""
    def fig(mode, phase="steady"):
        r = modes.get(mode, {})
        return r.get(phase, {}).get("peak_reserved_mib") if "error" not in r else None

    def step(mode):
        r = modes.get(mode, {})
        return r.get("step", {}).get("median_ms") if "error" not in r else None

    eager, eager_cap = fig("eager"), fig("eager", "incl_capture")
    ratios = {}
    for m in MODES:
        s, c = fig(m), fig(m, "incl_capture")
        ratios[m] = {"steady_vs_eager": s / eager if s and eager else None,
                     "incl_capture_vs_eager_incl_capture": c / eager_cap if c and eager_cap else None}
    graphed = {m: step(m) for m in GRAPHED if step(m)}
    best = min(graphed.values()) if graphed else None
    for m in GRAPHED:
        ratios[m]["step_vs_best_graphed"] = graphed[m] / best if m in graphed and best else None
    ratios["eager"]["step_vs_best_graphed"] = step("eager") / best if step("eager") and best else None

    def target(value, limit):
        return None if value is None else value <= limit

    targets = {
        "shared_steady<=1.3x_eager": target(ratios["shared"]["steady_vs_eager"], 1.3),
        "async_steady<=1.3x_eager": target(ratios["async"]["steady_vs_eager"], 1.3),
        **{f"{m}_step<=1.05x_best_graphed": target(ratios[m]["step_vs_best_graphed"], 1.05) for m in GRAPHED},
    }
    return {"ratios": ratios, "targets": targets,
            "best_graphed_mode": min(graphed, key=graphed.get) if graphed else None}


def print_table(payload: dict) -> None:
    modes, ratios = payload["modes"], payload["summary"]["ratios"]
    head = f"{'mode':<14}{'steady MiB':>12}{'incl-capt MiB':>15}{'x eager':>9}{'step ms':>10}{'x best':>8}{'graphs':>8}"
    print("\n" + head + "\n" + "-" * len(head))
    for m in MODES:
        r = modes.get(m)
        if r is None:
            continue
        if "error" in r:
            print(f"{LABEL[m]:<14}  FAILED: {r['error']}")
            continue
        x = ratios[m]["steady_vs_eager"]
        b = ratios[m]["step_vs_best_graphed"]
        print(f"{LABEL[m]:<14}{r['steady']['peak_reserved_mib']:>12.0f}{r['incl_capture']['peak_reserved_mib']:>15.0f}"
              f"{(f'{x:.2f}' if x else '-'):>9}{r['step']['median_ms']:>10.2f}{(f'{b:.3f}' if b else '-'):>8}"
              f"{r.get('graphs', '-'):>8}")
    print("targets:", json.dumps(payload["summary"]["targets"]))


def plot(payload: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if m in payload["modes"]]
    ok = [m for m in modes if "error" not in payload["modes"][m]]
    gib = lambda m, phase: payload["modes"][m][phase]["peak_reserved_mib"] / 1024 if m in ok else 0.0  # noqa: E731
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    xs = range(len(modes))
    w = 0.38
    b1 = ax1.bar([x - w / 2 for x in xs], [gib(m, "steady") for m in modes], w, label="steady state", color="#4C72B0")
    b2 = ax1.bar([x + w / 2 for x in xs], [gib(m, "incl_capture") for m in modes], w,
                 label="incl. warmup + capture step", color="#DD8452")
    ax1.bar_label(b1, fmt="%.1f", fontsize=8)
    ax1.bar_label(b2, fmt="%.1f", fontsize=8)
    if "eager" in ok:
        ax1.axhline(1.3 * gib("eager", "steady"), ls="--", color="gray", lw=1, label="1.3 x eager (steady)")
    ax1.set_xticks(list(xs), [LABEL[m] + ("" if m in ok else "\n(failed)") for m in modes])
    ax1.set_ylabel("peak reserved memory (GiB)")
    ax1.set_title("Peak reserved memory per mode")
    ax1.legend(fontsize=8, loc="upper left")
    steps = [payload["modes"][m]["step"]["median_ms"] if m in ok else 0.0 for m in modes]
    b3 = ax2.bar(list(xs), steps, 0.6, color=["#8C8C8C" if m == "eager" else "#55A868" for m in modes])
    ax2.bar_label(b3, fmt="%.1f", fontsize=8)
    best = [payload["modes"][m]["step"]["median_ms"] for m in ok if m in GRAPHED]
    if best:
        ax2.axhline(1.05 * min(best), ls="--", color="gray", lw=1, label="1.05 x best graphed")
        ax2.legend(fontsize=8, loc="lower right")
    ax2.set_xticks(list(xs), [LABEL[m] + ("" if m in ok else " (failed)") for m in modes], rotation=20)
    ax2.set_ylabel("step time (ms, median)")
    cfg = payload.get("config", {})
    n = cfg.get("in_flight", 0) * cfg.get("chunks", 0)
    ax2.set_title(f"Step time ({n} fwd + {n} bwd)")
    fig.suptitle(f"{payload.get('device', '?')}: GPT stage h{cfg.get('hidden')} x {cfg.get('layers')} layers, "
                 f"{cfg.get('chunks')} chunks, mb {cfg.get('micro_batch')}x{cfg.get('seq')}, {cfg.get('dtype')}, "
                 f"{cfg.get('in_flight')} in flight per chunk", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="modes to run")
    ap.add_argument("--rounds", type=int, default=None, help="timed steps per mode (default 10)")
    ap.add_argument("--budget-s", type=float, default=285.0, help="wall-clock budget of the whole run")
    ap.add_argument("--child-timeout-s", type=float, default=150.0, help="limit per mode subprocess")
    ap.add_argument("--smoke", action="store_true", help="tiny config; checks the script (runs on CPU)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default benchmarks/results/memory-<device>.json); the PNG goes beside it")
    ap.add_argument("--plot-only", type=Path, metavar="FROM_JSON", help="re-plot a results JSON and exit")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        result = child(args.child, Config(**json.loads(args.config)))
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0
    if args.plot_only:
        payload = json.loads(args.plot_only.read_text())
        payload["summary"] = summarize(payload["modes"])  # recomputed: the table follows the figures
        print(f"wrote {plot(payload, args.plot_only.with_suffix('.png'))}")
        print_table(payload)
        return 0

    cfg = SMOKE if args.smoke else Config()
    if args.rounds is not None:
        cfg.rounds = args.rounds
    cfg.validate()
    if args.budget_s <= 0 or args.child_timeout_s <= 0:
        raise SystemExit("bench_memory: --budget-s and --child-timeout-s must be > 0")
    started = time.perf_counter()
    modes = {}
    for mode in args.modes:
        left = args.budget_s - (time.perf_counter() - started)
        if left < 20:
            modes[mode] = {"mode": mode, "error": f"skipped: {args.budget_s:.0f} s budget used up"}
            print(f"[bench_memory] {mode}: skipped (budget)", flush=True)
            continue
        print(f"[bench_memory] {mode} ...", flush=True)
        modes[mode] = run_child(mode, cfg, min(args.child_timeout_s, left))
        r = modes[mode]
        print(f"[bench_memory] {mode}: " + (f"FAILED ({r['error']})\n{r.get('stderr_tail', '')[-1500:]}"
                                            if "error" in r else f"done in {r['wall_s']:.0f} s"), flush=True)

    payload = {"name": "memory", "command": benchlib.command(), **benchlib.environment(),
               "config": asdict(cfg), "schedule": describe_schedule(cfg),
               "slots": cfg.in_flight * cfg.chunks, "modes": modes, "elapsed_s": time.perf_counter() - started,
               "notes": [
                   "peak_reserved_mib = torch.cuda.max_memory_reserved() + the driver's graph-memory reserved "
                   "high watermark (non-zero only with cudaMallocAsync, whose graph allocations torch does "
                   "not count); the two peaks may come at different moments, so their sum is an upper bound",
                   "steady = after one replay step, torch.cuda.empty_cache() and cuDeviceGraphMemTrim, peaks reset, "
                   "then the timed steps; incl_capture = from model creation through the eager warmup step "
                   "and the capture step",
                   "device_used_mib = cudaMemGetInfo used minus the figure before the model was built",
                   "async = engine memory 'shared' under PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync "
                   "(the framework ignores graph private pools)",
                   "targets are evaluated on the steady-state peak; per_graph is shown for contrast",
               ]}
    payload["summary"] = summarize(modes)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        json_path = args.out
    else:
        json_path = benchlib.write_result("memory", payload)
    print_table(payload)
    try:
        png = plot(payload, json_path.with_suffix(".png"))
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], png.name).write_bytes(png.read_bytes())
        print(f"wrote {json_path} and {png}")
    except Exception as exc:  # noqa: BLE001 - the JSON is the record; re-plot later with --plot-only
        print(f"wrote {json_path}; plotting failed ({type(exc).__name__}: {exc}); re-plot with --plot-only")
    if any("error" in r for r in modes.values()):
        return 1
    return 0 if all(v is not False for v in payload["summary"]["targets"].values()) else 2


if __name__ == "__main__":
    sys.exit(main())
