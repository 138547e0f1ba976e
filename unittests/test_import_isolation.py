"""Importing the package, its framework-neutral core, the allocator switch and the optimizer
dispatch imports neither torch nor paddle (DESIGN: the core knows no framework), and the core
does not reach back into the top-level modules (``paddle_graphpp.allocator``, ``.optim``).

Each check imports in a fresh interpreter and reads ``sys.modules`` there.
"""
import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "paddle_graphpp" / "core"
FRAMEWORKS = ("torch", "paddle")
TOP_LEVEL = ("paddle_graphpp.allocator", "paddle_graphpp.optim", "paddle_graphpp.graph_api", "paddle_graphpp.support")  # facades: no framework at import


def _modules_after(code: str, **env_vars) -> list:
    """``sorted(sys.modules)`` after running ``code`` in a clean interpreter."""
    env = {k: v for k, v in os.environ.items()
           if k != "FLAGS_use_cuda_malloc_async_allocator" and not k.startswith("PYTORCH_")}
    env.update(env_vars)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    script = textwrap.dedent(code) + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _frameworks_in(modules: list) -> list:
    return [m for m in modules if m.partition(".")[0] in FRAMEWORKS]


def _core_modules() -> list:
    return sorted(f"paddle_graphpp.core.{p.stem}" for p in CORE.glob("*.py") if p.stem != "__init__")


def _framework_free_lazy_names() -> list:
    """Top-level names whose defining module promises no framework import (core, allocator, optim)."""
    import paddle_graphpp

    free = ("paddle_graphpp.core.",) + TOP_LEVEL
    return sorted(name for name, module in paddle_graphpp._LAZY.items() if module.startswith(free))


def test_package_core_allocator_and_optim_import_no_framework():
    names = _framework_free_lazy_names()
    assert "graph_process" in names and "use_cuda_malloc_async_allocator" in names
    mods = _modules_after(f"""
        import importlib
        import paddle_graphpp, paddle_graphpp.allocator, paddle_graphpp.optim
        import paddle_graphpp.torch, paddle_graphpp.paddle  # packages: their names load lazily
        import paddle_graphpp.torch.memory.allocator, paddle_graphpp.paddle.memory.allocator
        for name in {_core_modules()!r}:
            importlib.import_module(name)
        for name in {names!r}:
            getattr(paddle_graphpp, name)
    """)
    assert _frameworks_in(mods) == []


def test_allocator_switch_imports_no_framework():
    # The switch must work before `import torch`: neither the environment flag applied at
    # package import nor the call may import a framework.
    mods = _modules_after("""
        import paddle_graphpp
        paddle_graphpp.use_cuda_malloc_async_allocator()
    """, FLAGS_use_cuda_malloc_async_allocator="1")
    assert _frameworks_in(mods) == []


def test_core_does_not_import_the_top_level_modules():
    mods = _modules_after("\n".join(f"import {name}" for name in _core_modules()))
    assert [m for m in mods if m in TOP_LEVEL] == []
    assert _frameworks_in(mods) == []


def test_core_sources_import_no_framework_even_lazily():
    # What the interpreter checks above misses: imports inside functions.
    for path in CORE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = "." * node.level + (node.module or "")
                sep = "." if node.module else ""
                targets = [base] * bool(node.module) + [f"{base}{sep}{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                assert target.partition(".")[0] not in FRAMEWORKS, f"{path.name}:{node.lineno} imports {target}"
                assert target not in ("..allocator", "..optim", *TOP_LEVEL), \
                    f"{path.name}:{node.lineno} imports {target}: the core must not depend on it"


def test_unknown_public_name_is_a_clear_attribute_error():
    import paddle_graphpp
    try:
        paddle_graphpp.NoSuchThing
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("expected AttributeError")
