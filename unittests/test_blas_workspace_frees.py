"""Which captures free torch's cuBLAS workspaces (``TorchMemory.blas_workspace_frees``): the
bookkeeping, on the CPU. That the frees keep graphs right and the pool free of workspaces is
``unittests/gpu/test_blas_workspace_gpu.py``."""
import pytest

torch = pytest.importorskip("torch")

from paddle_graphpp.torch.runtime import TorchRuntime  # noqa: E402


class _Pool:
    """Stands in for a ``torch.cuda.MemPool`` (which needs a GPU): hashable, weakly referable."""


@pytest.fixture
def runtime(monkeypatch):
    monkeypatch.delenv("FLAGS_graphpp_free_blas_workspaces", raising=False)
    return TorchRuntime()


def test_shared_pools_free_before_and_after_until_a_pool_of_one_graph_keeps_its_workspace(runtime):
    shared, own = _Pool(), _Pool()
    runtime._shared_pools.add(shared)
    assert runtime.blas_workspace_frees(shared) == (True, True)
    assert runtime.blas_workspace_frees(shared) == (True, True)
    assert runtime.blas_workspace_frees(own) == (True, False)  # its workspace is made in its own pool, and kept
    assert runtime.blas_workspace_frees(shared) == (False, False)  # nothing frees it from now on
    assert runtime.blas_workspace_frees(None) == (False, False)


def test_a_capture_into_a_pool_of_its_own_stops_the_frees_too(runtime):
    assert runtime.blas_workspace_frees(None) == (True, False)
    shared = _Pool()
    runtime._shared_pools.add(shared)
    assert runtime.blas_workspace_frees(shared) == (False, False)


def test_the_flag_off_keeps_torchs_workspaces_from_the_start(runtime, monkeypatch):
    monkeypatch.setenv("FLAGS_graphpp_free_blas_workspaces", "0")
    shared = _Pool()
    runtime._shared_pools.add(shared)
    assert runtime.blas_workspace_frees(shared) == (False, False)


def test_a_bad_flag_value_is_named(runtime, monkeypatch):
    monkeypatch.setenv("FLAGS_graphpp_free_blas_workspaces", "sometimes")
    with pytest.raises(ValueError, match="FLAGS_graphpp_free_blas_workspaces"):
        runtime.blas_workspace_frees(None)


def test_the_lender_frees_only_while_captures_do(runtime, monkeypatch):
    calls = []
    monkeypatch.setattr("paddle_graphpp.torch.memory.capabilities.free_blas_workspaces", lambda: calls.append(1))
    shared = _Pool()
    runtime._shared_pools.add(shared)
    runtime.blas_workspace_frees(shared)
    runtime.free_blas_workspaces_if_on()
    assert calls == [1]
    runtime.blas_workspace_frees(None)
    runtime.free_blas_workspaces_if_on()
    assert calls == [1]


@pytest.mark.parametrize("flag, frees", [(None, 1), ("1", 1), ("0", 0)])
def test_a_step_borrowing_before_any_capture_of_this_runtime_frees_as_the_flag_says(runtime, monkeypatch, flag, frees):
    """The flag decides for a borrowed step too when it asks first (state reset since the pool
    was lent): the workspace the step made in the pool is freed by default, not taken for a leak
    that drops the pool's graphs."""
    if flag is not None:
        monkeypatch.setenv("FLAGS_graphpp_free_blas_workspaces", flag)
    calls = []
    monkeypatch.setattr("paddle_graphpp.torch.memory.capabilities.free_blas_workspaces", lambda: calls.append(1))
    runtime.free_blas_workspaces_if_on()
    assert len(calls) == frees
