"""Puts the repository root first on ``sys.path``: the tests import ``paddle_graphpp``, the test
support package ``testing`` (``testing.launch``, ``testing.parity``, ``testing.gpt_torch``: the
trainer's model) and the tools they test (``tools.train_gpt``, the benchmarks) from
this checkout, whichever way pytest was started."""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


import re  # noqa: E402

import pytest  # noqa: E402

# The frameworks a test module may need that an environment may lack on purpose (CI's
# framework-free step runs in a venv with neither).
_MISSING_FRAMEWORK = re.compile(r"No module named '(torch|paddle)'")
# Set (to 1) where the frameworks are absent on purpose: .ci/run's framework-free step only.
FRAMEWORK_FREE_ENV = "PADDLE_GRAPHPP_FRAMEWORK_FREE"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """With ``PADDLE_GRAPHPP_FRAMEWORK_FREE=1``, a test module that cannot be imported because
    torch or Paddle is not installed is reported as skipped ("needs torch"), not as a collection
    error, so the suite collects in an environment without a framework. Anywhere else that stays
    a collection error: the suite cannot shrink silently where a framework went missing by
    accident. Any other import error fails the collection everywhere."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get(FRAMEWORK_FREE_ENV) != "1" or not (report.failed and isinstance(collector, pytest.Module)):
        return
    missing = _MISSING_FRAMEWORK.search(str(report.longrepr))
    if missing:
        report.outcome = "skipped"
        report.longrepr = (str(collector.path), None, f"Skipped: needs {missing.group(1)}, which is not installed")


@pytest.fixture
def rt():
    """A fresh fake graph runtime (unittests/fake_runtime.py: capture and replay only keep the
    books), with no pool plan or capture process left from another test."""
    from fake_runtime import FakeGraphRuntime
    from paddle_graphpp.core.process import current_process

    runtime = FakeGraphRuntime()
    current_process().reset(runtime.name)
    yield runtime
    current_process().reset(runtime.name)


@pytest.fixture
def capturing_torch(monkeypatch):
    """A fake graph runtime registered as "torch" that captures CPU tensors (it runs the captured
    code once and replays only in its books: the lifecycle's bookkeeping, never a capture), with
    ``torch.cuda.synchronize`` a no-op."""
    import torch
    from fake_runtime import FakeGraphRuntime
    from paddle_graphpp.core import runtime as runtime_mod

    class OnCpu(FakeGraphRuntime):
        def graphs_unavailable_reason(self, tensors):
            return None

    runtime = OnCpu()
    runtime_mod.register_runtime("torch", lambda: runtime)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    yield runtime
    runtime_mod.unregister_runtime("torch")


@pytest.fixture(autouse=True)
def _no_capacity_mode_outlives_its_test():
    """Every optimizer step in a process reads the counters of every model in a checked capacity
    mode (paddle_graphpp.torch.moe), and a captured step refuses while one is alive. A test's
    model kept alive by a reference cycle would reach into later tests, so each mode a test made
    is undone after it."""
    yield
    moe = sys.modules.get("paddle_graphpp.torch.moe")
    if moe is not None:
        for mode in list(moe._watch().modes):
            mode.undo()
