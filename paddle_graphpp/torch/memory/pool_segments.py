"""The graph pool's memory as one expandable range (``FLAGS_graphpp_pool_expandable``: unset or
true, on; false, off; anything else raises ``ValueError``; see :func:`enabled`).

:func:`pool_allocations` is the window every allocation into a graph pool runs in (its reserve,
its captures, the optimizer steps that borrow it): inside, PyTorch maps new memory as expandable
segments; after, the program's own allocator setting is back, the allocator's other settings
passed along unchanged (on torch 2.11 as the environment gave them: set them there). The setting
is process-wide while a window is open, so another thread's allocations then land in expandable
segments of the default cache. Why, and what it saves: docs/memory.md.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import Iterator, Optional

import torch

from ...allocator import env_flag_value
from ...core.process import current_process
from ...core.warn import warn
from .allocator import async_allocator_active

__all__ = ["FLAG", "enabled", "pool_allocations", "with_expandable"]

FLAG = "FLAGS_graphpp_pool_expandable"


class Windows:
    """The :func:`pool_allocations` windows open in this process (a part of its torch section)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0  # windows open (nested: a capture inside a borrowed step's window, a reserve inside one)
        self.saved: Optional[str] = None  # the settings the outermost open window switched from


def windows() -> Windows:
    """This process's :class:`Windows`."""
    return current_process().section("torch").part(Windows)


def enabled() -> bool:
    """``FLAGS_graphpp_pool_expandable``: unset or true, graph pools grow as expandable segments;
    false, as ordinary segments. Only the native caching allocator has them."""
    raw = os.environ.get(FLAG)
    try:
        on = True if raw is None else env_flag_value(raw, FLAG)
    except ValueError:
        raise ValueError(f"{FLAG}={raw!r}: use 1 (graph pools as expandable segments, the default) or 0 "
                         f"(as ordinary segments)") from None
    return on and torch.cuda.is_available() and not async_allocator_active()


_KEY = re.compile(r"(expandable_segments|backend)\s*:\s*[^,\s]*", re.IGNORECASE)
_VALUE = re.compile(r"expandable_segments\s*:\s*(\w+)", re.IGNORECASE)


def _settings() -> str:
    """The allocator settings in force: what PyTorch says it parsed last, where it says (torch
    2.13 does, settings made at run time included; 2.11 has no way to ask), else the environment
    PyTorch loaded: ``PYTORCH_CUDA_ALLOC_CONF``, or ``PYTORCH_ALLOC_CONF`` without it (with both
    set, torch 2.11 and 2.13 parse only the first)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        return getter() or ""
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if os.environ.get(var) is not None:
            return os.environ[var]
    return ""


def _user_setting_on(settings: Optional[str] = None) -> bool:
    """Whether the allocator settings in force turn expandable segments on everywhere (the last
    ``expandable_segments`` option wins, as in PyTorch's parser)."""
    values = _VALUE.findall(_settings() if settings is None else settings)
    return bool(values) and values[-1].lower() == "true"


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
    """Within: new device memory is mapped as expandable segments (docs/memory.md),
    the allocator's other settings kept. A no-op when the flag is off, the allocator is not the
    native one, or the settings in force have expandable segments on already."""
    if not enabled():
        yield
        return
    state = windows()
    with state.lock:
        if state.depth == 0:
            settings = _settings()
            if not _user_setting_on(settings):
                _set(with_expandable(settings, True))  # raises before anything is counted
                state.saved = settings
        state.depth += 1
    try:
        yield
    except BaseException:
        _leave(quiet=True)  # the body's error is the one to see
        raise
    _leave(quiet=False)


def _leave(quiet: bool) -> None:
    """Close one window; the outermost switches the setting back off."""
    state = windows()
    with state.lock:
        state.depth -= 1
        if state.depth or state.saved is None:
            return
        saved, state.saved = state.saved, None
        try:
            _set(with_expandable(saved, False))
        except Exception as exc:  # noqa: BLE001
            if not quiet:
                raise
            warn(f"paddle_graphpp: could not switch expandable segments back off after a graph pool's "
                          f"allocations ({type(exc).__name__}: {exc}); the allocator keeps them on")
