"""The allocator switch on a CUDA build of PyTorch: the backend really changes, late calls raise,
a half switch is caught, and graphs capture and replay under cudaMallocAsync. Each test runs a
fresh interpreter (the backend is chosen when torch loads)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROOT = Path(__file__).resolve().parents[2]


def run(body: str, **env_vars) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "FLAGS_use_cuda_malloc_async_allocator")}
    env.update(env_vars)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    code = "import json, os, sys, warnings\nwarnings.simplefilter('ignore')\n" + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_early_call_selects_cuda_malloc_async():
    out = run("""
        import paddle_graphpp
        paddle_graphpp.use_cuda_malloc_async_allocator()
        import torch
        from paddle_graphpp.allocator import async_allocator_active
        x = torch.ones(1 << 20, device="cuda")
        print(json.dumps({"backend": torch.cuda.get_allocator_backend(), "active": async_allocator_active("torch")}))
    """)
    assert out == {"backend": "cudaMallocAsync", "active": True}


def test_call_after_import_torch_raises_and_keeps_native():
    out = run("""
        import torch
        import paddle_graphpp
        from paddle_graphpp.allocator import AllocatorSwitchError
        try:
            paddle_graphpp.use_cuda_malloc_async_allocator()
            err = None
        except AllocatorSwitchError as e:
            err = str(e)
        print(json.dumps({"err": err, "backend": torch.cuda.get_allocator_backend(),
                          "env": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                          "flag": os.environ.get("FLAGS_use_cuda_malloc_async_allocator")}))
    """)
    assert out["err"] and "too late" in out["err"] and "'native'" in out["err"]
    assert out["backend"] == "native" and out["env"] is None and out["flag"] is None


def test_env_flag_after_torch_import_is_a_half_switch_the_engine_check_catches():
    out = run("""
        import torch
        from paddle_graphpp.allocator import AllocatorSwitchError, async_allocator_active
        try:
            async_allocator_active("torch")
            err = None
        except AllocatorSwitchError as e:
            err = str(e)
        print(json.dumps({"err": err}))
    """, FLAGS_use_cuda_malloc_async_allocator="1")
    assert out["err"] and "requested" in out["err"] and "native" in out["err"]


def test_env_flag_before_torch_import_is_honoured():
    out = run("""
        from paddle_graphpp.allocator import apply_env_switch
        apply_env_switch()  # what `import paddle_graphpp` runs once the lead wires it
        import torch
        print(json.dumps({"backend": torch.cuda.get_allocator_backend()}))
    """, FLAGS_use_cuda_malloc_async_allocator="1")
    assert out["backend"] == "cudaMallocAsync"


def test_graphed_module_matches_eager_under_cuda_malloc_async():
    out = run("""
        import paddle_graphpp
        paddle_graphpp.use_cuda_malloc_async_allocator(frameworks=["torch"])
        import copy, torch
        from paddle_graphpp.torch import CUDAGraphedModule
        torch.manual_seed(0)
        base = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).cuda()
        ref, model = copy.deepcopy(base), CUDAGraphedModule(copy.deepcopy(base), num_warmup_steps=2)
        xs = [torch.randn(8, 64, device="cuda") for _ in range(4)]
        order = "f0 f1 b0 f2 b1 f3 b2 b3".split()
        worst = 0.0
        for _ in range(4):
            for m in (ref, model):
                outs = {}
                for tok in order:
                    i = int(tok[1:])
                    if tok[0] == "f":
                        outs[i] = m(xs[i])
                    else:
                        outs.pop(i).square().mean().backward()
        torch.cuda.synchronize()
        for p, q in zip(ref.parameters(), model.module.parameters()):
            worst = max(worst, ((p.grad - q.grad).abs().max() / p.grad.abs().max()).item())
        print(json.dumps({"backend": torch.cuda.get_allocator_backend(), "replays": model.engine.replays,
                          "worst": worst}))
    """)
    assert out["backend"] == "cudaMallocAsync"
    assert out["replays"] > 0
    assert out["worst"] < 1e-5
