"""Graph outputs handed out by replays, watched per storage: the PyTorch side of
:meth:`~paddle_graphpp.core.runtime.OutputRelease.hand_out` and
:meth:`~paddle_graphpp.core.runtime.OutputRelease.move_to_copies`.

:func:`hand_out` gives each output an alias over a storage of its own (DLPack), so that every
tensor made from it without a copy is seen; :func:`move_to_copies` moves a storage still alive
before a replay overwrites it. Where ``UntypedStorage._swap_data_ptr_`` exists (torch 2.13,
:func:`views_keep_values`) every such tensor keeps its values; else the alias moves to a copy and
the other tensors raise the engine's message (naming the layer, saying to clone) when read, or,
without that hook either, a warning names what still shares the old memory. Tensors DLPack cannot
carry are watched as objects. The mechanism:
docs/architecture.md#episodes-recordings-and-handed-out-outputs.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.dlpack import from_dlpack, to_dlpack

from ...core.runtime import GraphRuntime, clone_many
from ...core.warn import warn

__all__ = ["Held", "hand_out", "move_to_copies", "views_keep_values"]

_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
_POISON = getattr(torch._C, "_set_storage_data_ptr_access_error_msg", None)


def views_keep_values() -> bool:
    """Whether every tensor sharing a handed-out output's memory keeps its values when a later
    replay overwrites that memory (this torch can re-point a storage); otherwise only the
    handed-out object does, and the others raise when read (CUDA builds) or are warned about."""
    return _SWAP


class Held(NamedTuple):
    """What a watch found still in use: the alias's own storage (``None`` where the alias is
    watched as an object) and the alias object (``None`` once it is gone)."""

    storage: Optional[torch.UntypedStorage]
    tensor: Optional[torch.Tensor]


class _Watch:
    """Weak watch over one handed-out alias: its storage (when it has one of its own) and the
    object itself."""

    __slots__ = ("storage", "tensor")

    def __init__(self, alias: torch.Tensor, own_storage: bool):
        self.storage = StorageWeakRef(alias.untyped_storage()) if own_storage else None
        self.tensor = weakref.ref(alias)

    def __call__(self) -> Optional[Held]:
        if self.storage is None:
            t = self.tensor()
            return None if t is None else Held(None, t)
        if self.storage.expired():
            return None
        storage = torch.UntypedStorage._new_with_weak_ptr(self.storage.cdata)
        return None if storage is None else Held(storage, self.tensor())


def hand_out(tensors: Sequence[torch.Tensor]) -> tuple[list, list]:
    """Aliases of graph outputs ``tensors``, each over a storage of its own where DLPack can carry
    it, and their watches (``None`` for an empty one: nothing to overwrite)."""
    outs, watches = [], []
    for t in tensors:
        alias = _own_storage_alias(t)
        own = alias is not None
        if alias is None:
            alias = t.detach()
        outs.append(alias)
        watches.append(_Watch(alias, own) if alias.numel() else None)
    return outs, watches


def _own_storage_alias(t: torch.Tensor) -> Optional[torch.Tensor]:
    if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_quantized:
        return None
    try:
        return from_dlpack(to_dlpack(t.detach()))
    except (RuntimeError, BufferError, TypeError):  # a dtype or bit (conjugate, negative) DLPack lacks
        return None


def move_to_copies(runtime: GraphRuntime, held: Sequence[Held], overwritten: str) -> None:
    """Before a replay overwrites the memory ``held`` reaches (the module docstring says how)."""
    storages = [h.storage for h in held if h.storage is not None]
    swapped = storages if _SWAP else []
    objects = [h.tensor for h in held if h.tensor is not None and (h.storage is None or not _SWAP)]
    copies = clone_many(runtime, [*(_as_bytes(s) for s in swapped), *(t.detach() for t in objects)])
    for storage, copy in zip(swapped, copies):
        storage._swap_data_ptr_(copy.untyped_storage())  # the copy's storage takes the graph memory away
    for t, copy in zip(objects, copies[len(swapped):]):
        t.data = copy  # the object (and whoever holds it) keeps its values; autograd is unaffected
    if _SWAP:
        return
    # the alias object moved; other tensors over its storage (views, detached aliases) cannot
    for storage in storages:
        if _POISON is not None:
            _POISON(storage._cdata, overwritten)
        elif torch._C._storage_Use_Count(storage._cdata) > 1:  # more than the reference held here
            warn(f"{overwritten} (This torch cannot move such tensors: they now read the new values.)")


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A byte tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
