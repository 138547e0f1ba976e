"""One command on the GPU machine: the engine's GPU tests, its benchmark, and a JSON record.

    python tools/gpu_check.py            # tests + benchmark, writes benchmarks/results/engine-<device>.json
    python tools/gpu_check.py --no-tests # benchmark only

Figures (targets from the engine issue):
  parity_max_rel_err       graphed vs eager, transformer stack with dropout, 12 steps x 4
                           micro-batches in the order f1 f2 f3 b1 f4 b2 b3 b4 (fp32, <= 1e-6)
  speedup_fwd_bwd          eager / graphed fwd+bwd time, 24 small layers, hidden 256, batch 32 (>= 2.5)
  ratio_vs_torch_graphed   ours / torch.cuda.make_graphed_callables on the same stack (<= 1.05)
  pool_shared_mib          graph pools, 8 micro-batches with 4 in flight (1F1B), one shared pool
  pool_separate_mib        the same with a pool per graph (upstream Paddle's behaviour)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)
from testing import launch  # noqa: E402
from tools import benchlib  # noqa: E402

ROOT = benchlib.ROOT
ONE_F_ONE_B = "f1 f2 f3 f4 b1 f5 b2 f6 b3 f7 b4 f8 b5 b6 b7 b8"  # 4 in flight, 8 micro-batches


def small_stack(layers=24, hidden=256):
    import torch

    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.LayerNorm(hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def bench_speed(iters: int, rounds: int) -> dict:
    import torch

    from paddle_graphpp.torch import CUDAGraphedModule

    torch.manual_seed(0)
    base = small_stack().cuda()
    eager = copy.deepcopy(base)
    ours = CUDAGraphedModule(copy.deepcopy(base), num_warmup_steps=2)
    x = torch.randn(32, 256, device="cuda", requires_grad=True)
    theirs = torch.cuda.make_graphed_callables(copy.deepcopy(base), (x,))
    dy = torch.randn(32, 256, device="cuda")

    def fwd_bwd(model):
        def run():
            model(x).backward(dy)
        return run

    variants = {"eager": fwd_bwd(eager), "ours": fwd_bwd(ours), "torch_graphed": fwd_bwd(theirs)}
    for fn in variants.values():  # warmup, capture (ours: 2 eager calls, then a capture call)
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    assert ours.engine.replays > 0, "our graphs were never replayed"
    t = benchlib.time_rounds(variants, iters=iters, rounds=rounds)
    return {
        "config": "24 x (Linear 256x256, LayerNorm, GELU), batch 32, fp32, fwd + bwd with grad accumulation",
        "times": t,
        "speedup_fwd_bwd": t["eager"]["median_ms"] / t["ours"]["median_ms"],
        "ratio_vs_torch_graphed": t["ours"]["median_ms"] / t["torch_graphed"]["median_ms"],
    }


def run_one_f_one_b(model, dy) -> None:
    """One step of the 1F1B order above, on fresh 4096 x 256 inputs."""
    import torch

    outs = {}
    for tok in ONE_F_ONE_B.split():
        n = int(tok[1:])
        if tok[0] == "f":
            outs[n] = model(torch.randn(4096, 256, device="cuda", requires_grad=True))
        else:
            outs.pop(n).backward(dy)


def pool_child(mode: str) -> None:
    """Subprocess body: capture the 1F1B stack in one memory mode, print pool figures as JSON."""
    import torch

    import paddle_graphpp
    from paddle_graphpp.torch import CUDAGraphedModule

    torch.manual_seed(0)
    dy = torch.randn(4096, 256, device="cuda")
    if mode == "eager":  # the floor: what the in-flight micro-batches need without graphs
        model = small_stack().cuda()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run_one_f_one_b(model, dy)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        print(json.dumps({"mode": mode, "pool_reserved_mib": peak, "note": "eager peak allocated above start"}))
        return
    model = CUDAGraphedModule(small_stack().cuda(), num_warmup_steps=1, memory=mode)
    for _ in range(3):  # warmup, capture, replay
        run_one_f_one_b(model, dy)
    torch.cuda.synchronize()
    report = paddle_graphpp.memory_report()["torch"]
    print(json.dumps({"mode": mode, "graphs": model.engine.graph_count(), "replays": model.engine.replays,
                      "pool_reserved_mib": report["pool_reserved_bytes"] / 2**20,
                      "pool_allocated_mib": report["pool_allocated_bytes"] / 2**20,
                      "device_reserved_mib": report["device_reserved_bytes"] / 2**20}))


def bench_pools() -> dict:
    out = {}
    for mode in ("eager", "shared", "per_graph"):
        end = launch.run([sys.executable, __file__, "--pool-child", mode], timeout=300)
        if end.returncode != 0 or end.timed_out:
            why = "timed out after 300 s" if end.timed_out else f"exit code {end.returncode}"
            raise RuntimeError(f"pool measurement for {mode} failed ({why}):\n{end.stderr[-3000:]}")
        out[mode] = benchlib.last_json_line(end.stdout)
    return {
        "config": "same stack, input 4096 x 256, 8 micro-batches with 4 in flight (1F1B: " + ONE_F_ONE_B + ")",
        "modes": out,
        "pool_shared_mib": out["shared"]["pool_reserved_mib"],
        "pool_separate_mib": out["per_graph"]["pool_reserved_mib"],
        "eager_in_flight_peak_mib": out["eager"]["pool_reserved_mib"],
    }


def parity() -> float:
    import torch

    from testing.parity import check_parity

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return check_parity(accumulate_grads=False)


def run_tests(paths: list[str]) -> dict:
    end = launch.run([sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", "-rfEs"],
                     cwd=ROOT, timeout=900)
    tail = end.stdout.strip().splitlines()[-25:]
    if end.timed_out:
        tail.append("gpu_check: the tests did not finish in 900 s; stopped")
    print("\n".join(tail))
    return {"paths": paths, "exit_code": end.returncode, "summary": tail[-1] if tail else ""}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-tests", action="store_true", help="skip the pytest run")
    ap.add_argument("--tests", nargs="*", default=["unittests/gpu/test_engine_gpu.py"],
                    help="GPU test files to run first")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--pool-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pool_child:
        pool_child(args.pool_child)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check here (run it on the GPU machine)")
        return 1
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    result = {"command": benchlib.command(), **benchlib.environment()}
    if not args.no_tests:
        result["tests"] = run_tests(args.tests)
    result["parity_max_rel_err"] = parity()
    result.update(bench_speed(args.iters, args.rounds))
    result.update(bench_pools())
    result["targets"] = {
        "parity_max_rel_err<=1e-6": result["parity_max_rel_err"] <= 1e-6,
        "speedup_fwd_bwd>=2.5": result["speedup_fwd_bwd"] >= 2.5,
        "ratio_vs_torch_graphed<=1.05": result["ratio_vs_torch_graphed"] <= 1.05,
        "pool_shared<=half_separate": result["pool_shared_mib"] <= 0.5 * result["pool_separate_mib"],
    }
    path = benchlib.write_result("engine", result)
    t = result["times"]
    print(f"\n{'figure':<28}{'value':>12}")
    print(f"{'parity_max_rel_err':<28}{result['parity_max_rel_err']:>12.2e}")
    for k in ("eager", "ours", "torch_graphed"):
        print(f"{k + ' ms (spread)':<28}{t[k]['median_ms']:>8.4f} ({t[k]['spread']:.2f})")
    print(f"{'speedup_fwd_bwd':<28}{result['speedup_fwd_bwd']:>12.2f}")
    print(f"{'ratio_vs_torch_graphed':<28}{result['ratio_vs_torch_graphed']:>12.3f}")
    for k in ("eager_in_flight_peak_mib", "pool_shared_mib", "pool_separate_mib"):
        print(f"{k:<28}{result[k]:>12.1f}")
    print(f"targets: {result['targets']}\nwrote {path}")
    return 0 if all(result["targets"].values()) and result.get("tests", {}).get("exit_code", 0) == 0 else 2


if __name__ == "__main__":
    sys.exit(main())
