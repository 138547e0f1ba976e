"""What :func:`paddle_graphpp.graph_pipeline` knows about the libraries a pipeline model comes from,
one adapter module per library.

* :mod:`.fleet`: Paddle fleet's ``PipelineLayer``: its entry lists and recompute settings (private
  attributes, read here only), the configurations graphed runs cannot run, Paddle's own graphs.
* :mod:`.paddleformers`: PaddleFormers' pipe models: its version, its in-layer recompute and its
  ``autocudagraph`` decorator, refused; its mixtures of experts, graphed in parts.

Each adapter is an :class:`Adapter`; :func:`adapters` loads them when graphing starts (never per
call), and the front door asks each the same three questions. Generic code imports no adapter; the
fleet front door (:mod:`paddle_graphpp.paddle.pipeline`) also reads fleet's lists through
:mod:`.fleet`. None imports PaddleFormers.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional, Sequence

from paddle_graphpp.core.segment import Parts

__all__ = ["Adapter", "Parts", "adapters", "graph_parts"]

# name -> the module defining its ADAPTER; asked in this order.
_ADAPTERS: Mapping[str, str] = MappingProxyType({
    "fleet": "paddle_graphpp.paddle.integrations.fleet",
    "paddleformers": "paddle_graphpp.paddle.integrations.paddleformers",
})


@dataclass(frozen=True, slots=True)
class Adapter:
    """One library, as the pipeline front door asks about a model; every answer defaults to nothing.

    ``entries`` is fleet's view of the model on this rank: ``(chunk id or None, first layer index,
    fleet's run_function list)`` per chunk (:func:`.fleet.entry_lists`).
    """

    def start(self, model) -> None:
        """Graphing of ``model`` starts: check what must hold before anything else (the library's
        supported version, for a model of the library). Raises to stop graphing."""

    def refuse(self, model, subject: str, entries: Sequence[tuple]) -> None:
        """Raise ``ValueError`` for what graphed runs cannot take over in ``model``, naming ``subject``
        (the call) and the fix, before anything is changed."""

    def graph_parts(self, name: str, layer) -> Optional[Parts]:
        """For a pipeline entry a capture cannot hold whole (a mixture of experts' host-reading
        dispatch): the :class:`Parts` to graph around what cannot be captured; ``None``: the entry
        is none of this library's, or graphs whole."""
        return None


def adapters() -> tuple:
    """Every registered adapter, loaded on first use (the modules import no outside library)."""
    return tuple(importlib.import_module(module).ADAPTER for module in _ADAPTERS.values())


def graph_parts(adapters: Sequence[Adapter], name: str, layer) -> Optional[Parts]:
    """The first of ``adapters``' :meth:`Adapter.graph_parts` of ``layer`` that is not ``None``."""
    for adapter in adapters:
        parts = adapter.graph_parts(name, layer)
        if parts is not None:
            return parts
    return None
