#!/usr/bin/env python
"""Time one optimizer step (clip + AdamW + zero-grad), eager against graphed, on one GPU.

    python tools/bench_optimizer.py            # ~50M params in 300 tensors; < 3 min on an H100,
                                               # plus graphed_foreach_compiled's compile (first step)
    python tools/bench_optimizer.py --variants graphed_foreach,graphed_foreach_compiled

Variants, measured side by side in one process (alternating rounds, CUDA events):

* ``eager_per_tensor``  AdamW(foreach=False), clip_grad_norm_(foreach=False), zero_grad
* ``eager_foreach``     AdamW(foreach=True),  clip_grad_norm_(foreach=True),  zero_grad
* ``eager_fused``       AdamW(fused=True),    clip_grad_norm_(foreach=True),  zero_grad
* ``graphed_per_tensor`` GraphedOptimizer(AdamW(foreach=False), clip_grad_norm=1.0)
* ``graphed_foreach``    GraphedOptimizer(AdamW(foreach=True),  clip_grad_norm=1.0)
* ``graphed_fused``      GraphedOptimizer(AdamW(fused=True),    clip_grad_norm=1.0) (extra)
* ``graphed_foreach_compiled`` GraphedOptimizer(AdamW(foreach=True), clip_grad_norm=1.0,
  compile=True): the captured sequence goes through torch.compile (Inductor) first

``--variants`` picks a subset; ``eager_per_tensor`` (the parity reference) and ``eager_fused``
(the ratio base) always run. The first step of each graphed variant (warmup + capture, and the
compile for the compiled one) is timed on its own and recorded as ``first_step_s``.

Gradients are zeroed in place by every variant. Before timing, each variant trains 20 steps
on the same gradient sequence (clipping active on every other step, an LR schedule moving
every step); the updated fp32 weights must agree with ``eager_per_tensor`` to 1e-6. Then each
variant's step runs under ``torch.cuda.set_sync_debug_mode("error")`` (no host sync allowed),
and is timed. Writes ``benchmarks/results/optimizer-<device>.json`` and prints a table.

Targets (issue 7): graphed <= 0.5x eager_per_tensor; graphed <= 1.0x eager_fused; no host sync;
graphed_foreach_compiled <= 1.0x eager_fused. A target whose variants were not run is left out.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
import traceback
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from paddle_graphpp import graph_api as gp  # noqa: E402
from paddle_graphpp.optim import GraphedOptimizer  # noqa: E402
from tools import benchlib  # noqa: E402

MAX_NORM = 1.0
LR = 1e-3
VARIANTS = ("eager_per_tensor", "eager_foreach", "eager_fused",
            "graphed_per_tensor", "graphed_foreach", "graphed_fused", "graphed_foreach_compiled")
REQUIRED = ("eager_per_tensor", "eager_fused")  # the parity reference and the ratio bases


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=300, help="number of parameter tensors (default 300)")
    ap.add_argument("--params", type=float, default=50e6, help="total parameters (default 50e6)")
    ap.add_argument("--parity-steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=8, help="timing rounds per variant")
    ap.add_argument("--iters", type=int, default=10, help="steps per timing round")
    ap.add_argument("--profile", default="",
                    help="comma list of variants to profile after timing (kernels per step, GPU time by kernel)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated variants to run (default: all); " + ", ".join(REQUIRED)
                    + " always run. Known: " + ", ".join(VARIANTS))
    args = ap.parse_args(argv)
    picked = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(picked) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    args.variants = tuple(v for v in VARIANTS if v in picked or v in REQUIRED)
    if args.tensors < 10 or args.params < args.tensors * 64:
        ap.error("need at least 10 tensors and 64 parameters per tensor")
    if min(args.parity_steps, args.rounds, args.iters) < 1:
        ap.error("--parity-steps, --rounds and --iters must be >= 1")
    return args


def shapes(n_tensors: int, total: float) -> list:
    """Half vectors (biases, norm weights: 256..4096), half matrices of varied shape filling the rest."""
    n_vec = n_tensors // 2
    vec = [(256 << (i % 5),) for i in range(n_vec)]
    n_mat = n_tensors - n_vec
    rest = total - sum(s[0] for s in vec)
    weights = [(0.5, 1.0, 1.5, 0.75, 1.25)[i % 5] for i in range(n_mat)]
    unit = rest / sum(weights)
    mats = []
    for i, w in enumerate(weights):
        rows = (256, 512, 768, 1024)[i % 4]
        mats.append((rows, max(1, round(unit * w / rows))))
    out = []
    for i in range(n_tensors):  # interleave, as a model's parameter list does
        out.append(mats.pop(0) if i % 2 == 0 and mats else vec.pop(0) if vec else mats.pop(0))
    return out


class Variant:
    """One copy of the parameters with its optimizer and its way of stepping."""

    def __init__(self, name: str, init: list):
        self.name = name
        self.params = [torch.nn.Parameter(t.clone()) for t in init]
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.compiled = name.endswith("_compiled")
        kind = name.split("_", 1)[1].removesuffix("_compiled")
        opt_kw = {"per_tensor": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[kind]
        self.clip_foreach = kind != "per_tensor"
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=0.1, **opt_kw)
        self.graphed = name.startswith("graphed")
        if self.graphed:
            self.gopt = GraphedOptimizer(self.opt, clip_grad_norm=MAX_NORM, compile=self.compiled)
            if not self.gopt.graphed:
                raise RuntimeError(f"{name}: GraphedOptimizer fell back to eager: {self.gopt.unavailable_reason}")
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1.0 + 0.05 * s))

    def step(self):
        if self.graphed:
            self.gopt.step()
            self.gopt.zero_grad()
        else:
            torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM, foreach=self.clip_foreach)
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)

    def load_grads(self, src: list):
        with torch.no_grad():
            torch._foreach_copy_([p.grad for p in self.params], src)


class RecaptureCounter(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record):
        if "re-capturing" in record.getMessage():
            self.count += 1


def sync_check(variant: Variant, steps: int = 3) -> dict:
    torch.cuda.synchronize()
    try:
        for _ in range(steps):
            torch.cuda.set_sync_debug_mode("error")
            try:
                variant.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        return {"host_sync_free": True}
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal: eager variants may sync
        torch.cuda.synchronize()
        return {"host_sync_free": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}


def profile_step(variant: Variant, steps: int = 5, top: int = 8) -> dict:
    """GPU kernels of ``steps`` steps (torch.profiler): launches and time per step, top kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            variant.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total_us = sum(e.device_time_total for e in kernels)
    rows = sorted(kernels, key=lambda e: e.device_time_total, reverse=True)[:top]
    return {"kernels_per_step": sum(e.count for e in kernels) / steps,
            "gpu_us_per_step": total_us / steps,
            "top": [{"kernel": e.key[:90], "per_step": e.count / steps, "us_per_step": e.device_time_total / steps}
                    for e in rows]}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_optimizer: needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    shp = shapes(args.tensors, args.params)
    n_params = sum(math.prod(s) for s in shp)
    init = [torch.randn(s, device=dev) * 0.02 for s in shp]
    base = [torch.randn(s, device=dev) for s in shp]
    base_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(b) for b in base])).item()
    # gradient norms 10x above and 10x below the clip threshold, alternating
    grads_big = [b * (10 * MAX_NORM / base_norm) for b in base]
    grads_small = [b * (0.1 * MAX_NORM / base_norm) for b in base]
    del base

    counter = RecaptureCounter()
    logging.getLogger(gp.__name__).addHandler(counter)
    variants = {name: Variant(name, init) for name in args.variants}
    names = list(variants)

    # Parity: the same 20 gradients through every variant, the LR schedule moving each step.
    # A graphed variant's first step (warmup + capture; the compile too) is timed on its own.
    first_step_s = {}
    for name, v in variants.items():
        for step in range(args.parity_steps):
            v.load_grads(grads_big if step % 2 == 0 else grads_small)
            if step == 0 and v.graphed:
                torch.cuda.synchronize()
                t_first = time.perf_counter()
                v.step()
                torch.cuda.synchronize()
                first_step_s[name] = round(time.perf_counter() - t_first, 3)
            else:
                v.step()
            v.sched.step()
    torch.cuda.synchronize()
    ref = variants["eager_per_tensor"].params
    parity = {}
    for name, v in variants.items():
        diff = max((a - b).abs().max().item() for a, b in zip(ref, v.params))
        parity[name] = {"max_abs_diff": diff, "ok": diff <= 1e-6}
    recaptures_in_parity = counter.count

    sync = {name: sync_check(v) for name, v in variants.items()}

    # Timing: gradients stay at zero after each step; AdamW's work does not depend on values.
    timings = benchlib.time_rounds({n: v.step for n, v in variants.items()}, iters=args.iters, rounds=args.rounds)
    rounds_done = args.rounds
    recaptures_total = counter.count

    profiles = {n: profile_step(variants[n]) for n in args.profile.split(",") if n in variants}

    med = {n: t["median_ms"] for n, t in timings.items()}
    ratios = {f"{g}/eager_per_tensor": med[g] / med["eager_per_tensor"] for g in med if g.startswith("graphed")}
    ratios.update({f"{g}/eager_fused": med[g] / med["eager_fused"] for g in med if g.startswith("graphed")})
    targets = {}

    def ratio_target(variant, base, bound):
        if variant in med:
            targets[f"{variant} <= {bound}x {base}"] = ratios[f"{variant}/{base}"] <= bound

    ratio_target("graphed_per_tensor", "eager_per_tensor", 0.5)
    ratio_target("graphed_foreach", "eager_per_tensor", 0.5)
    ratio_target("graphed_foreach", "eager_fused", 1.0)
    best_of = [n for n in ("graphed_per_tensor", "graphed_foreach", "graphed_fused") if n in med]
    if best_of:
        best_graphed = min(best_of, key=med.get)
        targets[f"best graphed ({best_graphed}) <= 1.0x eager_fused"] = ratios[f"{best_graphed}/eager_fused"] <= 1.0
    ratio_target("graphed_foreach_compiled", "eager_fused", 1.0)
    targets.update({
        "graphed variants host-sync free": all(sync[n]["host_sync_free"] for n in sync if n.startswith("graphed")),
        "parity fp32 <= 1e-6": all(p["ok"] for p in parity.values()),
        "no re-capture after the first step": recaptures_total == 0,
    })
    payload = {
        "benchmark": "optimizer",
        "command": benchlib.command(),
        **benchlib.environment(),
        "config": {"tensors": len(shp), "params": n_params, "max_norm": MAX_NORM, "lr": LR,
                   "parity_steps": args.parity_steps, "iters": args.iters, "rounds": rounds_done,
                   "optimizer": "AdamW(weight_decay=0.1)", "zero_grad": "in place (set_to_none=False)",
                   "variants": names},
        "timings_ms": timings,
        "first_step_s": first_step_s,
        "ratios": ratios,
        "parity_vs_eager_per_tensor": parity,
        "sync_check": sync,
        "recaptures": {"during_parity": recaptures_in_parity, "total": recaptures_total},
        "targets": targets,
        **({"profile": profiles} if profiles else {}),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    path = benchlib.write_result("optimizer", payload)

    print(f"\noptimizer step, {len(shp)} tensors, {n_params / 1e6:.1f}M params, {benchlib.environment()['device']}")
    print(f"{'variant':24s} {'median ms':>10s} {'min':>8s} {'max':>8s} {'vs per-tensor':>14s} {'vs fused':>9s} "
          f"{'parity':>10s} {'no sync':>8s} {'1st step s':>10s}")
    for n in names:
        t = timings[n]
        first = f"{first_step_s[n]:10.2f}" if n in first_step_s else f"{'-':>10s}"
        print(f"{n:24s} {t['median_ms']:10.3f} {t['min_ms']:8.3f} {t['max_ms']:8.3f} "
              f"{t['median_ms'] / med['eager_per_tensor']:13.2f}x {t['median_ms'] / med['eager_fused']:8.2f}x "
              f"{parity[n]['max_abs_diff']:10.1e} {str(sync[n]['host_sync_free']):>8s} {first}")
    for k, ok in targets.items():
        print(f"  [{'PASS' if ok else 'FAIL'}] {k}")
    for n, prof in profiles.items():
        print(f"profile {n}: {prof['kernels_per_step']:.0f} kernels, {prof['gpu_us_per_step']:.0f} us GPU per step")
        for row in prof["top"]:
            print(f"  {row['us_per_step']:9.1f} us  x{row['per_step']:<6.1f} {row['kernel']}")
    print(f"wrote {path} in {payload['wall_s']} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001 - a blind run must say what broke
        traceback.print_exc()
        sys.exit(1)
