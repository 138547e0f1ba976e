"""FLAGS_graphpp_pool_expandable: the flag, the allocator settings in force, the settings string
the window passes to PyTorch, and the window's bookkeeping (nested windows switch once). Whether
the pool's memory really is expandable, what that does to a request, and that the allocator's
other settings survive a window are the GPU tests' (unittests/gpu/test_pool_segments_gpu.py)."""
import pytest
import torch

from paddle_graphpp.torch.memory import pool_segments
from paddle_graphpp.torch.memory.pool_segments import with_expandable


def test_a_bad_flag_value_names_the_flag_and_the_values(monkeypatch):
    monkeypatch.setenv(pool_segments.FLAG, "sometimes")
    with pytest.raises(ValueError, match="FLAGS_graphpp_pool_expandable='sometimes'.*1.*0"):
        pool_segments.enabled()


def test_the_settings_string_keeps_every_other_option_as_written():
    assert with_expandable("", True) == "expandable_segments:True"
    assert with_expandable("max_split_size_mb:128", True) == "max_split_size_mb:128,expandable_segments:True"
    # brackets with commas inside, the backend (fixed at load) dropped, an earlier value replaced
    conf = "backend:native,roundup_power2_divisions:[256:1,512:2],expandable_segments:False,garbage_collection_threshold:0.6"
    assert with_expandable(conf, True) == ("roundup_power2_divisions:[256:1,512:2],garbage_collection_threshold:0.6,"
                                           "expandable_segments:True")
    assert with_expandable(with_expandable(conf, True), False).endswith(",expandable_segments:False")


def test_the_users_setting_is_read_from_the_settings_in_force(monkeypatch):
    assert pool_segments._user_setting_on("max_split_size_mb:128,expandable_segments:True")
    assert not pool_segments._user_setting_on("expandable_segments:False")
    assert not pool_segments._user_setting_on("max_split_size_mb:128")
    assert not pool_segments._user_setting_on("expandable_segments:True,expandable_segments:False")  # the last wins
    # a torch that cannot tell (2.11): the environment it loaded; with both variables set,
    # PyTorch parses PYTORCH_CUDA_ALLOC_CONF only
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:128")
    assert pool_segments._settings() == "expandable_segments:True" and pool_segments._user_setting_on()
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert pool_segments._settings() == "max_split_size_mb:128" and not pool_segments._user_setting_on()


def test_a_torch_that_tells_its_settings_is_asked(monkeypatch):
    told = []
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: told[-1], raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    told.append("max_split_size_mb:64")  # set at run time: PyTorch's answer wins over the environment
    assert pool_segments._settings() == "max_split_size_mb:64" and not pool_segments._user_setting_on()


def test_nested_windows_switch_on_once_and_back_at_the_outer_end_keeping_other_settings(monkeypatch):
    calls = []
    monkeypatch.setattr(pool_segments, "enabled", lambda: True)
    monkeypatch.setattr(pool_segments, "_settings", lambda: "max_split_size_mb:128")
    monkeypatch.setattr(pool_segments, "_set", calls.append)
    on, off = "max_split_size_mb:128,expandable_segments:True", "max_split_size_mb:128,expandable_segments:False"
    with pool_segments.pool_allocations():
        with pool_segments.pool_allocations():  # a capture inside a borrowed step's window
            assert calls == [on]
        assert calls == [on]
    assert calls == [on, off]
    with pytest.raises(RuntimeError):
        with pool_segments.pool_allocations():
            raise RuntimeError("a failed capture")
    assert calls == [on, off, on, off] and pool_segments.windows().depth == 0


def test_nothing_is_switched_when_off_or_already_on_everywhere(monkeypatch):
    calls = []
    monkeypatch.setattr(pool_segments, "_set", calls.append)
    monkeypatch.setenv(pool_segments.FLAG, "0")
    with pool_segments.pool_allocations():
        pass
    monkeypatch.setattr(pool_segments, "enabled", lambda: True)
    monkeypatch.setattr(pool_segments, "_settings", lambda: "expandable_segments:True")
    with pool_segments.pool_allocations():
        pass
    assert calls == []


def test_a_failed_switch_leaves_no_window_open(monkeypatch):
    monkeypatch.setattr(pool_segments, "enabled", lambda: True)
    monkeypatch.setattr(pool_segments, "_settings", lambda: "")

    def refuse(settings):
        raise RuntimeError("the allocator refused " + settings)

    monkeypatch.setattr(pool_segments, "_set", refuse)
    with pytest.raises(RuntimeError, match="refused expandable_segments:True"):
        with pool_segments.pool_allocations():
            pass  # not reached
    assert pool_segments.windows().depth == 0 and pool_segments.windows().saved is None
    calls = []
    monkeypatch.setattr(pool_segments, "_set", calls.append)
    with pool_segments.pool_allocations():
        pass
    assert calls == ["expandable_segments:True", "expandable_segments:False"]


def test_a_failed_switch_back_keeps_the_bodys_error_and_closes_the_window(monkeypatch):
    monkeypatch.setattr(pool_segments, "enabled", lambda: True)
    monkeypatch.setattr(pool_segments, "_settings", lambda: "")
    calls = []

    def off_fails(settings):
        calls.append(settings)
        if settings.endswith("False"):
            raise RuntimeError("cannot switch back")

    monkeypatch.setattr(pool_segments, "_set", off_fails)
    with pytest.warns(RuntimeWarning, match="could not switch expandable segments back off"):
        with pytest.raises(ValueError, match="the capture's own error"):
            with pool_segments.pool_allocations():
                raise ValueError("the capture's own error")
    assert pool_segments.windows().depth == 0 and pool_segments.windows().saved is None
    with pytest.raises(RuntimeError, match="cannot switch back"):  # no error of its own: this one is raised
        with pool_segments.pool_allocations():
            pass
    assert pool_segments.windows().depth == 0 and pool_segments.windows().saved is None and len(calls) == 4


def test_the_cycle_collector_is_off_inside_a_routing_window_and_back_after_it():
    import gc

    from paddle_graphpp.torch.graphs import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer window is still open
    assert gc.isenabled()
    try:
        with gc_paused():
            raise ValueError("a failing capture")
    except ValueError:
        pass
    assert gc.isenabled()
    gc.disable()  # a program that runs without the collector keeps it off
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
