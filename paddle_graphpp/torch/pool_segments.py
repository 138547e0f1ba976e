"""The graph pool's memory as one expandable range (``FLAGS_graphpp_pool_expandable``).

A graph pool made of ordinary segments cannot merge free space across them: each segment is
one ``cudaMalloc``, and a request larger than every free block adds a segment of its own
while the pool may have as much free in pieces. On a GPT-3 1.3B ``zbv`` stage at sequence
2048 the fp32 logits' 393 MiB requests did so twice, each time beside 394 and 780 MiB free
(``tools/pool_model.py``): 784 MiB above the most the requests ever hold at once. Which
layout avoids it depended on the order of the addresses the driver hands out.

The caching allocator's expandable segments (``expandable_segments:True``) give a pool one
range of virtual addresses that grows by mapping pages at its end: a request that fits no free
block extends the free block at the end by what is missing, instead of adding a whole segment,
and all blocks of the pool can merge with their neighbours. PyTorch takes the setting when it
maps new memory, so :func:`pool_allocations` turns it on only while memory is allocated into a
graph pool (its reserve, its captures, the optimizer steps that borrow it) and back off after,
so that the default cache keeps the user's setting. Blocks of the pool are found only while the
setting is on, which is when they are asked for.

PyTorch builds that keep graph pools out of expandable segments map nothing differently:
:func:`pool_is_expandable` reports whether a pool's memory is expandable, for the logs and
tests.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

import torch

from ..allocator import env_flag_value
from .allocator import parse_alloc_conf

__all__ = ["FLAG", "enabled", "pool_allocations", "pool_is_expandable"]

FLAG = "FLAGS_graphpp_pool_expandable"
_SETTING = "expandable_segments"
_LOCK = threading.Lock()
_DEPTH = 0  # windows open (nested: a capture inside a borrowed step's window, a reserve inside one)


def enabled() -> bool:
    """``FLAGS_graphpp_pool_expandable``: unset or true, graph pools grow as expandable segments;
    false, as ordinary segments. Only the native caching allocator has them."""
    raw = os.environ.get(FLAG)
    try:
        on = True if raw is None else env_flag_value(raw, FLAG)
    except ValueError:
        raise ValueError(f"{FLAG}={raw!r}: use 1 (graph pools as expandable segments, the default) or 0 "
                         f"(as ordinary segments)") from None
    return on and torch.cuda.is_available() and torch.cuda.get_allocator_backend() == "native"


def _user_setting_on() -> bool:
    """Whether the configuration PyTorch loaded turns expandable segments on everywhere."""
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        conf = os.environ.get(var)
        if conf is not None:
            return any(k == _SETTING and v.lower() == "true" for k, v in parse_alloc_conf(conf))
    return False


def _set(on: bool) -> None:
    setting = f"{_SETTING}:{'True' if on else 'False'}"
    accelerator = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.10
    if accelerator is not None:
        accelerator(setting)
    else:
        torch.cuda.memory._set_allocator_settings(setting)


@contextlib.contextmanager
def pool_allocations() -> Iterator[None]:
    """Within: new device memory is mapped as expandable segments (see the module's docstring).
    A no-op when the flag is off, the allocator is not the native one, or the user's own
    configuration has them on already."""
    global _DEPTH
    if not enabled() or _user_setting_on():
        yield
        return
    with _LOCK:
        if _DEPTH == 0:
            _set(True)
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                _set(False)


def pool_is_expandable(pool: "torch.cuda.MemPool") -> bool:
    """Whether ``pool`` holds memory and all of it is in expandable segments."""
    segments = pool.snapshot()
    return bool(segments) and all(seg.get("is_expandable", False) for seg in segments)
