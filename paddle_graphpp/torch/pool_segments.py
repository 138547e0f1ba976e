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
so that the default cache keeps the user's setting; the allocator's other settings are passed
along unchanged (PyTorch resets some of them to their defaults when new settings leave them
out; settings a program changes at run time through PyTorch's API are not seen where PyTorch
does not tell them, as torch 2.11 does not: set them in the environment). Blocks of the pool are
found only while the setting is on, which is when they are asked for. The setting is process-wide: what another thread allocates outside the pool while it is
on goes to expandable segments of the default cache.

PyTorch builds that keep graph pools out of expandable segments map nothing differently:
:func:`pool_is_expandable` reports whether a pool's memory is expandable, for the logs and
tests.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import Iterator, Optional

import torch

from ..allocator import env_flag_value

__all__ = ["FLAG", "enabled", "pool_allocations", "pool_is_expandable", "with_expandable"]

FLAG = "FLAGS_graphpp_pool_expandable"
_LOCK = threading.Lock()
_DEPTH = 0  # windows open (nested: a capture inside a borrowed step's window, a reserve inside one)
_SAVED: Optional[str] = None  # the settings the outermost open window switched from


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


_KEY = re.compile(r"(expandable_segments|backend)\s*:\s*[^,\s]*", re.IGNORECASE)
_ON = re.compile(r"expandable_segments\s*:\s*true\b", re.IGNORECASE)


def _settings() -> str:
    """The allocator settings in force, as far as they can be known: what PyTorch says it parsed
    last where it says (torch 2.11 answers ``""`` even after settings were set at run time),
    else the environment it loaded (``PYTORCH_ALLOC_CONF`` first, as PyTorch >= 2.9 reads it)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    told = getter() if getter is not None else ""
    if told:
        return told
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        if os.environ.get(var) is not None:
            return os.environ[var]
    return ""


def _user_setting_on(settings: Optional[str] = None) -> bool:
    """Whether the allocator settings in force turn expandable segments on everywhere."""
    return bool(_ON.search(_settings() if settings is None else settings))


def with_expandable(settings: str, on: bool) -> str:
    """``settings`` with ``expandable_segments`` set to ``on`` and no ``backend`` (fixed at load).
    Every other option is kept as written: PyTorch resets ``max_split_size_mb``,
    ``roundup_power2_divisions`` and ``garbage_collection_threshold`` to their defaults whenever
    new settings leave them out."""
    rest = ",".join(part.strip() for part in _KEY.sub("", settings).split(",") if part.strip())
    flag = f"expandable_segments:{'True' if on else 'False'}"
    return f"{rest},{flag}" if rest else flag


def _set(settings: str) -> None:
    accelerator = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.10
    if accelerator is not None:
        accelerator(settings)
    else:
        torch.cuda.memory._set_allocator_settings(settings)


@contextlib.contextmanager
def pool_allocations() -> Iterator[None]:
    """Within: new device memory is mapped as expandable segments (see the module's docstring),
    the allocator's other settings kept. A no-op when the flag is off, the allocator is not the
    native one, or the settings in force have expandable segments on already."""
    global _DEPTH, _SAVED
    if not enabled():
        yield
        return
    with _LOCK:
        if _DEPTH == 0:
            settings = _settings()
            _SAVED = None if _user_setting_on(settings) else settings
            if _SAVED is not None:
                _set(with_expandable(_SAVED, True))
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0 and _SAVED is not None:
                _set(with_expandable(_SAVED, False))
                _SAVED = None


def pool_is_expandable(pool: "torch.cuda.MemPool") -> bool:
    """Whether ``pool`` holds memory and all of it is in expandable segments."""
    segments = pool.snapshot()
    return bool(segments) and all(seg.get("is_expandable", False) for seg in segments)
