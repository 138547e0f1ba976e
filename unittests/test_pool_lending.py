"""The PyTorch pool lender's decisions that need no GPU: whether an optimizer's temporaries fit
a pool's free blocks, and whether captures wait for an optimizer's first step."""
import weakref

import pytest
import torch

from paddle_graphpp.torch import pool_lending
from paddle_graphpp.torch.runtime import TorchRuntime

MIB = 1 << 20


def test_left_over_places_sizes_best_fit_with_splitting():
    free = [40 * MIB, 10 * MIB]
    assert pool_lending._left_over(free, [8 * MIB, 30 * MIB]) == 0  # 8 -> 10, 30 -> 40
    assert pool_lending._left_over(free, [30 * MIB, 9 * MIB, 9 * MIB]) == 0  # 40 split: 10 left
    assert pool_lending._left_over(free, [30 * MIB, 12 * MIB]) == 12 * MIB  # 40-30 = 10 < 12
    assert pool_lending._left_over(free, [64 * MIB]) == 64 * MIB
    assert pool_lending._left_over([], [MIB // 2, MIB]) == 0  # small requests are not counted


def test_rounded_counts_what_the_allocator_rounds_to():
    assert pool_lending._rounded(torch.empty(1, dtype=torch.uint8)) == 512
    assert pool_lending._rounded(torch.empty(256, dtype=torch.float32)) == 1024


@pytest.fixture
def fresh_watch(monkeypatch):
    monkeypatch.setattr(pool_lending, "_ANY_STEPPED", False)
    monkeypatch.setattr(pool_lending, "_STEPPED", weakref.WeakSet())
    monkeypatch.setattr(pool_lending, "_FOUND", weakref.WeakSet())
    TorchRuntime()  # installs the step watch (once per process)


def test_captures_wait_while_an_optimizer_exists_that_has_not_stepped(fresh_watch):
    import gc

    gc.collect()  # optimizers of earlier tests
    assert not pool_lending.optimizer_pending()
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([w])
    assert pool_lending.optimizer_pending()
    w.grad = torch.ones(4)
    opt.step()
    assert not pool_lending.optimizer_pending()
    assert pool_lending.stepped_param_bytes() == 512


@pytest.mark.parametrize("reserve", ["1", "0"])
def test_the_wait_for_a_first_step_does_not_depend_on_the_reserved_block(fresh_watch, monkeypatch, reserve):
    # The optimizer state its first step creates sits beside a pool captured before it, block or
    # no block (measured with the block off on 1F1B's last stage: +960 MiB on the capture step).
    import gc

    gc.collect()
    monkeypatch.setenv("FLAGS_graphpp_reserve_pool", reserve)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    rt = TorchRuntime()
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([w])
    assert rt.defer_capture() == "an optimizer has not stepped yet"
    w.grad = torch.ones(4)
    opt.step()
    assert rt.defer_capture() is None


def test_the_lender_reports_what_it_did():
    lender = pool_lending.PoolLender(lambda: None)
    assert lender.report() == {"optimizer_steps_in_pool": 0, "optimizer_steps_declined": 0,
                               "pool_reserved_before_capture_mib": 0.0}
    lender.steps, lender.declined, lender.reserved = 3, 1, 5 * MIB
    assert lender.report() == {"optimizer_steps_in_pool": 3, "optimizer_steps_declined": 1,
                               "pool_reserved_before_capture_mib": 5.0}
