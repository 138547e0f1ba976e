"""Paddle side of the stream-ordered allocator switch (:mod:`paddle_graphpp.allocator`).

Importing this module does not import paddle; :func:`plan` uses Paddle only if it is
already imported.

Paddle (>= 3.0) reads the flag ``FLAGS_use_cuda_malloc_async_allocator`` when it builds its
allocator facade, for every place, the first time anything is allocated (a CPU tensor
counts). Only the ``auto_growth`` strategy (``FLAGS_allocator_strategy``, the default) honours
it: under ``naive_best_fit`` or ``thread_local`` the flag is silently ignored, so the switch
refuses those. It also refuses ``FLAGS_use_cuda_managed_memory`` (Paddle rejects the pair) and
``FLAGS_use_system_allocator`` (which bypasses the async allocator). With the flag, Paddle stops
giving CUDA graphs their own memory pool (the capture's pool id is ignored) and instantiates
graphs with ``cudaGraphInstantiateFlagAutoFreeOnLaunch``. Setting the flag after the facade
exists is the half-switch the switch exists to prevent: graph captures would stop using
private pools while allocations still come from the auto-growth allocator.
"""

from __future__ import annotations

import os
import sys
from types import MappingProxyType

from ...allocator import ENV_FLAG, WHERE, AllocatorSwitchError, SwitchPlan, env_flag_value, refuse_half_switch

__all__ = ["plan", "async_allocator_active"]

_REQUIRED = MappingProxyType({  # flag -> (value the async allocator needs, why)
    "FLAGS_allocator_strategy": ("auto_growth", "only the auto_growth strategy honours the async flag; "
                                                "naive_best_fit and thread_local ignore it silently"),
    "FLAGS_use_cuda_managed_memory": (False, "Paddle rejects the async allocator with managed memory"),
    "FLAGS_use_system_allocator": (False, "the system allocator bypasses the async allocator"),
})


def _env_settings() -> dict:
    """The settings above as the environment gives them to Paddle at import (missing: default)."""
    out = {}
    for flag, (needed, _) in _REQUIRED.items():
        raw = os.environ.get(flag)
        if raw is not None:
            out[flag] = raw.strip() if isinstance(needed, str) else env_flag_value(raw, flag)
    return out


def _check_settings(settings: dict, source: str) -> None:
    for flag, (needed, why) in _REQUIRED.items():
        if flag in settings and settings[flag] != needed:
            raise AllocatorSwitchError(
                f"paddle: {flag}={settings[flag]!r} ({source}) cannot be combined with the stream-ordered "
                f"allocator: {why}. Set {flag}={needed!r}, or do not switch the allocator.")


def _allocated() -> list:
    """Places where Paddle's allocator facade has already allocated (from its statistics)."""
    from paddle.base import core

    used = []
    for stat in ("Allocated", "Reserved"):
        if max(core.host_memory_stat_peak_value(stat, 0), core.host_memory_stat_current_value(stat, 0)) > 0:
            used.append("host")
            break
    if core.is_compiled_with_cuda():
        import paddle

        for dev in range(paddle.device.cuda.device_count()):
            if any(max(core.device_memory_stat_peak_value(s, dev), core.device_memory_stat_current_value(s, dev))
                   > 0 for s in ("Allocated", "Reserved")):
                used.append(f"gpu:{dev}")
    return used


def _set_flag() -> None:
    import paddle

    paddle.set_flags({ENV_FLAG: True})


def plan() -> SwitchPlan:
    """What switching Paddle will do; raises :class:`AllocatorSwitchError` (changing nothing)
    when it is too late or a setting conflicts."""
    raw = os.environ.get(ENV_FLAG)
    if raw is not None and not env_flag_value(raw):
        raise AllocatorSwitchError(
            f"paddle: the environment sets {ENV_FLAG}={raw!r} (off) while the switch asks for it on. Remove "
            f"{ENV_FLAG} from the environment or set it to 1.")
    env = {ENV_FLAG: "1"}
    paddle = sys.modules.get("paddle")
    if paddle is None:
        _check_settings(_env_settings(), "from the environment")
        return SwitchPlan(f"{ENV_FLAG}=1 set in the environment; Paddle reads it when imported", env)
    names = [ENV_FLAG, *_REQUIRED]
    try:
        flags = paddle.get_flags(names)
    except Exception as exc:  # noqa: BLE001 - older Paddle lacks the flag
        raise AllocatorSwitchError(
            f"paddle {getattr(paddle, '__version__', '?')}: cannot read {ENV_FLAG} ({exc}); the "
            f"stream-ordered allocator needs Paddle >= 3.0.") from None
    _check_settings({k: flags[k] for k in _REQUIRED}, "current Paddle flag")
    gpu = paddle.is_compiled_with_cuda()
    if flags[ENV_FLAG]:
        return SwitchPlan("already set (Paddle flag on)" + ("" if gpu else "; CPU build: no device allocator"), env)
    used = _allocated()
    if used:
        raise AllocatorSwitchError(
            f"paddle: too late to switch the allocator: Paddle has already allocated memory "
            f"({', '.join(used)}), so its allocator facade exists and reads {ENV_FLAG} no more; setting it now "
            f"would half-switch (graph captures would stop using private pools while allocations stay on "
            f"the auto-growth allocator). To fix it, {WHERE}.")
    status = ("flag set; takes effect at Paddle's first allocation" if gpu else
              "flag set; CPU build of Paddle: no device allocator, nothing to switch")
    return SwitchPlan(status, env, _set_flag)


def async_allocator_active() -> bool:
    """Whether Paddle allocates device memory with ``cudaMallocAsync`` (``False`` without a GPU).

    Imports paddle. Raises :class:`AllocatorSwitchError` on a half-switch (the switch was asked
    for, but Paddle's allocator was set up without it).
    """
    import paddle

    if not (paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count()):
        return False
    flags = paddle.get_flags([ENV_FLAG, *_REQUIRED])
    if flags[ENV_FLAG] and all(flags[k] == v for k, (v, _) in _REQUIRED.items()):
        return True
    refuse_half_switch("paddle", f"{ENV_FLAG}={flags[ENV_FLAG]}, strategy {flags['FLAGS_allocator_strategy']}")
    return False
