"""Puts the repository root first on ``sys.path``: the tests import ``paddle_graphpp``, the test
support package ``testing`` (``testing.launch``, ``testing.parity``) and the tools they test
(``tools.train_gpt``, the benchmarks) or run (``tools.gpt_torch``, the trainer's model) from
this checkout, whichever way pytest was started."""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


import pytest  # noqa: E402


@pytest.fixture
def rt():
    """A fresh fake graph runtime (unittests/fake_runtime.py: capture and replay only keep the
    books), with no pool plan or capture process left from another test."""
    from fake_runtime import FakeGraphRuntime
    from paddle_graphpp.core import capture as capture_mod
    from paddle_graphpp.core import memory as memory_mod

    runtime = FakeGraphRuntime()
    for table in (memory_mod._PLANS, capture_mod._PROCESSES):
        table.pop(runtime.name, None)
    yield runtime
    for table in (memory_mod._PLANS, capture_mod._PROCESSES):
        table.pop(runtime.name, None)
