"""The core bookkeeping tests, over the framework of ``nofw.py`` (numpy only): they run with
neither torch nor paddle installed (``.ci/run`` runs them so, in a plain venv, first).

The ``rt`` fixture here replaces the torch fake runtime of ``unittests/conftest.py`` for the
tests in this folder."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
for path in (HERE, os.path.dirname(HERE)):  # nofw.py, and the shared fake_graphs.py
    if path not in sys.path:
        sys.path.insert(0, path)

import nofw  # noqa: E402
from paddle_graphpp.core.process import current_process  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_process():
    """No pool plan or capture side left from another test; the same random numbers each test."""
    nofw.manual_seed(0)
    current_process().reset(nofw.PlainRuntime.name)
    yield
    current_process().reset(nofw.PlainRuntime.name)


@pytest.fixture
def rt():
    """The runtime with the capabilities PyTorch's has (split backward, accumulation in graphs)."""
    return nofw.NoFrameworkRuntime()


@pytest.fixture(params=["capabilities", "required-only"])
def any_rt(request):
    """Each runtime: with capabilities, and with the required protocol only."""
    return nofw.NoFrameworkRuntime() if request.param == "capabilities" else nofw.PlainRuntime()
