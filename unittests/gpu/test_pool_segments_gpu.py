"""Graph pools as one expandable range (``FLAGS_graphpp_pool_expandable``) on a real GPU.

Run on the GPU machine: ``python -m pytest unittests/gpu/test_pool_segments_gpu.py -q``.
Skipped without CUDA, and where the user's own allocator settings already turn expandable
segments on everywhere (nothing would be left to check).
"""
import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires a CUDA device")

from paddle_graphpp.torch.graphs import gc_paused  # noqa: E402
from paddle_graphpp.torch.memory import pool_segments  # noqa: E402
from paddle_graphpp.torch.runtime import RUNTIME  # noqa: E402

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _own_settings():
    if pool_segments._user_setting_on():
        pytest.skip("expandable segments are on everywhere in this process's allocator settings")
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _is_expandable(pool) -> bool:
    """Whether ``pool`` holds memory and all of it is in expandable segments."""
    segments = pool.snapshot()
    return bool(segments) and all(seg.get("is_expandable", False) for seg in segments)


def _segment_of(ptr: int) -> dict:
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg
    raise AssertionError(f"no segment holds {ptr:#x}")


def _capture(pool):
    """A graph whose capture allocates temporaries of several sizes into ``pool``."""
    x = torch.randn(256, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")
    torch.relu(x @ w)  # cuBLAS sets itself up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with RUNTIME.capture_to_graph(graph, pool):
        big = torch.empty(48 * MIB, dtype=torch.uint8, device="cuda")  # freed inside the capture
        y = torch.relu(x @ w) + big[:4].float().sum() * 0
        del big
    return graph, x, w, y


def test_captures_map_the_pool_as_one_range_and_the_default_cache_keeps_its_setting(monkeypatch):
    monkeypatch.delenv(pool_segments.FLAG, raising=False)  # the default
    pool = RUNTIME.new_pool()
    graph, x, w, y = _capture(pool)
    assert _is_expandable(pool), pool.snapshot()
    after = torch.empty(30 * MIB, dtype=torch.uint8, device="cuda")  # outside any window
    assert not _segment_of(after.data_ptr()).get("is_expandable", False)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, torch.relu(x @ w))
    del graph, y, after


def test_with_the_flag_off_the_pool_is_made_of_ordinary_segments(monkeypatch):
    monkeypatch.setenv(pool_segments.FLAG, "0")
    pool = RUNTIME.new_pool()
    graph, x, w, y = _capture(pool)
    assert pool.snapshot() and not any(seg.get("is_expandable", False) for seg in pool.snapshot())
    del graph, y


def test_a_request_larger_than_every_free_block_maps_only_what_is_missing(monkeypatch):
    """100 MiB then 60 MiB, the 60 freed: a second 100 MiB request fits no free block. An
    ordinary pool adds a 100 MiB segment (260 MiB in all); the expandable range extends its free
    60 MiB at the end by 40 (200 MiB in all)."""
    monkeypatch.delenv(pool_segments.FLAG, raising=False)
    side = torch.cuda.Stream()
    pool = torch.cuda.MemPool()

    def reserved():
        return sum(seg["total_size"] for seg in pool.snapshot())

    with gc_paused(), torch.cuda.stream(side), torch.cuda.use_mem_pool(pool), pool_segments.pool_allocations():
        a = torch.empty(100 * MIB, dtype=torch.uint8, device="cuda")
        b = torch.empty(60 * MIB, dtype=torch.uint8, device="cuda")
        del b
        assert reserved() == 160 * MIB
        c = torch.empty(100 * MIB, dtype=torch.uint8, device="cuda")
        assert c.data_ptr() == a.data_ptr() + 100 * MIB  # where the freed 60 MiB began
        assert reserved() == 200 * MIB, pool.snapshot()
    del a, c
    side.synchronize()


def _splits_an_oversize_block() -> bool:
    """Whether a 280 MiB request takes the front of a free 300 MiB block. With
    ``max_split_size_mb:256`` it does not (an oversize block serves only requests within 20 MiB
    of its size); without that setting it does."""
    torch.cuda.empty_cache()
    big = torch.empty(300 * MIB, dtype=torch.uint8, device="cuda")
    ptr = big.data_ptr()
    del big
    other = torch.empty(280 * MIB, dtype=torch.uint8, device="cuda")
    split = other.data_ptr() == ptr
    del other
    torch.cuda.empty_cache()
    return split


def test_the_allocators_other_settings_survive_a_window(monkeypatch):
    """PyTorch resets max_split_size_mb (and two others) to its default whenever new settings leave
    it out: the window passes them along, so a capture leaves the program's settings in force."""
    monkeypatch.delenv(pool_segments.FLAG, raising=False)
    before = pool_segments._settings()
    # as if the process had started with it (PyTorch read it then: set it as it would have)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:256")
    pool_segments._set(pool_segments.with_expandable("max_split_size_mb:256", False))
    try:
        assert not _splits_an_oversize_block()  # the setting is in force
        pool = RUNTIME.new_pool()
        graph, x, w, y = _capture(pool)
        assert _is_expandable(pool)
        assert not _splits_an_oversize_block()  # and still after the window
        after = torch.empty(30 * MIB, dtype=torch.uint8, device="cuda")
        assert not _segment_of(after.data_ptr()).get("is_expandable", False)
        del graph, y, after
    finally:
        pool_segments._set(pool_segments.with_expandable(before, False))
    assert _splits_an_oversize_block()  # without the setting the same requests split the block


def test_a_borrowed_step_whose_window_cannot_open_leaves_the_pool_and_the_stream(monkeypatch):
    """An optimizer step that would borrow the pool, with the flag set to a bad value: the step
    raises the flag's error, and neither the capture stream nor the routing into the pool is
    left behind; with the flag mended the next step borrows."""
    from paddle_graphpp.torch.memory import pool_lending

    monkeypatch.delenv(pool_segments.FLAG, raising=False)
    if RUNTIME._lender is not None:  # the process's own lender (earlier tests' pools) would take these steps too
        monkeypatch.setattr(RUNTIME._lender, "disabled", True)
    side = torch.cuda.Stream()
    pool = torch.cuda.MemPool()
    with gc_paused(), torch.cuda.stream(side), torch.cuda.use_mem_pool(pool), pool_segments.pool_allocations():
        room = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
        del room  # free in the pool: the step's temporaries fit
    side.synchronize()
    p = torch.nn.Parameter(torch.zeros(MIB, device="cuda"))
    opt = torch.optim.Adam([p])
    p.grad = torch.ones_like(p)
    opt.step()  # the state exists before lending begins
    lender = pool_lending.PoolLender(lambda: side)
    lender.lend(pool, lambda: True, lambda: None)
    try:
        in_pool = pool_lending._allocated(pool)
        monkeypatch.setenv(pool_segments.FLAG, "bogus")
        with pytest.raises(ValueError, match=pool_segments.FLAG):
            opt.step()
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        outside = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
        assert pool_lending._allocated(pool) == in_pool  # not routed into the pool
        del outside
        monkeypatch.delenv(pool_segments.FLAG)
        opt.step()
        assert lender.steps == 1 and torch.cuda.current_stream() == torch.cuda.default_stream()
    finally:
        lender.abandon_step()
        for handle in lender._handles:
            handle.remove()
