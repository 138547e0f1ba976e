"""The stream-ordered allocator switch (``cudaMallocAsync``) for Paddle and PyTorch.

:func:`use_cuda_malloc_async_allocator`, called before the framework is imported (PyTorch) or
before its first allocation (Paddle), or ``FLAGS_use_cuda_malloc_async_allocator=1`` in the
process's environment (:func:`apply_env_switch`), selects it. A call that comes too late, or meets
a conflicting setting, raises :class:`AllocatorSwitchError` saying where to call it, and changes
nothing: every framework is checked first, and nothing is switched unless all of them can switch.
On CPU builds nothing switches, but the order rule is checked all the same. Each framework's side
is its ``memory.allocator`` module (:mod:`paddle_graphpp.paddle.memory.allocator`,
:mod:`paddle_graphpp.torch.memory.allocator`); none of them imports a framework when imported.
What it does, and what it costs: docs/memory.md#the-stream-ordered-allocator-cudamallocasync.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

from .core import flags as _flags
from .core.process import current_process
from .core.runtime import FRAMEWORKS, framework_module
from .core.warn import warn

__all__ = [
    "AllocatorSwitchError",
    "use_cuda_malloc_async_allocator",
    "async_allocator_active",
    "async_allocator_requested",
    "apply_env_switch",
    "ENV_FLAG",
]

ENV_FLAG = "FLAGS_use_cuda_malloc_async_allocator"
_FRAMEWORKS = tuple(FRAMEWORKS)  # ("paddle", "torch")
#: Where the switch must come; completes "To fix it, ..." in the errors.
WHERE = ("call paddle_graphpp.use_cuda_malloc_async_allocator() at the top of the entry script, before "
         "`import torch` / before any Paddle tensor is created, or start the process with "
         "FLAGS_use_cuda_malloc_async_allocator=1 (Paddle) and PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync "
         "(PyTorch) in its environment")


class AllocatorSwitch:
    """Whether the switch ran in this process (a part of the process)."""

    def __init__(self) -> None:
        self.requested = False  # set by a successful call of use_cuda_malloc_async_allocator


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
    names = _check_frameworks(frameworks)
    plans = {name: framework_module(name, "memory.allocator").plan() for name in names}  # every check first
    for name in FRAMEWORKS:  # table order, Paddle first: its set_flags is the only step that can fail
        if name in plans:
            plans[name].apply()
    current_process().part(AllocatorSwitch).requested = True
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
        if not env_flag_value(os.environ.get(ENV_FLAG)):
            return None
        return use_cuda_malloc_async_allocator()
    except (AllocatorSwitchError, ValueError) as exc:
        warn(f"paddle_graphpp: {ENV_FLAG} is set but the stream-ordered allocator could not be "
                      f"switched on: {exc}")
        return None


def async_allocator_requested() -> bool:
    """True when the switch was called in this process or the environment flag is set."""
    requested = current_process().part(AllocatorSwitch).requested
    try:
        return requested or env_flag_value(os.environ.get(ENV_FLAG))
    except ValueError:
        return requested


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
    return framework_module(name, "memory.allocator").async_allocator_active()


def refuse_half_switch(name: str, detail: str) -> None:
    """For the framework modules: raise :class:`AllocatorSwitchError` if the switch was requested
    although framework ``name``'s device allocator (``detail``: what it uses) did not switch."""
    if async_allocator_requested():
        raise AllocatorSwitchError(
            f"{name}: the stream-ordered allocator was requested ({ENV_FLAG} or "
            f"use_cuda_malloc_async_allocator()) but {name} allocates with {detail}: it was set up before the "
            f"switch. To fix it, {WHERE}.")


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


def env_flag_value(raw: Optional[str], flag: str = ENV_FLAG) -> bool:
    """gflags' reading of a boolean environment value (``None``: unset, false)."""
    return _flags.env_flag_value(raw, flag)


class SwitchPlan:
    """What switching one framework will do: built by its module's checks (``plan()``), applied
    after every framework's checks passed. ``first`` (optional) runs before the environment is
    updated and is the only step allowed to fail."""

    def __init__(self, status: str, env: Optional[dict] = None, first: Optional[Callable[[], None]] = None):
        self.status = status
        self.env = env or {}
        self.first = first

    def apply(self) -> None:
        if self.first is not None:
            self.first()
        os.environ.update(self.env)

