"""Graphed blocks under FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 keeps each block's parameters sharded between uses. Before the block's forward (and again
before its backward, with ``reshard_after_forward=True``) it all-gathers them into an unsharded
parameter and sets that on the module; afterwards it sets the sharded one back and frees the
unsharded storage, to allocate it anew at the next all-gather. The unsharded parameter object
stays the same, but a graph reads device addresses, and a freed and re-allocated storage has no
fixed one.

So a graphed block that FSDP2 manages (``fully_shard(block)``, before or after
:func:`~paddle_graphpp.torch.layers.graph_layers`) changes two things, once, at its first call:

* its parameters keep their unsharded storage (:func:`keep_unsharded`): the all-gathers,
  reduce-scatters and optimizer steps run as before, outside the graphs, and copy into and out of
  the same memory every step; the block's unsharded parameters stay resident, as with
  ``reshard_after_forward=False`` and between steps too (the sharded optimizer states and
  gradients are still sharded);
* its captures see the unsharded parameters on the module (:func:`unsharded_view`), since a
  capture of a recorded step may run while FSDP2 has the sharded ones set.

Each graphed block must be an FSDP module itself (``fully_shard(block)`` for every block, then
``fully_shard(model)``, the layout torchtitan uses); a block whose parameters only the root
shards is refused at its first call, naming the fix. This reads FSDP2's parameter records
(``FSDPParam``: its module, parameter name and unsharded parameter), checked on torch 2.11 and 2.13.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

__all__ = ["fsdp_params", "keep_unsharded", "unsharded_view", "prepare", "check_block", "check_wrapped"]


def fsdp_params(module: nn.Module) -> list:
    """The FSDP2 parameter records of ``module``'s own ``fully_shard`` group (empty: not an FSDP2 module)."""
    get = getattr(module, "_get_fsdp_state", None)
    if get is None:
        return []
    group = getattr(get(), "_fsdp_param_group", None)
    return list(group.fsdp_params) if group is not None else []


def _keep_storage() -> None:
    """An FSDP parameter's ``free_unsharded_param`` in a graphed block: the storage stays."""


def keep_unsharded(module: nn.Module) -> int:
    """Make FSDP2 keep ``module``'s unsharded parameter storage allocated (its next all-gathers
    copy into the same memory). Returns how many parameters it manages."""
    params = fsdp_params(module)
    for fp in params:
        fp.free_unsharded_param = _keep_storage  # on the instance: found before the class's
    return len(params)


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


def prepare(block: nn.Module, engine: Any) -> None:
    """At a graphed block's first call: under FSDP2, keep its unsharded storage and let its
    captures see the unsharded parameters (``engine.capture_view``)."""
    if keep_unsharded(block):
        engine.capture_view = lambda: unsharded_view(block)


def check_block(name: str, block: nn.Module) -> None:
    """Refuse to graph ``block`` (named ``name``) whose parameters an enclosing ``fully_shard``
    shards (DTensors) while the block is no FSDP module of its own.

    Raises:
        TypeError: naming the block and the layout that works.
    """
    sharded = [n for n, p in block.named_parameters() if type(p).__name__ == "DTensor"]
    if sharded and getattr(block, "_get_fsdp_state", None) is None:
        raise TypeError(
            f"{name}: its parameters ({sharded[0]}, ...) are sharded by an enclosing fully_shard(), which "
            f"frees and re-allocates them around every use, where its graphs read fixed addresses. Call "
            f"fully_shard() on each graphed block (for block in model.model.layers: fully_shard(block)), "
            f"then on the model.")


def check_wrapped(name: str, module: nn.Module) -> None:
    """Refuse to wrap an FSDP2 module (or one holding FSDP2 modules) in ``CUDAGraphedModule``:
    its all-gathers would run inside the graphs, into storage it frees after each use.

    Raises:
        TypeError: naming the module and the order that works.
    """
    inner = [n or type(module).__name__ for n, m in module.named_modules() if hasattr(m, "_get_fsdp_state")]
    if inner:
        raise TypeError(
            f"{name}: {inner[0]} is an FSDP2 module (fully_shard), whose all-gathers would run inside the "
            f"graphs. Graph first, then shard: fully_shard(CUDAGraphedModule(block)), or graph_layers(blocks) "
            f"before fully_shard on each block.")
