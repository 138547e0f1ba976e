#!/usr/bin/env python
"""Mixtures of experts on one GPU: Hugging Face Qwen3-MoE, Mixtral and DeepSeek-V3 under each
experts implementation, eager against graphed around the dispatch and graphed whole.

    python tools/bench_moe.py                                    # -> benchmarks/results/moe-<device>.json
    python tools/bench_moe.py --models qwen3_moe --rounds 3      # one class

Three parts, each class built from its own config (``testing/zoo.py``):

1. **Exactness** (tiny, fp32, TF32 off, the router's load-balancing loss on where the door takes
   it): ``--steps`` AdamW steps of the model's own training against the same weights graphed
   around the dispatch (``eager`` experts), graphed whole (``batched_mm``) and as one whole-model
   graph (``batched_mm``): per-step losses, aux losses and weights after the last step, bit for bit.
2. **Speed** (the launch-bound shape: hidden 1024, 16 experts of width 512 (Mixtral's 1024), top-2, 8
   layers, bf16, 4 micro-batches of 2 x 256 tokens): the variants
   of :data:`VARIANTS` take turns in ``--rounds`` alternating rounds of ``--iters`` steps after
   warmup and capture; tokens/s from the median round, with the spread. Each graphed variant is
   compared with the eager run of its own experts implementation.
   The capacity variants (``capacity_experts(model, --capacity-factor, on_overflow="drop")``) record
   the pairs they dropped.
   Beside the variants, in the same alternating rounds, ``experts_alone`` runs only the experts
   modules of the ``eager_loop`` model, forward and backward, on the inputs they got in a recorded
   step: the part of the step that graphs around the dispatch leave eager. ``around_bound``
   (the eager step over that time) is the most any graph around the dispatch could gain.
   With ``--profile-steps N``, each variant then runs ``N`` steps under timers, the sync debug
   mode and the profiler (:func:`profile`): where its step's time goes, host and GPU.
3. **Memory**: each variant of the speed part in its own process (``--child``), at the same shape:
   peak allocated and reserved memory over ``--memory-steps`` steps, the capture step included.
   With ``--memory-trace`` each process also records the allocator's history
   (``tools/diagnostics/memtrace.py``) and breaks its reserved peak down by pool.

Where a variant fails (a refusal, a failed capture), the record says so with the message.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import transformers  # noqa: E402

from testing import zoo  # noqa: E402
from tools import benchlib  # noqa: E402

MODELS = ("qwen3_moe", "mixtral", "deepseek_v3")
#: name -> (experts implementation, front door: None eager, "layers" graph_layers, "model" graph_model)
VARIANTS = {
    "eager_loop": ("eager", None),
    "around": ("eager", "layers"),  # attention and router graphed, experts eager
    "eager_grouped": ("grouped_mm", None),
    "whole_grouped": ("grouped_mm", "layers"),  # whole blocks where grouped_mm captures (bf16, sm90+)
    "eager_batched": ("batched_mm", None),
    "whole_batched": ("batched_mm", "layers"),
    "model_grouped": ("grouped_mm", "model"),
    "eager_capacity": ("capacity", None),  # capacity_experts(model, --capacity-factor, on_overflow="drop")
    "whole_capacity": ("capacity", "layers"),
    "model_capacity": ("capacity", "model"),
}
BASELINE = {"eager": "eager_loop", "grouped_mm": "eager_grouped", "batched_mm": "eager_batched",
            "capacity": "eager_capacity"}
# The launch-bound shape (every name a config may use for it; a config ignores the others).
SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             intermediate_size=1024, moe_intermediate_size=512, num_experts=16, num_local_experts=16,
             n_routed_experts=16, num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=4096,
             n_shared_experts=1, kv_lora_rank=256, q_lora_rank=512, qk_rope_head_dim=32, qk_nope_head_dim=64,
             v_head_dim=64, first_k_dense_replace=1, n_group=1, topk_group=1)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"needs 1 or more, got {value}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="*", default=list(MODELS))
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="steps of the exactness part (3 warm up and capture)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--memory-steps", type=int, default=4)
    p.add_argument("--memory-processes", type=_positive, default=4,
                   help="memory runs at once (1 for variants that need much of the GPU, as batched_mm's)")
    p.add_argument("--skip", nargs="*", default=[], choices=["exact", "speed", "memory"])
    p.add_argument("--name", default="moe", help="record name (the device is appended)")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="of the capacity variants (drops counted)")
    p.add_argument("--memory-trace", action="store_true", help="break each variant's peak down by pool (slower)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after the rounds, where each variant's step time goes over this many steps (see profile())")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # "model:variant": one memory run
    return p.parse_args(argv)


def build(model_type, implementation, *, launch_bound, capacity_factor=1.25, **extra):
    if implementation == "capacity":
        from paddle_graphpp.torch import capacity_experts

        model = build(model_type, "eager", launch_bound=launch_bound, **extra)
        capacity_experts(model, capacity_factor, on_overflow="drop")
        return model
    overrides = dict(SHAPE) if launch_bound else {}
    if launch_bound and model_type == "deepseek_v3":
        overrides["head_dim"] = None  # its config derives it from the rope and nope head sizes
        overrides["num_key_value_heads"] = overrides["num_attention_heads"]  # latent attention: one per head
    model = zoo.build(model_type, experts_implementation=implementation, **overrides, **extra)
    if launch_bound:
        model = model.to(torch.bfloat16)
    return model.cuda().train()


def graph(model, door):
    from paddle_graphpp.torch import graph_layers, graph_model

    if door == "layers":
        return graph_layers(zoo.blocks_of(model))
    if door == "model":
        return graph_model(model)
    return None


def trainer(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step(batch):
        losses, aux = [], []
        for ids in batch:
            out = model(ids, labels=ids)
            out.loss.backward()
            losses.append(out.loss.detach().clone())  # a graph's output is overwritten by its next replay
            if getattr(out, "aux_loss", None) is not None:
                aux.append(out.aux_loss.detach().clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return losses, aux
    return step


def batches(args, vocab, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, vocab, (args.batch, args.seq), generator=gen).cuda() for _ in range(args.micro_batches)]
            for _ in range(steps)]


def graph_counts(model):
    """(captures, replays) summed over every engine of the model's graphed modules."""
    engines = {}
    whole = model.__dict__.get("_graphpp_whole")
    if whole is not None:
        engines[id(whole)] = whole.graphed._engine
    for m in model.modules():
        engine = getattr(m, "engine", None) if "_graphpp_graphed" in m.__dict__ else None
        if engine is not None:
            engines[id(engine)] = engine
    return sum(e.captures for e in engines.values()), sum(e.replays for e in engines.values())


# ----------------------------------------------------------------------------- 1. exactness
def exactness(args, model_type):
    """fp32: the model's own training against each graphed door, bit for bit (aux loss included
    where the door takes output_router_logits: not in the whole-model graph when this
    transformers' load-balancing loss reads the host, which graph_model refuses)."""
    from paddle_graphpp.torch.integrations.transformers import aux_loss_capture_problem

    rows = {}
    cases = (("around", "eager", "layers", True), ("whole_batched", "batched_mm", "layers", False),
             ("model_batched", "batched_mm", "model", True))
    for name, impl, door, aux in cases:
        try:
            base = build(model_type, impl, launch_bound=False, output_router_logits=aux)
            refused = aux and door == "model" and aux_loss_capture_problem(base)
            if refused:  # graph_model refuses a load-balancing loss that reads the host: leave it out
                base = build(model_type, impl, launch_bound=False, output_router_logits=False)
            gen = torch.Generator().manual_seed(1)
            data = [[torch.randint(0, base.config.vocab_size, (2, 16), generator=gen).cuda() for _ in range(2)]
                    for _ in range(args.steps)]
            runs = []
            for graphed in (False, True):
                model = copy.deepcopy(base)
                if graphed:
                    graph(model, door)
                torch.manual_seed(2)
                step = trainer(model)
                losses, auxes = [], []
                for batch in data:
                    l, a = step(batch)
                    losses += [x.item() for x in l]
                    auxes += [x.item() for x in a]
                runs.append((losses, auxes, [p.detach().clone() for p in model.parameters()], graph_counts(model)))
            (l0, a0, p0, _), (l1, a1, p1, counts) = runs
            rows[name] = {"experts_implementation": impl, "door": door, "aux_loss": bool(a0),
                          **({"aux_loss_refused": refused} if refused else {}),
                          "losses_equal": l0 == l1, "aux_losses_equal": a0 == a1,
                          "params_equal": all(torch.equal(x, y) for x, y in zip(p0, p1)),
                          "max_loss_diff": max(abs(x - y) for x, y in zip(l0, l1)),
                          "captures": counts[0], "replays": counts[1]}
        except Exception as exc:  # noqa: BLE001 - recorded with its message
            traceback.print_exc(limit=4)
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        print(f"  exact {model_type} {name}: {rows[name]}", flush=True)
    return rows


# ----------------------------------------------------------------------------- 2. speed
def experts_alone(model, step, data):
    """A callable that runs, eagerly, only the experts modules of one ``step(data)`` of ``model``:
    each module's forward and backward on the inputs it got in a step recorded here (an output
    gradient drawn once). The experts' gradients are cleared after each call, so the model's own
    steps are not changed by it."""
    from paddle_graphpp.torch.integrations.transformers import experts_modules

    calls = []

    def keep(module, args, kwargs):
        def held(x):
            if not torch.is_tensor(x):
                return x
            return x.detach().clone().requires_grad_(x.is_floating_point())
        args = [held(a) for a in args]
        calls.append((module, args, {k: held(v) for k, v in kwargs.items()}, torch.randn_like(args[0])))

    modules = [m for _n, m, _impl in experts_modules(model)]
    handles = [m.register_forward_pre_hook(keep, with_kwargs=True) for m in modules]
    try:
        step(data)
    finally:
        for h in handles:
            h.remove()

    def run():
        for module, args, kwargs, grad in calls:
            module(*args, **kwargs).backward(grad)
        for m in modules:
            m.zero_grad(set_to_none=True)
    return run, len(calls)


def speed(args, model_type):
    models, steps, row = {}, {}, {"variants": {}}
    data = None
    for name in args.variants:
        impl, door = VARIANTS[name]
        try:
            model = build(model_type, impl, launch_bound=True, capacity_factor=args.capacity_factor)
            if data is None:
                data = batches(args, model.config.vocab_size, 1, seed=1)[0]
                row["class"] = type(model).__name__
                row["parameters_m"] = sum(p.numel() for p in model.parameters()) / 1e6
            graphed = graph(model, door)
            step = trainer(model)
            losses = [torch.stack(step(data)[0]).float().tolist() for _ in range(4)]  # warm up, record, capture
            torch.cuda.synchronize()
            models[name], steps[name] = model, step
            row["variants"][name] = {"experts_implementation": impl, "door": door, "first_losses": losses,
                                     "eager_parts": len(getattr(graphed, "eager", []) or [])}
        except Exception as exc:  # noqa: BLE001 - recorded with its message
            traceback.print_exc(limit=4)
            row["variants"][name] = {"experts_implementation": impl, "door": door,
                                     "error": f"{type(exc).__name__}: {exc}"[:500]}
            torch.cuda.empty_cache()
    timed = {n: (lambda s=s: s(data)) for n, s in steps.items()}
    if "eager_loop" in steps:
        timed["experts_alone"], row["experts_alone_calls"] = experts_alone(models["eager_loop"], steps["eager_loop"], data)
    timing = benchlib.time_rounds(timed, iters=args.iters, rounds=args.rounds)
    alone = timing.pop("experts_alone", None)
    if alone is not None:
        loop_ms = timing["eager_loop"]["median_ms"]
        row["experts_alone"] = {"step_ms": alone["median_ms"], "spread": alone["spread"],
                                "share_of_eager_loop": alone["median_ms"] / loop_ms,
                                "around_bound": loop_ms / alone["median_ms"]}
    tokens = args.batch * args.seq * args.micro_batches
    for name, t in timing.items():
        v = row["variants"][name]
        v["step_ms"], v["spread"] = t["median_ms"], t["spread"]
        v["tokens_per_s"] = tokens / (t["median_ms"] / 1e3)
        v["captures"], v["replays"] = graph_counts(models[name])
        if v["experts_implementation"] == "capacity":
            from paddle_graphpp.torch import capacity_overflows

            v["dropped_pairs"] = sum(capacity_overflows(models[name]).values())
    for name, v in row["variants"].items():
        base = BASELINE[v["experts_implementation"]]
        if "step_ms" in v and "step_ms" in row["variants"].get(base, {}) and name != base:
            v["vs_eager_same_experts"] = row["variants"][base]["step_ms"] / v["step_ms"]
        if "step_ms" in v and "step_ms" in row["variants"].get("eager_loop", {}):
            v["vs_eager_loop"] = row["variants"]["eager_loop"]["step_ms"] / v["step_ms"]
    if args.profile_steps:
        for name in models:
            try:
                row["variants"][name]["profile"] = profile(models[name], steps[name], data, args.profile_steps)
            except Exception as exc:  # noqa: BLE001 - recorded with its message; the other variants go on
                traceback.print_exc(limit=4)
                row["variants"][name]["profile"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    del models, steps
    torch.cuda.empty_cache()
    return row


def profile(model, step, data, n):
    """Where ``n`` steps of one variant spend their time, per step in ms: the wall time (GPU
    synchronised after the steps) and the time the host took to issue them; the host's time
    inside the experts modules' forwards (the eager loop, its waits on the GPU included), inside
    the graphed calls (the engine's entry, replays included) and inside graphed backwards; the
    host's microseconds per call in the parts of a graphed call; cProfile's top functions; the calls that make the host
    wait for the GPU (``torch.cuda.set_sync_debug_mode``), by line; and
    what the GPU did (``tools/diagnostics/busy.py``: kernel time, idle time, the largest gaps)."""
    from paddle_graphpp.core.engine import GraphedCallable
    from paddle_graphpp.torch import autograd as graphed_autograd
    from paddle_graphpp.torch.integrations.transformers import experts_modules
    from tools.diagnostics import busy
    from tools.diagnostics.host_time import Timers, function_rows, syncs_in_step, time_engine_parts

    def run_timed(put_on) -> Timers:
        """``n`` steps with the timers ``put_on(timers)`` places, taken off again whatever happens."""
        timers = Timers()
        try:
            put_on(timers)
            for _ in range(n):
                step(data)
            torch.cuda.synchronize()
        finally:
            timers.restore()
        return timers

    def top_level(timers):
        for cls in {type(m) for _n, m, _impl in experts_modules(model)}:
            owner = next(c for c in cls.__mro__ if "forward" in c.__dict__)  # where its forward is defined
            timers.wrap("experts forward", owner, "forward")
        timers.wrap("graphed call", GraphedCallable, "__call__")
        timers.wrap("graphed backward", graphed_autograd._GraphedFunction, "backward")

    out = {}
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step(data)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    out["wall_ms"], out["host_issue_ms"] = (time.perf_counter() - start) / n * 1e3, host / n * 1e3
    timers = run_timed(top_level)
    out["host_ms"] = {k: {"ms_per_step": round(t / n * 1e3, 3), "calls_per_step": c / n}
                      for k, (t, c) in timers.total.items()}
    if "graphed call" in timers.total:  # the graphed calls' parts, host us per call
        out["graphed_call_parts_us"] = run_timed(time_engine_parts).per_call_us()
    prof = cProfile.Profile()  # host time by function (cProfile slows Python-heavy code: compare variants)
    prof.enable()
    for _ in range(n):
        step(data)
    torch.cuda.synchronize()
    prof.disable()
    rows = function_rows(prof)
    out["cprofile_ms_per_step"] = {
        key: [{"function": f, "calls": c / n, "self": round(tt / n * 1e3, 2), "total": round(ct / n * 1e3, 2)}
              for f, c, tt, ct in sorted(rows, key=lambda r: -r[col])[:25]]
        for key, col in (("by_self", 2), ("by_total", 3))}
    syncs = syncs_in_step(type("Steps", (), {"step": staticmethod(lambda: step(data))}))
    out["syncs_per_step"], out["syncs_by_line"] = sum(syncs.values()), syncs
    torch.cuda.synchronize()  # nothing of the steps above in the profile
    prof = busy.start()
    for _ in range(n):
        step(data)
    report = busy.report(prof, n)
    if "gaps" in report:
        report["gaps"]["groups"] = report["gaps"]["groups"][:5]
    out["gpu"] = report
    print(f"    profile: {json.dumps(out)[:600]}", flush=True)
    return out


# ----------------------------------------------------------------------------- 3. memory
def child(args):
    """One variant in this process: peak allocated and reserved MiB over the steps (capture included)."""
    model_type, name = args.child.split(":")
    impl, door = VARIANTS[name]
    if args.memory_trace:
        from tools.diagnostics import memtrace

        memtrace.start()
    torch.cuda.reset_peak_memory_stats()
    model = build(model_type, impl, launch_bound=True, capacity_factor=args.capacity_factor)
    graph(model, door)
    step = trainer(model)
    data = batches(args, model.config.vocab_size, 1, seed=1)[0]
    step_starts_us = []
    for _ in range(args.memory_steps):
        torch.cuda.synchronize()
        step_starts_us.append(time.time() * 1e6)
        step(data)
    torch.cuda.synchronize()
    from paddle_graphpp.torch.runtime import RUNTIME

    row = {"allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
           "reserved_mib": torch.cuda.max_memory_reserved() / 2**20, "lending": RUNTIME.lending_report()}
    if args.memory_trace:
        snapshot = torch.cuda.memory._snapshot()
        memtrace.write_raw(snapshot, f"{model_type}-{name}", step_starts_us)  # with GRAPHPP_MEMTRACE_RAW=<folder>
        trace = memtrace.analyze(snapshot, top=8, step_starts_us=step_starts_us)
        keep = ("reserved_mib", "allocated_mib", "reserved_by_pool_mib", "allocated_by_pool_mib",
                "free_in_empty_segments_mib", "free_in_used_segments_mib", "segments", "step", "step_fraction",
                "top_sites_mib")
        row["trace"] = {"complete": trace["complete"],
                        **{k: {f: trace[k][f] for f in keep if f in trace[k]}
                           for k in ("peak_reserved", "peak_allocated", "end") if k in trace}}
    print(json.dumps(row))


def memory(args, model_type):
    """Each variant in its own process, ``--memory-processes`` at a time (each process reads its
    own peaks), after this process has handed its cached memory back."""
    gc.collect()
    torch.cuda.empty_cache()
    rows, running = {}, []
    names = list(args.variants)
    while names or running:
        while names and len(running) < args.memory_processes:
            name = names.pop(0)
            cmd = [sys.executable, __file__, "--child", f"{model_type}:{name}", "--capacity-factor", str(args.capacity_factor),
                   "--batch", str(args.batch),
                   "--seq", str(args.seq), "--micro-batches", str(args.micro_batches),
                   "--memory-steps", str(args.memory_steps)] + (["--memory-trace"] if args.memory_trace else [])
            running.append((name, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        name, proc = running.pop(0)
        out, err = proc.communicate(timeout=300)
        rows[name] = benchlib.last_json_line(out) or {"error": (err or out)[-400:]}
    for name, r in rows.items():
        base = rows.get(BASELINE[VARIANTS[name][0]], {})
        if "reserved_mib" in r and "reserved_mib" in base and name != BASELINE[VARIANTS[name][0]]:
            r["vs_eager_same_experts"] = {k: r[k] / base[k] for k in ("allocated_mib", "reserved_mib")}
    print(f"  memory {model_type}: {rows}", flush=True)
    return rows


def main(argv=None):
    args = parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.child:
        return child(args)
    started = time.perf_counter()
    rows = {}
    for model_type in args.models:
        row = rows[model_type] = {}
        if "exact" not in args.skip:
            row["exact"] = exactness(args, model_type)
        if "speed" not in args.skip:
            row["speed"] = speed(args, model_type)
        if "memory" not in args.skip:
            row["memory"] = memory(args, model_type)
        print(f"[{time.perf_counter() - started:5.0f} s] {model_type} done", flush=True)
        path = benchlib.write_result(args.name, {"environment": benchlib.environment(), "settings": vars(args),
                                                 "transformers": transformers.__version__,
                                             "shape": SHAPE, "models": rows})
    print(f"\n{'class':12s} {'variant':14s} {'tok/s':>9s} {'x same':>7s} {'x loop':>7s} {'spread':>6s} "
          f"{'alloc':>7s} {'resv':>7s}")
    for model_type, row in rows.items():
        for name, v in row.get("speed", {}).get("variants", {}).items():
            m = row.get("memory", {}).get(name, {})
            print(f"{model_type:12s} {name:14s} {v.get('tokens_per_s', 0):9.0f} {v.get('vs_eager_same_experts', 0):7.2f} "
                  f"{v.get('vs_eager_loop', 0):7.2f} {v.get('spread', 0):6.2f} {m.get('allocated_mib', 0):7.0f} "
                  f"{m.get('reserved_mib', 0):7.0f}" + ("  ERR " + v["error"][:80] if "error" in v else ""))
        for name, v in row.get("speed", {}).get("variants", {}).items():
            pr = v.get("profile")
            if pr:
                host = ", ".join(f"{k} {h['ms_per_step']:.1f}" for k, h in pr["host_ms"].items())
                gpu = pr["gpu"]
                print(f"{model_type:12s} {name:14s} per step: wall {pr['wall_ms']:.1f} ms (host issued in "
                      f"{pr['host_issue_ms']:.1f}); host in {host}; {pr['syncs_per_step']} syncs; GPU kernels "
                      f"{gpu.get('busy_ms')} ms, idle {gpu.get('idle_ms')} ms of a {gpu.get('span_ms')} ms span")
        alone = row.get("speed", {}).get("experts_alone")
        if alone:
            print(f"{model_type:12s} experts alone: {alone['step_ms']:.1f} ms, {alone['share_of_eager_loop']:.2f} of the "
                  f"eager loop's step; no graph around them gains more than {alone['around_bound']:.2f}x")
        for name, m in row.get("memory", {}).items():
            peak = m.get("trace", {}).get("peak_reserved")
            if peak:
                print(f"{model_type:12s} {name:14s} at the reserved peak (step {peak.get('step')}): reserved "
                      f"{peak['reserved_by_pool_mib']}, allocated {peak['allocated_by_pool_mib']}")
        for name, e in row.get("exact", {}).items():
            print(f"{model_type:12s} exact {name:14s} {e}")
    print(path)


if __name__ == "__main__":
    main()
