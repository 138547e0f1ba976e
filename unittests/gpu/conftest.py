"""Shared by the GPU tests (each skips itself without CUDA).

``GRAPHPP_PROBE_ALLOCATOR=1`` checks after every test that no allocation routing into a graph
pool was left on. A new allocation of the thread must land in the default pool (else the test
errors, naming the pool): that finds routing of eager work (a borrowed optimizer step left
open); a failed capture's routing matches only its capturing stream, so then a fresh
``MemPool`` is destroyed, whose destructor asserts, and aborts the process, while any capture or
routing is underway (``captures_underway``). The test named on stderr just before such an abort
is the one that left it.

Tests marked ``two_gpus`` skip themselves on a machine with fewer than two CUDA devices;
``pytest unittests/gpu -m two_gpus`` runs those alone.

Every GPU test runs PyTorch (the engine is proven on GPUs through the PyTorch runtime). Where
torch is not installed (CI's framework-free step) each GPU test module is reported as skipped
(``unittests/conftest.py``) and the hooks here do nothing.
"""
import importlib.util
import os
import sys

import pytest

_HAS_TORCH = importlib.util.find_spec("torch") is not None


def pytest_collection_modifyitems(config, items):
    if not _HAS_TORCH:
        return  # no GPU test module could be imported
    import torch

    if torch.cuda.device_count() >= 2:
        return
    skip = pytest.mark.skip(reason="requires two CUDA devices")
    for item in items:
        if item.get_closest_marker("two_gpus") is not None:
            item.add_marker(skip)


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
def _nothing_left_in_flight():
    """A test that failed inside a step leaves its micro-batches in flight: later tests of the
    process would then never capture (the process-wide step never ends) and fail with it.
    Whatever a test leaves in flight is dropped after it."""
    yield
    import torch

    if torch.cuda.is_available():
        import paddle_graphpp

        paddle_graphpp.drop_in_flight()


@pytest.fixture(autouse=True)
def _allocator_probe(request):
    yield
    if os.environ.get("GRAPHPP_PROBE_ALLOCATOR") != "1":
        return
    import gc

    import torch

    if not torch.cuda.is_available():
        return
    gc.collect()
    torch.cuda.synchronize()
    routed = _routed_pool(torch)
    assert routed is None, (f"after {request.node.nodeid}: this thread's allocations still route into graph pool "
                            f"{routed} (a pool window left open)")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # to the terminal: an abort right after would lose it captured
        print(f"\n[allocator probe] a pool destroyed after {request.node.nodeid}", file=sys.stderr, flush=True)
    # A MemPool's destructor empties its cache, which asserts that no capture or pool routing is
    # on: with one left behind, the process aborts here, right after the test that left it.
    pool = torch.cuda.MemPool()
    del pool
    torch.cuda.empty_cache()


def _routed_pool(torch):
    """The pool a new allocation of this thread lands in, or None for the default one."""
    probe = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    address = probe.data_ptr()
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= address < seg["address"] + seg["total_size"]:
            pool = tuple(seg.get("segment_pool_id", (0, 0)))
            return None if pool == (0, 0) else pool
    return None


def pytest_runtest_logreport(report):
    """A failure's traceback printed as soon as the test ends, not in the summary at the end: a
    process that aborts later in the run (the caching allocator's assertions abort) would
    lose it."""
    if not report.failed or _config.get("config") is None:
        return
    reporter = _config["config"].pluginmanager.get_plugin("terminalreporter")
    text = getattr(report, "longreprtext", "") or str(report.longrepr)
    if reporter is not None and text:
        reporter.write_line(f"\n[failure, {report.when}] {report.nodeid}\n{text[-4000:]}")


_config: dict = {}


def pytest_configure(config):
    _config["config"] = config
