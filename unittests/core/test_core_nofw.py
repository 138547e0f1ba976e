"""The numpy framework of ``nofw.py`` itself: its gradients are right, and it and the engine over
it never import (nor try to import) torch or paddle."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import nofw
from paddle_graphpp.core.runtime import get_runtime

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def test_gradients_match_finite_differences():
    lin = nofw.Linear(4, 3)
    x = nofw.randn(2, 4, requires_grad=True)
    scale = nofw.randn(3)

    def f(xa, wa):
        return float((np.tanh(xa @ wa + lin.bias.array) * scale.array * 2.0 - xa.sum()).mean())

    loss = ((lin(x).tanh() * scale * 2.0) - x.sum()).mean()
    nofw.backward(loss)
    for tensor, other, wrt_x in ((x, lin.weight, True), (lin.weight, x, False)):
        base = tensor.array.astype(np.float64)
        numeric = np.zeros_like(base)
        for i in np.ndindex(base.shape):
            up, down = base.copy(), base.copy()
            up[i] += 1e-3
            down[i] -= 1e-3
            args = ((up, other.array), (down, other.array)) if wrt_x else ((other.array, up), (other.array, down))
            numeric[i] = (f(*args[0]) - f(*args[1])) / 2e-3
        np.testing.assert_allclose(tensor.grad.array, numeric, rtol=1e-3, atol=1e-4)
    # grad() returns without touching .grad; a second pass through a freed graph is refused
    y = (x * 3.0).sum()
    (g,) = nofw.grad(y, [x], retain_graph=True)
    np.testing.assert_array_equal(g.array, np.full((2, 4), 3.0, dtype=np.float32))
    nofw.grad(y, [x])
    try:
        nofw.grad(y, [x])
    except RuntimeError as exc:
        assert "second time" in str(exc)
    else:
        raise AssertionError("a freed graph ran again")


def test_neither_nofw_nor_the_engine_over_it_imports_a_framework():
    # In a fresh interpreter, so that no other test's import counts; every attempt to import
    # torch or paddle is noted, even one that would be caught.
    code = textwrap.dedent("""
        import json, sys

        attempts = []

        class Watch:
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in ("torch", "paddle"):
                    attempts.append(name)
                return None

        sys.meta_path.insert(0, Watch())
        import nofw
        import paddle_graphpp
        from paddle_graphpp.core.engine import Phase
        from paddle_graphpp.core.memory import memory_report

        rt = nofw.NoFrameworkRuntime()
        layer = nofw.Graphed(nofw.Linear(4, 3), rt, num_warmup_steps=1)
        for _ in range(4):
            outs = [layer(nofw.randn(2, 4, requires_grad=True)) for _ in range(2)]
            for out in outs:
                nofw.backward(out.sum())
        split = nofw.Graphed(nofw.Linear(4, 3), rt, num_warmup_steps=0)
        for _ in range(3):  # input passes, then weight passes: split backwards, recorded and captured
            x = nofw.randn(2, 4, requires_grad=True)
            loss = split(x).sum()
            nofw.backward(loss, inputs=[x], retain_graph=True)
            nofw.weight_pass(loss, split.parameters())
        assert split.engine.position_kinds() == {"full": 0, "split": 1}, split.engine.position_kinds()
        assert layer.engine.phase() is Phase.READY and layer.engine.replays == 8, layer.engine.replays
        assert memory_report()["nofw"]["graphs_captured"] == 4 + 3
        loaded = sorted(m for m in sys.modules if m.partition(".")[0] in ("torch", "paddle"))
        print(json.dumps({"attempts": attempts, "loaded": loaded}))
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.dirname(HERE), HERE, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found == {"attempts": [], "loaded": []}


@pytest.mark.skipif(any(importlib.util.find_spec(name) is not None for name in ("torch", "paddle")),
                    reason="needs an environment without torch and paddle (the plain venv step of .ci/run)")
def test_a_missing_framework_is_named_with_what_to_install():
    for name, install in (("torch", "install torch"), ("paddle", r"install paddlepaddle-gpu \(or paddlepaddle")):
        with pytest.raises(ImportError, match=f"the {name} support needs {name}, which is not installed; {install}"):
            get_runtime(name)
