"""The stream-ordered allocator switch and the memory-mode setting, with the real frameworks (CPU).

The switch is process-global, so every switch test runs in a fresh interpreter with a
controlled environment. These are CPU builds: nothing here allocates on a device. What is
checked is what CPU builds can show: the environment a framework is imported with, Paddle's
own flag after import, Paddle's allocator statistics as the "already allocated" signal, and
the order rule for PyTorch as checked against an already-imported CPU torch.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_CLEAR = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "FLAGS_use_cuda_malloc_async_allocator",
          "FLAGS_allocator_strategy", "FLAGS_use_cuda_managed_memory", "FLAGS_use_system_allocator")

PRELUDE = """
import json, os, sys, warnings
warnings.simplefilter("ignore")
import paddle_graphpp
from paddle_graphpp.allocator import AllocatorSwitchError
def env():
    return {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
                                           "FLAGS_use_cuda_malloc_async_allocator")}
def switch(**kw):
    try:
        return {"ok": paddle_graphpp.use_cuda_malloc_async_allocator(**kw)}
    except AllocatorSwitchError as e:
        return {"error": str(e)}
"""


def run(body: str, **env_vars) -> dict:
    """Run ``body`` in a fresh interpreter; it prints one JSON object as its last line."""
    env = {k: v for k, v in os.environ.items() if k not in _CLEAR}
    env.update(env_vars)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True,
                          text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ early calls
@pytest.mark.slow  # imports both frameworks in a fresh interpreter
def test_early_call_sets_both_frameworks_before_import_and_paddle_takes_the_flag():
    out = run("""
        r = switch()
        before = env()
        seen = "torch" in sys.modules or "paddle" in sys.modules
        import torch, paddle
        print(json.dumps({"r": r, "before": before, "imported_early": seen,
                          "paddle_flag": paddle.get_flags(["FLAGS_use_cuda_malloc_async_allocator"])
                          ["FLAGS_use_cuda_malloc_async_allocator"],
                          "torch_env_after_import": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}))
    """)
    assert "ok" in out["r"], out["r"]
    assert not out["imported_early"], "the switch must not import a framework"
    assert out["before"]["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"
    assert out["before"]["FLAGS_use_cuda_malloc_async_allocator"] == "1"
    assert out["before"]["PYTORCH_ALLOC_CONF"] is None  # not created when the user did not set it
    assert out["paddle_flag"] is True  # Paddle read the flag from the environment at import
    assert out["torch_env_after_import"] == "backend:cudaMallocAsync"


def test_existing_torch_conf_is_merged_not_clobbered():
    out = run("""
        r = switch(frameworks=["torch"])
        print(json.dumps({"r": r, "env": env()}))
    """, PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:128,garbage_collection_threshold:0.6",
         PYTORCH_ALLOC_CONF="expandable_segments:False")
    assert "ok" in out["r"], out["r"]
    assert out["env"]["PYTORCH_CUDA_ALLOC_CONF"] == \
        "max_split_size_mb:128,garbage_collection_threshold:0.6,backend:cudaMallocAsync"
    # PyTorch >= 2.9 reads PYTORCH_ALLOC_CONF first: it must carry the backend as well
    assert out["env"]["PYTORCH_ALLOC_CONF"] == "expandable_segments:False,backend:cudaMallocAsync"
    assert out["env"]["FLAGS_use_cuda_malloc_async_allocator"] is None  # Paddle was not asked


def test_calling_twice_is_idempotent():
    out = run("""
        a, b = switch(), switch()
        print(json.dumps({"a": a, "b": b, "env": env()}))
    """)
    assert "ok" in out["a"] and "ok" in out["b"]
    assert out["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"


def test_paddle_imported_without_allocating_takes_the_flag_and_says_cpu_build_is_a_no_op():
    out = run("""
        import paddle
        r = switch()
        flag = paddle.get_flags(["FLAGS_use_cuda_malloc_async_allocator"])["FLAGS_use_cuda_malloc_async_allocator"]
        x = paddle.ones([4]) * 2  # Paddle keeps working on CPU after the switch
        print(json.dumps({"r": r, "flag": flag, "sum": float(x.sum())}))
    """)
    assert "ok" in out["r"], out["r"]
    assert out["flag"] is True
    assert "CPU build" in out["r"]["ok"]["paddle"] and "no device allocator" in out["r"]["ok"]["paddle"]
    assert out["sum"] == 8.0


# ------------------------------------------------------------------------------- late calls
def test_paddle_after_first_allocation_raises_and_switches_nothing():
    out = run("""
        import paddle
        x = paddle.ones([16])  # the allocator facade exists now (its host statistics show it)
        r = switch()
        flag = paddle.get_flags(["FLAGS_use_cuda_malloc_async_allocator"])["FLAGS_use_cuda_malloc_async_allocator"]
        print(json.dumps({"r": r, "flag": flag, "env": env()}))
    """)
    assert "error" in out["r"]
    msg = out["r"]["error"]
    assert "too late" in msg and "host" in msg and "use_cuda_malloc_async_allocator()" in msg
    assert out["flag"] is False
    # no half switch: torch was switchable but must not have been switched
    assert out["env"] == {"PYTORCH_CUDA_ALLOC_CONF": None, "PYTORCH_ALLOC_CONF": None,
                          "FLAGS_use_cuda_malloc_async_allocator": None}


def test_order_rule_cpu_torch_imported_without_async_conf_raises_and_switches_nothing():
    # A CUDA build fixes its allocator backend at `import torch`; this CPU build has none, so the
    # rule is checked against the environment torch was imported with.
    out = run("""
        import torch
        r = switch()
        print(json.dumps({"r": r, "env": env(), "paddle_imported": "paddle" in sys.modules}))
    """)
    assert "error" in out["r"]
    msg = out["r"]["error"]
    assert "torch" in msg and "too late" in msg and "before `import torch`" in msg
    assert out["env"] == {"PYTORCH_CUDA_ALLOC_CONF": None, "PYTORCH_ALLOC_CONF": None,
                          "FLAGS_use_cuda_malloc_async_allocator": None}  # Paddle untouched too


def test_torch_imported_with_async_conf_is_accepted():
    out = run("""
        import torch
        r = switch(frameworks=["torch"])
        print(json.dumps({"r": r, "cuda_build": torch.backends.cuda.is_built()}))
    """, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    assert "ok" in out["r"], out["r"]
    # a CPU build has no allocator to switch; a CUDA build (GPU or not) loaded the async backend at import
    expected = "already active (torch allocator backend cudaMallocAsync)" if out["cuda_build"] else "CPU build"
    assert expected in out["r"]["ok"]["torch"]


# ------------------------------------------------------------------------------- conflicts
@pytest.mark.parametrize("var,value,needle", [
    ("PYTORCH_CUDA_ALLOC_CONF", "backend:native", "backend:native"),
    ("PYTORCH_ALLOC_CONF", "expandable_segments:True,backend:native", "backend:native"),
    ("FLAGS_allocator_strategy", "naive_best_fit", "auto_growth"),
    ("FLAGS_use_cuda_managed_memory", "1", "managed memory"),
    ("FLAGS_use_system_allocator", "true", "system allocator"),
    ("FLAGS_use_cuda_malloc_async_allocator", "0", "off"),
])
def test_conflicting_setting_raises_and_changes_nothing(var, value, needle):
    out = run("""
        before = env()
        r = switch()
        print(json.dumps({"r": r, "same": env() == before}))
    """, **{var: value})
    assert "error" in out["r"], out["r"]
    assert needle in out["r"]["error"]
    assert out["same"]


def test_conflicting_paddle_setting_after_import_raises():
    out = run("""
        import paddle
        r = switch()
        print(json.dumps({"r": r, "env": env()}))
    """, FLAGS_allocator_strategy="naive_best_fit")
    assert "error" in out["r"] and "naive_best_fit" in out["r"]["error"]
    assert out["env"]["PYTORCH_CUDA_ALLOC_CONF"] is None


# --------------------------------------------------------------------------- the env switch
@pytest.mark.slow  # imports both frameworks in a fresh interpreter
def test_env_flag_is_honoured_for_torch_and_paddle():
    out = run("""
        from paddle_graphpp.allocator import apply_env_switch, async_allocator_requested
        r = apply_env_switch()  # what `import paddle_graphpp` runs
        before = env()
        import torch, paddle
        from paddle_graphpp.allocator import async_allocator_active
        print(json.dumps({"r": r, "before": before, "requested": async_allocator_requested(),
                          "paddle_flag": paddle.get_flags(["FLAGS_use_cuda_malloc_async_allocator"])
                          ["FLAGS_use_cuda_malloc_async_allocator"],
                          "active": [async_allocator_active("torch"), async_allocator_active("paddle")]}))
    """, FLAGS_use_cuda_malloc_async_allocator="1")
    assert out["r"] is not None and set(out["r"]) == {"paddle", "torch"}
    assert out["before"]["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"
    assert out["requested"] is True
    assert out["paddle_flag"] is True
    assert out["active"] == [False, False]  # CPU builds: no device allocator to be active


def test_env_flag_unset_or_off_does_nothing():
    for value in (None, "0"):
        extra = {} if value is None else {"FLAGS_use_cuda_malloc_async_allocator": value}
        out = run("""
            from paddle_graphpp.allocator import apply_env_switch, async_allocator_requested
            print(json.dumps({"r": apply_env_switch(), "env": env(), "req": async_allocator_requested()}))
        """, **extra)
        assert out["r"] is None and out["req"] is False
        assert out["env"]["PYTORCH_CUDA_ALLOC_CONF"] is None


def _fresh(code: str, **env_vars) -> dict:
    """Like run(), without the prelude (which imports paddle_graphpp first)."""
    env = {k: v for k, v in os.environ.items() if k not in _CLEAR}
    env.update(env_vars)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_env_flag_applies_when_paddle_graphpp_is_imported_before_torch():
    out = _fresh("""
        import json, os, sys
        import paddle_graphpp
        seen = "torch" in sys.modules
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        print(json.dumps({"conf": conf, "torch_imported": seen}))
    """, FLAGS_use_cuda_malloc_async_allocator="1")
    assert out == {"conf": "backend:cudaMallocAsync", "torch_imported": False}


def test_env_flag_too_late_warns_instead_of_failing_import():
    out = _fresh("""
        import json, os, warnings
        warnings.simplefilter("always")
        import torch
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import paddle_graphpp  # applies the environment switch on import
        print(json.dumps({"warnings": [str(x.message) for x in w],
                          "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}))
    """, FLAGS_use_cuda_malloc_async_allocator="1")
    assert any("too late" in m and "torch" in m for m in out["warnings"]), out["warnings"]
    assert out["conf"] is None


def test_env_flag_with_a_bad_value_warns():
    out = run("""
        from paddle_graphpp.allocator import apply_env_switch
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            r = apply_env_switch()
        print(json.dumps({"r": r, "warnings": [str(x.message) for x in w]}))
    """, FLAGS_use_cuda_malloc_async_allocator="maybe")
    assert out["r"] is None and any("'maybe'" in m and "use 1 or 0" in m for m in out["warnings"])


# ------------------------------------------------------------------------- argument checks
def test_unknown_framework_lists_the_choices():
    from paddle_graphpp.allocator import async_allocator_active, use_cuda_malloc_async_allocator

    with pytest.raises(ValueError, match=r"tensorflow.*choose from \['paddle', 'torch'\]"):
        use_cuda_malloc_async_allocator(frameworks=["tensorflow"])
    with pytest.raises(ValueError, match="choose from"):
        async_allocator_active("jax")
    with pytest.raises(ValueError, match="choose from"):
        use_cuda_malloc_async_allocator(frameworks=[])


def test_merge_async_backend_keeps_options_and_rejects_other_backends():
    from paddle_graphpp.allocator import AllocatorSwitchError
    from paddle_graphpp.torch.memory.allocator import merge_async_backend

    assert merge_async_backend(None) == "backend:cudaMallocAsync"
    assert merge_async_backend("") == "backend:cudaMallocAsync"
    assert merge_async_backend("expandable_segments:True,") == "expandable_segments:True,backend:cudaMallocAsync"
    assert merge_async_backend("backend:cudaMallocAsync,max_split_size_mb:64") == \
        "backend:cudaMallocAsync,max_split_size_mb:64"
    with pytest.raises(AllocatorSwitchError, match="backend:native"):
        merge_async_backend("max_split_size_mb:64 backend:native")


# ------------------------------------------------------------------------------- memory modes
def test_memory_mode_parse_accepts_names_and_members():
    from paddle_graphpp import MemoryMode

    assert MemoryMode.parse("shared") is MemoryMode.SHARED
    assert MemoryMode.parse("shared_reuse") is MemoryMode.SHARED  # the former name of shared's buffer reuse
    assert MemoryMode.parse("per_graph") is MemoryMode.PER_GRAPH
    assert MemoryMode.parse(MemoryMode.PER_GRAPH) is MemoryMode.PER_GRAPH


@pytest.mark.parametrize("bad", ["Shared", "pool", "", None, 3])
def test_memory_mode_invalid_names_list_the_choices(bad):
    from paddle_graphpp import MemoryMode

    with pytest.raises(ValueError) as err:
        MemoryMode.parse(bad, "my layer")
    msg = str(err.value)
    assert msg.startswith("my layer: memory=")
    for choice in ("'shared'", "'per_graph'"):
        assert choice in msg


def test_torch_module_memory_setting_is_validated_and_stored():
    torch = pytest.importorskip("torch")
    from paddle_graphpp import MemoryMode
    from paddle_graphpp.torch import CUDAGraphedModule

    assert CUDAGraphedModule(torch.nn.Linear(2, 2)).engine.memory_mode is MemoryMode.SHARED  # the default
    for mode in MemoryMode:
        assert CUDAGraphedModule(torch.nn.Linear(2, 2), memory=mode.value).engine.memory_mode is mode
    with pytest.raises(ValueError, match=r"CUDAGraphedModule\(Linear\): memory='separate'.*'per_graph'"):
        CUDAGraphedModule(torch.nn.Linear(2, 2), memory="separate")


def test_paddle_layer_memory_setting_is_validated_and_stored():
    paddle = pytest.importorskip("paddle")
    from paddle_graphpp import CUDAGraphedLayer, MemoryMode

    layer = CUDAGraphedLayer(paddle.nn.Linear(2, 2), memory="per_graph")
    assert layer.engine.memory_mode is MemoryMode.PER_GRAPH
    with pytest.raises(ValueError, match=r"memory='reuse'.*'shared', 'per_graph'"):
        CUDAGraphedLayer(paddle.nn.Linear(2, 2), memory="reuse")


def test_memory_report_is_empty_before_any_capture():
    out = run("""
        print(json.dumps({"report": paddle_graphpp.memory_report(), "torch": "torch" in sys.modules}))
    """)
    assert out == {"report": {}, "torch": False}
