"""What a graphed layer keeps for recomputation (``recompute``: activation checkpointing).

A recomputing call's forward graph keeps no activations; its backward graph runs the forward
again (``core.layer_capture``). :class:`LayerRecompute` says, per call, whether the layer
recomputes (``when``: the option, or what the front door reads, such as a Hugging Face block's
gradient checkpointing), refuses what such graphs cannot do when a signature leaves warmup, and
holds the layer's RNG mirrors (:class:`~paddle_graphpp.core.runtime.RngMirror`), which its
forward replays note and its backward replays restore.
"""

from __future__ import annotations

from typing import Any, Callable

from .errors import GraphScheduleError
from .layer import Layer

__all__ = ["LayerRecompute"]


class LayerRecompute:
    """The recomputation side of one graphed :class:`~paddle_graphpp.core.layer.Layer`."""

    def __init__(self, layer: Layer):
        self.layer = layer
        #: Whether a call recomputes: the option, or what the front door reads per call (its hook).
        self.when: Callable[[], bool] = layer.hooks.recomputes or (lambda: layer.options.recompute)
        self._mirror: Any = None

    def check(self) -> None:
        """A recomputing signature leaves warmup: refuse what its graphs cannot do; make the RNG
        mirrors now, over the generators its captures register (the runtime refuses what it
        cannot mirror)."""
        layer = self.layer
        if layer.process().plan.async_allocator:
            raise GraphScheduleError(
                f"{layer.name}: recompute (activation checkpointing) is not supported under the stream-ordered "
                f"allocator (use_cuda_malloc_async_allocator), which captures within the step. Use the default "
                f"caching allocator, or turn checkpointing off for graphed layers.")
        if callable(layer.options.generators):
            raise GraphScheduleError(
                f"{layer.name}: recompute (activation checkpointing) with generators= given as a callable: the "
                f"generators its graphs draw from must be known when it leaves warmup. Pass a list.")
        if layer.caps.recomputation is not None:
            try:
                self.mirror()
            except ValueError as exc:
                raise GraphScheduleError(f"{layer.name}: {exc}") from None

    def mirror(self) -> Any:
        """The layer's RNG mirrors, made once over the generators it registers."""
        if self._mirror is None:
            self._mirror = self.layer.caps.recomputation.rng_mirror(self.layer.generators())
        return self._mirror

    def reset(self) -> None:
        self._mirror = None
