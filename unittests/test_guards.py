"""sot_warmup_guard / in_sot_warmup_mode / compile_in_warmup, and the compile-before-capture trap.

The trap needs the compilers' guard-skipping fast paths (SOT_UNSAFE_CACHE_FASTPATH=1 in
Paddle, set_stance(skip_guard_eval_unsafe=True) in PyTorch): with their guards evaluated,
both recompile when the capture state changes, which the tests also show.
"""

import os
import subprocess
import sys
import textwrap
import itertools
import threading

import pytest

from paddle_graphpp.core.collectives import capture_custom_allreduce, in_capture_phase
from paddle_graphpp.core.guards import compile_in_warmup, in_sot_warmup_mode, sot_warmup_guard, warmup_epoch

_COPIES = itertools.count()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_context_manager_nesting_restores_outer_state():
    assert not in_sot_warmup_mode()
    with sot_warmup_guard(True):
        assert in_sot_warmup_mode()
        with sot_warmup_guard(False):
            assert not in_sot_warmup_mode()
            with sot_warmup_guard(True):
                assert in_sot_warmup_mode()
            assert not in_sot_warmup_mode()
        assert in_sot_warmup_mode()
    assert not in_sot_warmup_mode()


def test_decorator_and_recursion():
    seen = []

    @sot_warmup_guard(True)
    def capture(depth):
        seen.append(in_sot_warmup_mode())
        if depth:
            capture(depth - 1)
        seen.append(in_sot_warmup_mode())

    capture(2)
    assert seen == [True] * 6
    assert not in_sot_warmup_mode()


def test_state_is_thread_local():
    other = []
    with sot_warmup_guard(True):
        t = threading.Thread(target=lambda: other.append(in_sot_warmup_mode()))
        t.start()
        t.join()
        assert in_sot_warmup_mode()
    assert other == [False]


def test_exception_leaves_state_clean():
    with pytest.raises(KeyError):
        with sot_warmup_guard(True):
            raise KeyError("boom")
    assert not in_sot_warmup_mode()


def test_rejects_non_bool_and_out_of_order_exit():
    with pytest.raises(TypeError, match="takes a bool"):
        sot_warmup_guard(1)
    a, b = sot_warmup_guard(True), sot_warmup_guard(False)
    a.__enter__()
    b.__enter__()
    with pytest.raises(RuntimeError, match="out of order"):
        a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    a.__exit__(None, None, None)
    assert not in_sot_warmup_mode()


def test_epoch_changes_only_when_entering_from_outside():
    with sot_warmup_guard(True):
        first = warmup_epoch()
        with sot_warmup_guard(True):
            assert warmup_epoch() == first
    with sot_warmup_guard(True):
        assert warmup_epoch() > first


def test_compile_in_warmup_defers_and_recompiles_per_warmup():
    compiled = []

    def compiler(fn):
        compiled.append(in_capture_phase())
        return lambda x: ("compiled", fn(x))

    f = compile_in_warmup(lambda x: x + 1, compiler)
    assert f(1) == 2 and compiled == []            # eager before any warmup
    with capture_custom_allreduce(), sot_warmup_guard(True):
        assert f(1) == ("compiled", 2)
        assert f(1) == ("compiled", 2)
    assert compiled == [True]                      # once, inside the capture phase
    assert f(1) == ("compiled", 2)                 # later calls reuse it
    with sot_warmup_guard(True):
        f(1)
    assert len(compiled) == 2                      # a new warmup compiles afresh




PADDLE_DEMO = textwrap.dedent("""
    import json, sys
    import paddle
    from paddle_graphpp.core.collectives import capture_custom_allreduce, in_capture_phase
    from paddle_graphpp.core.guards import compile_in_warmup, sot_warmup_guard

    # two copies of one forward: SOT (and dynamo) cache compiled code per code object
    def forward_a(x):
        y = x * 2 + 1
        if in_capture_phase():
            return y + 100      # the branch a capture must record
        return y - 100          # the warmup branch

    def forward_b(x):
        y = x * 2 + 1
        if in_capture_phase():
            return y + 100
        return y - 100

    x = paddle.ones([4])
    out = {}
    # 1. compiled (and warmed) before the capture phase
    f = paddle.jit.to_static(forward_a, full_graph=False)
    for _ in range(40):
        f(x)
    with capture_custom_allreduce(), sot_warmup_guard(True):
        out["compiled_before"] = float(f(x)[0])
    # 2. the guard's way: compile deferred to the warmup inside the capture phase
    g = compile_in_warmup(forward_b, lambda fn: paddle.jit.to_static(fn, full_graph=False))
    for _ in range(40):
        g(x)                                   # eager: nothing compiled yet
    with capture_custom_allreduce(), sot_warmup_guard(True):
        out["compiled_in_warmup"] = float(g(x)[0])
        for _ in range(40):
            g(x)
        out["replayed_in_phase"] = float(g(x)[0])
    json.dump(out, sys.stdout)
""")


@pytest.mark.parametrize("fastpath", ["1", "0"])
def test_paddle_to_static_compiled_before_capture_keeps_warmup_branch(fastpath):
    env = dict(os.environ, SOT_UNSAFE_CACHE_FASTPATH=fastpath, MIN_GRAPH_SIZE="0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), GLOG_v="0")
    proc = subprocess.run([sys.executable, "-c", PADDLE_DEMO], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    capture, warmup = 3.0 + 100, 3.0 - 100
    if fastpath == "1":
        # the failure mode: the guard-free fast path replays the warmup branch in the capture phase
        assert out["compiled_before"] == warmup
    else:
        # with its guards evaluated, SOT retraces: the trap needs the fast path
        assert out["compiled_before"] == capture
    # the fix holds either way
    assert out["compiled_in_warmup"] == capture
    assert out["replayed_in_phase"] == capture


def test_torch_compile_compiled_before_capture():
    torch = pytest.importorskip("torch")

    def make():
        # exec gives each copy its own code object: dynamo caches compiled code per code object
        ns = {"in_capture_phase": in_capture_phase}
        exec(compile("def forward(x):\n    y = x * 2 + 1\n    if in_capture_phase():\n"
                     "        return y + 100\n    return y - 100\n", f"<forward{next(_COPIES)}>", "exec"), ns)
        return ns["forward"]

    x = torch.ones(4)
    capture, warmup = 103.0, -97.0
    # default stance: dynamo guards on the global state and recompiles (no trap)
    torch._dynamo.reset()
    f = torch.compile(make(), backend="eager")
    f(x)
    with capture_custom_allreduce():
        assert f(x)[0].item() == capture
    # guard evaluation skipped (the serving fast path): the compiled-before code is frozen
    torch._dynamo.reset()
    f = torch.compile(make(), backend="eager")
    f(x)
    f(x)
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        with capture_custom_allreduce():
            assert f(x)[0].item() == warmup
    # the fix: compile inside the capture phase's warmup, then run with guards skipped
    g = compile_in_warmup(make(), lambda fn: torch.compile(fn, backend="eager"))
    assert g(x)[0].item() == warmup                # eager outside the phase, nothing compiled
    with capture_custom_allreduce(), sot_warmup_guard(True):
        assert g(x)[0].item() == capture
        g(x)
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True), capture_custom_allreduce():
        assert g(x)[0].item() == capture
    torch._dynamo.reset()
