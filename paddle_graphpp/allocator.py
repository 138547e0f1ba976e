"""The stream-ordered allocator switch (``cudaMallocAsync``) for Paddle and PyTorch.

Two ways to ask for it, both before the framework allocates:

* ``FLAGS_use_cuda_malloc_async_allocator=1`` in the environment of the process, or
* :func:`use_cuda_malloc_async_allocator` called before the framework is imported
  (PyTorch) or before its first allocation (Paddle).

What it does per framework:

**Paddle** (flag ``FLAGS_use_cuda_malloc_async_allocator``, Paddle >= 3.0). Paddle builds one
allocator facade, for every place, the first time anything is allocated (a CPU tensor counts),
and reads the flag then. Only the ``auto_growth`` strategy (``FLAGS_allocator_strategy``, the
default) honours it: under ``naive_best_fit`` or ``thread_local`` the flag is silently ignored,
so the switch refuses those. It also refuses ``FLAGS_use_cuda_managed_memory`` (Paddle rejects the
pair) and ``FLAGS_use_system_allocator`` (which bypasses the async allocator). With the flag,
Paddle stops giving CUDA graphs their own memory pool (the capture's pool id is ignored) and
instantiates graphs with ``cudaGraphInstantiateFlagAutoFreeOnLaunch``. Setting the flag after
the facade exists is the half-switch this module exists to prevent: graph captures would stop
using private pools while allocations still come from the auto-growth allocator.

**PyTorch** (``backend:cudaMallocAsync`` in ``PYTORCH_CUDA_ALLOC_CONF``, also merged into
``PYTORCH_ALLOC_CONF`` when that is set, because PyTorch >= 2.9 reads it first). A CUDA build of
PyTorch picks its allocator backend while ``import torch`` loads its CUDA library, so the switch
must come before that import; afterwards the backend cannot change. Other options already in
the variable are kept (the async backend ignores the native-only ones); a different ``backend``
there is a conflict and raises. With the async backend PyTorch ignores graph private pools
(graph memory is driver-managed graph memory, outside ``torch.cuda.memory_reserved()``) and
allows one capture at a time per process; ``torch.cuda.memory_snapshot()`` is unsupported.

Order rules: a call that comes too late raises :class:`AllocatorSwitchError` saying where to
call it; it never switches silently, and it never half-switches: every framework is checked
first and nothing is changed unless all of them can switch. On CPU builds there is no device
allocator and the switch changes nothing there, but the order rule is checked all the same, so
a program that would fail on a GPU fails on CPU too.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Optional, Sequence

__all__ = [
    "AllocatorSwitchError",
    "use_cuda_malloc_async_allocator",
    "async_allocator_active",
    "async_allocator_requested",
    "apply_env_switch",
    "ENV_FLAG",
]

ENV_FLAG = "FLAGS_use_cuda_malloc_async_allocator"
_TORCH_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_ASYNC_BACKEND = "cudaMallocAsync"
_FRAMEWORKS = ("paddle", "torch")
_TRUE = ("1", "t", "true", "y", "yes", "on")
_FALSE = ("0", "f", "false", "n", "no", "off", "")
_WHERE = ("call paddle_graphpp.use_cuda_malloc_async_allocator() at the top of the entry script, before "
          "`import torch` / before any Paddle tensor is created, or start the process with "
          "FLAGS_use_cuda_malloc_async_allocator=1 (Paddle) and PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync "
          "(PyTorch) in its environment")

_requested = False  # set by a successful call of the switch in this process


class AllocatorSwitchError(RuntimeError):
    """The stream-ordered allocator cannot be switched on (too late, or a conflicting setting).

    Nothing was changed when this is raised.
    """


# --------------------------------------------------------------------------- public API
def use_cuda_malloc_async_allocator(frameworks: Sequence[str] = _FRAMEWORKS) -> dict:
    """Select the stream-ordered CUDA allocator (``cudaMallocAsync``) for Paddle and PyTorch.

    Call it first thing in the program: before ``import torch`` and before Paddle allocates
    anything. A framework not imported yet is switched through the environment, so the choice
    takes effect when it is imported (and is inherited by child processes).

    Args:
        frameworks: which frameworks to switch, a subset of ``("paddle", "torch")`` (default:
            both). All of them are checked before any is changed.

    Returns:
        ``{framework: what was done}``, one short sentence per framework.

    Raises:
        AllocatorSwitchError: a framework can no longer switch (PyTorch already imported with
            another backend; Paddle already allocated), or a setting conflicts (a different
            ``backend:`` in ``PYTORCH_CUDA_ALLOC_CONF``, ``FLAGS_allocator_strategy`` other than
            ``auto_growth``, managed memory, the system allocator, the flag set to false in the
            environment). Nothing is changed when it raises.
        ValueError: an unknown framework name.

    .. warning:: Paddle's order check reads its allocation statistics; an allocator facade that
       exists without having allocated anything yet is not visible to it. Switch before any
       Paddle work beyond ``import paddle``.
    .. warning:: With the async allocator the graph memory modes' pools are ignored by the
       framework: ``memory="per_graph"`` no longer gives each graph its own pool, and
       ``paddle_graphpp.memory_report()`` cannot attribute memory to pools.
    """
    global _requested
    names = _check_frameworks(frameworks)
    plans = {name: _PLANNERS[name]() for name in names}  # every check before any change
    for name in ("paddle", "torch"):  # Paddle's set_flags is the only step that can fail: first
        if name in plans:
            plans[name].apply()
    _requested = True
    return {name: plan.status for name, plan in plans.items()}


def apply_env_switch() -> Optional[dict]:
    """Honour ``FLAGS_use_cuda_malloc_async_allocator=1`` for PyTorch; meant for package import.

    Paddle reads the flag from the environment itself. PyTorch does not, so when the flag is set
    this runs :func:`use_cuda_malloc_async_allocator` for the frameworks (it puts
    ``backend:cudaMallocAsync`` into ``PYTORCH_CUDA_ALLOC_CONF`` if PyTorch is not imported yet).
    It never raises: a problem becomes a ``RuntimeWarning`` here, and
    :func:`async_allocator_active` raises when a graphed layer is built on a device whose
    allocator did not switch. Returns the switch's result, or ``None`` when the flag is unset.
    """
    try:
        if not _env_flag_value(os.environ.get(ENV_FLAG)):
            return None
        return use_cuda_malloc_async_allocator()
    except (AllocatorSwitchError, ValueError) as exc:
        warnings.warn(f"paddle_graphpp: {ENV_FLAG} is set but the stream-ordered allocator could not be "
                      f"switched on: {exc}", RuntimeWarning, stacklevel=2)
        return None


def async_allocator_requested() -> bool:
    """True when the switch was called in this process or the environment flag is set."""
    try:
        return _requested or _env_flag_value(os.environ.get(ENV_FLAG))
    except ValueError:
        return _requested


def async_allocator_active(runtime_name: str) -> bool:
    """Whether the framework of ``runtime_name`` (``"paddle"`` or ``"torch"``) allocates device
    memory with the stream-ordered allocator.

    Imports the framework. CPU builds, and builds without a visible GPU, return ``False``.

    Raises:
        AllocatorSwitchError: the switch was requested (call or environment flag) but this
            framework's device allocator did not switch (it was imported or allocated first):
            a half-switch, which graph memory must not run under.
        ValueError: an unknown runtime name.
    """
    name = _check_frameworks([runtime_name])[0]
    active, device, detail = _ACTIVE[name]()
    if device and not active and async_allocator_requested():
        raise AllocatorSwitchError(
            f"{name}: the stream-ordered allocator was requested ({ENV_FLAG} or "
            f"use_cuda_malloc_async_allocator()) but {name} allocates with {detail}: it was set up before the "
            f"switch. To fix it, {_WHERE}.")
    return active


# --------------------------------------------------------------------------- helpers
def _check_frameworks(frameworks) -> list:
    if isinstance(frameworks, str):
        frameworks = [frameworks]
    names = list(frameworks)
    bad = [n for n in names if n not in _FRAMEWORKS]
    if bad or not names:
        raise ValueError(f"use_cuda_malloc_async_allocator: unknown framework(s) {bad or names!r}; "
                         f"choose from {list(_FRAMEWORKS)}")
    return list(dict.fromkeys(names))


def _env_flag_value(raw: Optional[str], flag: str = ENV_FLAG) -> bool:
    """gflags' reading of a boolean environment value (``None``: unset, false)."""
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{flag}={raw!r} is not a boolean; use 1 or 0")


class _Plan:
    """What switching one framework will do; built by the checks, applied after all passed."""

    def __init__(self, status: str, env: Optional[dict] = None, paddle_flags: Optional[dict] = None):
        self.status = status
        self.env = env or {}
        self.paddle_flags = paddle_flags

    def apply(self) -> None:
        if self.paddle_flags:
            import paddle

            paddle.set_flags(self.paddle_flags)
        os.environ.update(self.env)


# ----------------------------------------------------------------------------- PyTorch
def parse_alloc_conf(conf: str) -> list:
    """``"a:1,b:2"`` -> ``[("a", "1"), ("b", "2")]`` (PyTorch splits on commas and whitespace)."""
    out = []
    for option in conf.replace(" ", ",").split(","):
        if option.strip():
            key, _, value = option.strip().partition(":")
            out.append((key.strip(), value.strip()))
    return out


def merge_async_backend(conf: Optional[str], var: str = "PYTORCH_CUDA_ALLOC_CONF") -> str:
    """``conf`` with ``backend:cudaMallocAsync`` added; other options kept.

    Raises :class:`AllocatorSwitchError` when ``conf`` already names another backend.
    """
    conf = (conf or "").strip().strip(",")
    for key, value in parse_alloc_conf(conf):
        if key == "backend":
            if value == _ASYNC_BACKEND:
                return conf
            raise AllocatorSwitchError(
                f"torch: {var}={conf!r} selects backend:{value}; the stream-ordered allocator needs "
                f"backend:{_ASYNC_BACKEND}. Remove the backend option from {var} (or set it to "
                f"{_ASYNC_BACKEND}), or do not switch the allocator.")
    return f"{conf},backend:{_ASYNC_BACKEND}" if conf else f"backend:{_ASYNC_BACKEND}"


def _torch_env_selects_async() -> bool:
    """Whether the configuration PyTorch reads from the environment selects the async backend
    (``PYTORCH_ALLOC_CONF`` wins over ``PYTORCH_CUDA_ALLOC_CONF`` when both are set)."""
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        conf = os.environ.get(var)
        if conf is not None:
            return any(k == "backend" and v == _ASYNC_BACKEND for k, v in parse_alloc_conf(conf))
    return False


def _plan_torch() -> _Plan:
    env = {}
    for var in _TORCH_VARS:  # conflicts are errors whether or not torch is imported
        if var in os.environ or var == "PYTORCH_CUDA_ALLOC_CONF":
            env[var] = merge_async_backend(os.environ.get(var), var)
    torch = sys.modules.get("torch")
    if torch is None:
        return _Plan("PYTORCH_CUDA_ALLOC_CONF set; the backend is chosen when torch is imported", env)
    if getattr(torch.backends, "cuda", None) is not None and torch.backends.cuda.is_built():
        backend = torch.cuda.get_allocator_backend()
        if backend == _ASYNC_BACKEND:
            return _Plan(f"already active (torch allocator backend {backend})")
        raise AllocatorSwitchError(
            f"torch: too late to switch the allocator: torch was imported with the {backend!r} CUDA "
            f"allocator backend, which PyTorch fixes when it loads"
            f"{' (and CUDA is already initialised)' if torch.cuda.is_initialized() else ''}. "
            f"To fix it, {_WHERE}.")
    if _torch_env_selects_async():
        return _Plan("CPU build of torch: no device allocator, nothing to switch (the environment it "
                     "loaded with already selects cudaMallocAsync)")
    raise AllocatorSwitchError(
        "torch: too late to switch the allocator: torch is already imported and the environment it "
        "loaded with does not select backend:cudaMallocAsync. This is a CPU build, so nothing would "
        "change here, but a CUDA build fixes its allocator backend at import and would not switch. "
        f"To fix it, {_WHERE}.")


def _torch_active():
    import torch

    if not (torch.backends.cuda.is_built() and torch.cuda.is_available()):
        return False, False, "no device allocator"
    backend = torch.cuda.get_allocator_backend()
    return backend == _ASYNC_BACKEND, True, f"the {backend!r} allocator backend"


# ------------------------------------------------------------------------------ Paddle
_PADDLE_REQUIRED = {  # flag -> (value the async allocator needs, why)
    "FLAGS_allocator_strategy": ("auto_growth", "only the auto_growth strategy honours the async flag; "
                                                "naive_best_fit and thread_local ignore it silently"),
    "FLAGS_use_cuda_managed_memory": (False, "Paddle rejects the async allocator with managed memory"),
    "FLAGS_use_system_allocator": (False, "the system allocator bypasses the async allocator"),
}


def _paddle_env_settings() -> dict:
    """The settings above as the environment gives them to Paddle at import (missing: default)."""
    out = {}
    for flag, (needed, _) in _PADDLE_REQUIRED.items():
        raw = os.environ.get(flag)
        if raw is not None:
            out[flag] = raw.strip() if isinstance(needed, str) else _env_flag_value(raw, flag)
    return out


def _check_paddle_settings(settings: dict, source: str) -> None:
    for flag, (needed, why) in _PADDLE_REQUIRED.items():
        if flag in settings and settings[flag] != needed:
            raise AllocatorSwitchError(
                f"paddle: {flag}={settings[flag]!r} ({source}) cannot be combined with the stream-ordered "
                f"allocator: {why}. Set {flag}={needed!r}, or do not switch the allocator.")


def _paddle_allocated() -> list:
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


def _plan_paddle() -> _Plan:
    raw = os.environ.get(ENV_FLAG)
    if raw is not None and not _env_flag_value(raw):
        raise AllocatorSwitchError(
            f"paddle: the environment sets {ENV_FLAG}={raw!r} (off) while the switch asks for it on. Remove "
            f"{ENV_FLAG} from the environment or set it to 1.")
    env = {ENV_FLAG: "1"}
    paddle = sys.modules.get("paddle")
    if paddle is None:
        _check_paddle_settings(_paddle_env_settings(), "from the environment")
        return _Plan(f"{ENV_FLAG}=1 set in the environment; Paddle reads it when imported", env)
    names = [ENV_FLAG, *_PADDLE_REQUIRED]
    try:
        flags = paddle.get_flags(names)
    except Exception as exc:  # noqa: BLE001 - older Paddle lacks the flag
        raise AllocatorSwitchError(
            f"paddle {getattr(paddle, '__version__', '?')}: cannot read {ENV_FLAG} ({exc}); the "
            f"stream-ordered allocator needs Paddle >= 3.0.") from None
    _check_paddle_settings({k: flags[k] for k in _PADDLE_REQUIRED}, "current Paddle flag")
    gpu = paddle.is_compiled_with_cuda()
    if flags[ENV_FLAG]:
        return _Plan("already set (Paddle flag on)" + ("" if gpu else "; CPU build: no device allocator"), env)
    used = _paddle_allocated()
    if used:
        raise AllocatorSwitchError(
            f"paddle: too late to switch the allocator: Paddle has already allocated memory "
            f"({', '.join(used)}), so its allocator facade exists and reads {ENV_FLAG} no more; setting it now "
            f"would half-switch (graph captures would stop using private pools while allocations stay on "
            f"the auto-growth allocator). To fix it, {_WHERE}.")
    status = ("flag set; takes effect at Paddle's first allocation" if gpu else
              "flag set; CPU build of Paddle: no device allocator, nothing to switch")
    return _Plan(status, env, {ENV_FLAG: True})


def _paddle_active():
    import paddle

    if not (paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count()):
        return False, False, "no device allocator"
    flags = paddle.get_flags([ENV_FLAG, *_PADDLE_REQUIRED])
    ok = flags[ENV_FLAG] and all(flags[k] == v for k, (v, _) in _PADDLE_REQUIRED.items())
    detail = f"{ENV_FLAG}={flags[ENV_FLAG]}, strategy {flags['FLAGS_allocator_strategy']}"
    return bool(ok), True, detail


_PLANNERS = {"paddle": _plan_paddle, "torch": _plan_torch}
_ACTIVE = {"paddle": _paddle_active, "torch": _torch_active}
