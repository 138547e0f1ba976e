"""Shared by the GPU tests (each skips itself without CUDA).

``GRAPHPP_PROBE_ALLOCATOR=1`` empties the CUDA cache after every test. The caching allocator
asserts, and aborts the process, when its cache is emptied while an allocation routing into a
graph pool is still on (``captures_underway``), as a capture that failed without ending its
routing leaves it; the test named on stderr just before such an abort is the one that left it.
"""
import os
import sys

import pytest


@pytest.fixture
def fp32_exact():
    """TF32 off for the test: fp32 matmuls and convolutions, so graphed and eager runs compare
    to ~1e-6 (or bit for bit); the previous settings come back afterwards."""
    import torch

    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(autouse=True)
def _allocator_probe(request):
    yield
    if os.environ.get("GRAPHPP_PROBE_ALLOCATOR") != "1":
        return
    import gc

    import torch

    if not torch.cuda.is_available():
        return
    print(f"\n[allocator probe] emptying the cache after {request.node.nodeid}", file=sys.stderr, flush=True)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def pytest_runtest_logreport(report):
    """A failure's traceback printed as soon as the test ends, not in the summary at the end: a
    process that aborts later in the run (the caching allocator's assertions abort) would
    lose it."""
    if not report.failed:
        return
    reporter = _reporter.get("terminal")
    text = getattr(report, "longreprtext", "") or str(report.longrepr)
    if reporter is not None and text:
        reporter.write_line(f"\n[failure, {report.when}] {report.nodeid}\n{text[-4000:]}")


_reporter: dict = {}


def pytest_configure(config):
    _reporter["terminal"] = config.pluginmanager.getplugin("terminalreporter")
