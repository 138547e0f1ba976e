"""FSDP2's adapter (:data:`ADAPTER`): graphed blocks under ``torch.distributed.fsdp.fully_shard``.

A graphed block that FSDP2 manages is prepared at its first call (:func:`prepare`; FSDP2 may shard
it after graphing): FSDP2 keeps its unsharded parameter storage allocated (:func:`keep_unsharded`;
:func:`release` undoes it), and each capture sees the unsharded parameters on the module
(:func:`unsharded_view`, entered through :func:`capture_view`). Each graphed block must be an FSDP
module itself, with none inside it; any other layout is refused when graphed, at the first call and
at each capture, naming the layout that works (:func:`check_block`, :func:`check_wrapped`). Why and
what it costs: docs/pytorch.md#activation-checkpointing-and-fsdp2.

FSDP2 has no public API for any of this. Private names read here, checked on torch 2.11 and 2.13:
``module._get_fsdp_state()``, the state's ``_fsdp_param_groups`` (2.13) or else its
``_fsdp_param_group``, each ``FSDPParam``'s ``free_unsharded_param``, ``_unsharded_param`` and ``_module_info``,
and ``torch.distributed._composable_state._module_state_mapping``.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from . import Adapter

__all__ = ["fsdp_params", "keep_unsharded", "unsharded_view", "prepare", "capture_view", "release",
           "check_block", "check_wrapped", "ADAPTER"]


def _groups(state: Any) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13: a list (per-parameter meshes)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return groups


def fsdp_params(module: nn.Module) -> list:
    """The FSDP2 parameter records of ``module``'s own ``fully_shard`` groups (empty: not an FSDP2 module)."""
    get = getattr(module, "_get_fsdp_state", None)
    if get is None:
        return []
    return [fp for group in _groups(get()) for fp in group.fsdp_params]


def _keep_storage() -> None:
    """An FSDP parameter's ``free_unsharded_param`` in a graphed block: the storage stays."""


def keep_unsharded(module: nn.Module) -> int:
    """Make FSDP2 keep ``module``'s unsharded parameter storage allocated (its next all-gathers
    copy into the same memory). Returns how many parameters it manages."""
    params = fsdp_params(module)
    for fp in params:
        fp.free_unsharded_param = _keep_storage  # on the instance: found before the class's
    return len(params)


def release(module: nn.Module) -> None:
    """Undo :func:`keep_unsharded` (FSDP2 frees the unsharded storage after use again)."""
    for fp in fsdp_params(module):
        vars(fp).pop("free_unsharded_param", None)


def _places(fp: Any) -> list:
    info = fp._module_info
    return [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]


@contextlib.contextmanager
def unsharded_view(module: nn.Module):
    """``module`` with its unsharded parameters set (those FSDP2 has swapped out for the sharded
    ones are set back afterwards)."""
    swapped = []
    for fp in fsdp_params(module):
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is None:
            continue  # never all-gathered: nothing graphed reads it yet
        for owner, name in _places(fp):
            held = owner._parameters.get(name)
            if held is not unsharded:
                swapped.append((owner, name, held))
                owner._parameters[name] = unsharded
    try:
        yield
    finally:
        for owner, name, held in reversed(swapped):
            owner._parameters[name] = held


def prepare(block: nn.Module, name: str) -> None:
    """A graphed block's first call, and each of its captures: refuse a layout that cannot work
    (:func:`check_block`); under FSDP2, keep its unsharded storage (from then on, so the captures
    find every graphed block's unsharded parameters allocated, not only the one running)."""
    check_block(name, block)
    keep_unsharded(block)


def capture_view(block: nn.Module, name: str):
    """What a graphed block's engine enters around each capture (``EngineHooks.capture_view``): the
    checks and the kept storage of :func:`prepare`, then :func:`unsharded_view`."""
    prepare(block, name)
    return unsharded_view(block)


def _managed_from_outside(block: nn.Module) -> Optional[str]:
    """The name of a parameter of ``block`` that an FSDP2 state of another module manages."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:  # no composable states in this torch: nothing manages it
        return None
    inside = {id(m): prefix for prefix, m in block.named_modules()}
    for owner, state in list(_module_state_mapping.items()):
        state = state() if isinstance(state, weakref.ref) else state  # held weakly (torch 2.13)
        if owner is block or not hasattr(state, "_fsdp_param_groups") and not hasattr(state, "_fsdp_param_group"):
            continue
        for group in _groups(state):
            for fp in group.fsdp_params:
                prefix = inside.get(id(fp._module_info.module))
                if prefix is not None:
                    return f"{prefix}.{fp._module_info.param_name}" if prefix else fp._module_info.param_name
    return None


def _fsdp_modules(module: nn.Module) -> list:
    """The names (``""``: ``module`` itself) of the FSDP2 modules in ``module``."""
    return [n for n, m in module.named_modules() if hasattr(m, "_get_fsdp_state")]


def check_block(name: str, block: nn.Module) -> None:
    """Refuse to graph ``block`` (named ``name``) whose parameters an enclosing ``fully_shard``
    manages, or that holds an FSDP2 module of its own below it.

    Raises:
        TypeError: naming the block and the layout that works.
    """
    inner = [n for n in _fsdp_modules(block) if n]
    if inner:
        raise TypeError(
            f"{name}: its submodule {inner[0]} is an FSDP2 module (fully_shard), whose all-gathers would run "
            f"inside the block's graphs and whose gradient reduction would not run at their replay. Call "
            f"fully_shard() on the graphed block itself, not inside it.")
    outside = _managed_from_outside(block)
    if outside is not None:
        raise TypeError(
            f"{name}: its parameters ({outside}, ...) are sharded by an enclosing fully_shard(), which "
            f"frees and re-allocates them around every use, where its graphs read fixed addresses. Call "
            f"fully_shard() on each graphed block (for block in model.model.layers: fully_shard(block)), "
            f"then on the model.")


def check_wrapped(name: str, module: nn.Module) -> None:
    """Refuse to wrap an FSDP2 module (or one holding FSDP2 modules) in ``CUDAGraphedModule``:
    its all-gathers would run inside the graphs, into storage it frees after each use.

    Raises:
        TypeError: naming the module and the order that works.
    """
    inner = [n or type(module).__name__ for n in _fsdp_modules(module)]
    if inner:
        raise TypeError(
            f"{name}: {inner[0]} is an FSDP2 module (fully_shard), whose all-gathers would run inside the "
            f"graphs. Graph first, then shard: fully_shard(CUDAGraphedModule(block)), or graph_layers(blocks) "
            f"before fully_shard on each block.")


@dataclass(frozen=True)
class FsdpAdapter(Adapter):
    """FSDP2 as the front doors see it: refused layouts, kept storage, the unsharded view."""

    name = "fsdp2"

    def check_block(self, name, layer, *, check_config) -> None:
        check_block(name, layer)

    def check_wrapped(self, name, module) -> None:
        check_wrapped(name, module)

    def prepare(self, block, name) -> None:
        prepare(block, name)

    def capture_view(self, block, name):
        return capture_view(block, name)

    def release(self, block) -> None:
        release(block)


ADAPTER = FsdpAdapter()
