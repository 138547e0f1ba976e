"""FLAGS_graphpp_pool_expandable: the flag, the user's own allocator settings, and the window's
bookkeeping (nested windows switch the setting once). Whether the pool's memory really is
expandable, and what that does to a request, is the GPU test's
(unittests/gpu/test_pool_segments_gpu.py)."""
import pytest

from paddle_graphpp.torch import pool_segments


def test_a_bad_flag_value_names_the_flag_and_the_values(monkeypatch):
    monkeypatch.setenv(pool_segments.FLAG, "sometimes")
    with pytest.raises(ValueError, match="FLAGS_graphpp_pool_expandable='sometimes'.*1.*0"):
        pool_segments.enabled()


def test_the_users_setting_is_read_as_pytorch_reads_it(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    assert pool_segments._user_setting_on()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:128")  # read first by PyTorch >= 2.9
    assert not pool_segments._user_setting_on()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:false")
    assert not pool_segments._user_setting_on()


def test_nested_windows_switch_the_setting_on_once_and_off_at_the_outer_end(monkeypatch):
    calls = []
    monkeypatch.setattr(pool_segments, "enabled", lambda: True)
    monkeypatch.setattr(pool_segments, "_user_setting_on", lambda: False)
    monkeypatch.setattr(pool_segments, "_set", calls.append)
    with pool_segments.pool_allocations():
        with pool_segments.pool_allocations():  # a capture inside a borrowed step's window
            assert calls == [True]
        assert calls == [True]
    assert calls == [True, False]
    with pytest.raises(RuntimeError):
        with pool_segments.pool_allocations():
            raise RuntimeError("a failed capture")
    assert calls == [True, False, True, False] and pool_segments._DEPTH == 0


def test_nothing_is_switched_when_off_or_set_by_the_user(monkeypatch):
    calls = []
    monkeypatch.setattr(pool_segments, "_set", calls.append)
    monkeypatch.setenv(pool_segments.FLAG, "0")
    with pool_segments.pool_allocations():
        pass
    monkeypatch.setattr(pool_segments, "enabled", lambda: True)
    monkeypatch.setattr(pool_segments, "_user_setting_on", lambda: True)
    with pool_segments.pool_allocations():
        pass
    assert calls == []
