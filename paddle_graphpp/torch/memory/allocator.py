"""PyTorch side of the stream-ordered allocator switch (:mod:`paddle_graphpp.allocator`).

Importing this module does not import torch: the switch must come before ``import torch``, which
fixes the allocator backend on a CUDA build. :func:`plan` says what switching will do: add
``backend:cudaMallocAsync`` to ``PYTORCH_CUDA_ALLOC_CONF`` (and ``PYTORCH_ALLOC_CONF`` where set),
keeping the other options. Once torch is imported, or with another ``backend`` given, it raises
:class:`~paddle_graphpp.allocator.AllocatorSwitchError` and changes nothing (on a CPU build too,
checked against the environment torch was imported with). Under the async backend PyTorch
ignores graph private pools and allows one capture at a time: docs/memory.md.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from ...allocator import WHERE, AllocatorSwitchError, SwitchPlan, refuse_half_switch

__all__ = ["plan", "async_allocator_active", "merge_async_backend", "parse_alloc_conf"]

ASYNC_BACKEND = "cudaMallocAsync"
_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


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

    Raises :class:`~paddle_graphpp.allocator.AllocatorSwitchError` when ``conf`` already names
    another backend.
    """
    conf = (conf or "").strip().strip(",")
    for key, value in parse_alloc_conf(conf):
        if key == "backend":
            if value == ASYNC_BACKEND:
                return conf
            raise AllocatorSwitchError(
                f"torch: {var}={conf!r} selects backend:{value}; the stream-ordered allocator needs "
                f"backend:{ASYNC_BACKEND}. Remove the backend option from {var} (or set it to "
                f"{ASYNC_BACKEND}), or do not switch the allocator.")
    return f"{conf},backend:{ASYNC_BACKEND}" if conf else f"backend:{ASYNC_BACKEND}"


def _env_selects_async() -> bool:
    """Whether the configuration PyTorch reads from the environment selects the async backend
    (``PYTORCH_ALLOC_CONF`` wins over ``PYTORCH_CUDA_ALLOC_CONF`` when both are set)."""
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        conf = os.environ.get(var)
        if conf is not None:
            return any(k == "backend" and v == ASYNC_BACKEND for k, v in parse_alloc_conf(conf))
    return False


def plan() -> SwitchPlan:
    """What switching PyTorch will do; raises :class:`AllocatorSwitchError` (changing nothing)
    when it is too late or a setting conflicts. Does not import torch."""
    env = {}
    for var in _VARS:  # conflicts are errors whether or not torch is imported
        if var in os.environ or var == "PYTORCH_CUDA_ALLOC_CONF":
            env[var] = merge_async_backend(os.environ.get(var), var)
    torch = sys.modules.get("torch")
    if torch is None:
        return SwitchPlan("PYTORCH_CUDA_ALLOC_CONF set; the backend is chosen when torch is imported", env)
    if getattr(torch.backends, "cuda", None) is not None and torch.backends.cuda.is_built():
        backend = torch.cuda.get_allocator_backend()
        if backend == ASYNC_BACKEND:
            return SwitchPlan(f"already active (torch allocator backend {backend})")
        raise AllocatorSwitchError(
            f"torch: too late to switch the allocator: torch was imported with the {backend!r} CUDA "
            f"allocator backend, which PyTorch fixes when it loads"
            f"{' (and CUDA is already initialised)' if torch.cuda.is_initialized() else ''}. "
            f"To fix it, {WHERE}.")
    if _env_selects_async():
        return SwitchPlan("CPU build of torch: no device allocator, nothing to switch (the environment it "
                          "loaded with already selects cudaMallocAsync)")
    raise AllocatorSwitchError(
        "torch: too late to switch the allocator: torch is already imported and the environment it "
        "loaded with does not select backend:cudaMallocAsync. This is a CPU build, so nothing would "
        "change here, but a CUDA build fixes its allocator backend at import and would not switch. "
        f"To fix it, {WHERE}.")


def async_allocator_active() -> bool:
    """Whether PyTorch allocates device memory with ``cudaMallocAsync`` (``False`` without a GPU).

    Imports torch. Raises :class:`AllocatorSwitchError` on a half-switch (the switch was asked
    for, but torch loaded another backend).
    """
    import torch

    if not (torch.backends.cuda.is_built() and torch.cuda.is_available()):
        return False
    backend = torch.cuda.get_allocator_backend()
    if backend == ASYNC_BACKEND:
        return True
    refuse_half_switch("torch", f"the {backend!r} allocator backend")
    return False
