"""Sublayers graphed in place: :func:`graphed_forward` and :func:`swap_in`, :func:`ungraph_in_place`.

A pipeline entry a capture cannot hold whole (a mixture of experts whose dispatch reads the host)
keeps its own forward eager; the sublayers its library's adapter names (an attention) are
graphed where they are. Each stays the same object: its class becomes a subclass of its own
(``GraphedQwen2MoeAttention`` of ``Qwen2MoeAttention``) whose ``forward`` runs a
:class:`~paddle_graphpp.CUDAGraphedLayer` around the class's original forward, kept in the
sublayer's ``__dict__``, not registered as a sublayer. Names, ``state_dict()`` keys, parameters,
``isinstance`` checks and hooks on the sublayer are as before. The PyTorch runtime's counterpart
is ``paddle_graphpp.torch.layers`` (docs/moe.md).
"""

from __future__ import annotations

from paddle import nn

from ..core.layer import EngineHooks
from ..core.options import EngineOptions
from ..core.process import current_process
from .graphed import CUDAGraphedLayer

__all__ = ["GraphedPart", "graphed_forward", "swap_in", "ungraph_in_place"]

_SLOT = "_graphpp_graphed"  # where a graphed sublayer keeps its CUDAGraphedLayer (outside _sub_layers)


class _OriginalForward(nn.Layer):
    """The sublayer's own class's forward, as the graphed layer runs it (the sublayer's call and
    hooks happened already, in the graphed class's call)."""

    def __init__(self, part: nn.Layer, original: type):
        super().__init__()
        self.add_sublayer("part", part)  # its parameters are the engine's
        self._original = original

    def graph_engine_hooks(self, name: str, options: EngineOptions) -> EngineHooks:
        return EngineHooks(recomputes=lambda: options.recompute)

    @property
    def training(self):
        # follows the sublayer, which model.train() / model.eval() reach (the engine keys on it)
        part = self.__dict__.get("_sub_layers", {}).get("part")
        return True if part is None else part.training

    @training.setter
    def training(self, mode):
        pass  # follows the sublayer (see the getter)

    def forward(self, *args, **kwargs):
        return self._original.forward(self._sub_layers["part"], *args, **kwargs)


class GraphedPart(nn.Layer):
    """Base of the classes :func:`swap_in` gives graphed sublayers (``Graphed<Class>``),
    placed before the sublayer's own class; it only replaces ``forward`` and adds ``graphed`` and
    ``engine``."""

    _graphpp_original: type = nn.Layer

    def forward(self, *args, **kwargs):
        return self.__dict__[_SLOT](*args, **kwargs)

    @property
    def graphed(self) -> CUDAGraphedLayer:
        """The ``CUDAGraphedLayer`` that runs this sublayer's forward (not a sublayer of it)."""
        return self.__dict__[_SLOT]

    @property
    def engine(self):
        """The graph engine: ``replays``, ``captures``, ``in_flight`` and ``graph_count()``."""
        return self.__dict__[_SLOT].engine


class GraphedPartClasses(dict):
    """A sublayer's class -> its class graphed in place, made once (a part of the paddle section)."""


def _graphed_class(cls: type) -> type:
    classes = current_process().section("paddle").part(GraphedPartClasses)
    found = classes.get(cls)
    if found is None:
        found = classes[cls] = type(f"Graphed{cls.__name__}", (GraphedPart, cls),
                                    {"_graphpp_original": cls, "__module__": cls.__module__})
    return found


def graphed_forward(label: str, part: nn.Layer, *, options: EngineOptions) -> CUDAGraphedLayer:
    """The :class:`~paddle_graphpp.CUDAGraphedLayer` that will run ``part``'s forward once
    :func:`swap_in` graphs it in place, its engine named ``label`` with ``options``; ``part`` is
    not changed yet.

    Raises:
        TypeError: ``part`` is graphed in place already.
    """
    if isinstance(part, GraphedPart):
        raise TypeError(f"{label} ({type(part).__name__}) is graphed in place already; each sublayer is graphed once")
    return CUDAGraphedLayer(_OriginalForward(part, type(part)), name=label, options=options)


def swap_in(part: nn.Layer, graphed: CUDAGraphedLayer) -> None:
    """Graph ``part`` in place: its class becomes ``Graphed<Class>``, whose forward runs ``graphed``
    (made by :func:`graphed_forward` for it)."""
    part.__dict__[_SLOT] = graphed  # not a sublayer: no new parameter names or state_dict keys
    part.__class__ = _graphed_class(type(part))


def ungraph_in_place(parts) -> None:
    """Give each sublayer of ``parts`` graphed in place its own class back (its engine is the
    caller's to retire). Others are left as they are."""
    for part in parts:
        if isinstance(part, GraphedPart):
            part.__class__ = type(part)._graphpp_original
            part.__dict__.pop(_SLOT, None)
