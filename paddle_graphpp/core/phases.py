"""The phases of one graphed layer: its signatures, and the only code that moves them.

A layer's calls are grouped by input signature (:class:`~paddle_graphpp.core.records.Signature`);
each signature is in phase ``WARMUP``, ``RECORD`` or ``READY``
(:class:`~paddle_graphpp.core.records.Phase`, described in :mod:`paddle_graphpp.core.engine`),
and the layer as a whole may be ``EAGER`` for good (a failed capture with ``fallback="eager"``),
held once, as :attr:`LayerPhases.eager_reason`. :class:`LayerPhases` holds the table and moves a
signature only through its named transitions:

========================  ==============================  =========================================
transition                from -> to                      asked by
========================  ==============================  =========================================
:meth:`leave_warmup`      WARMUP -> RECORD (READY under   the engine, at the first forward of an
                          the stream-ordered allocator)   episode once warmup is done
:meth:`captured`          RECORD -> READY                 the episode's Recording, after its batch
:meth:`dropped`           RECORD (recording forgotten)    the Recording, when the runtime waits
:meth:`capture_failed`    any -> WARMUP                   the layer's capture, on a failure
:meth:`fall_back`         all -> EAGER (the layer)        the layer's capture, ``fallback="eager"``
:meth:`reset`             all forgotten                   ``reset_graphs``
========================  ==============================  =========================================
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from .records import Phase, Signature, SignatureView, describe

__all__ = ["LayerPhases"]

logger = logging.getLogger("paddle_graphpp")


class LayerPhases:
    """The signatures of one graphed layer (named ``name`` in messages), at most
    ``max_signatures`` of them, and the layer's one ``EAGER`` state."""

    def __init__(self, name: str, max_signatures: int):
        self.name = name
        self.max_signatures = max_signatures
        self._table: dict[Any, Signature] = {}
        #: Why the layer runs eagerly for good (phase ``EAGER``), or ``None``.
        self.eager_reason: Optional[str] = None

    # ------------------------------------------------------------ the table
    def get(self, key: Any) -> Optional[Signature]:
        """The signature ``key``, or ``None``."""
        return self._table.get(key)

    def all(self) -> list:
        """Every signature, in the order they were first seen."""
        return list(self._table.values())

    def add(self, call: Any, warn_once: Callable[[Any, str], None]) -> Optional[Signature]:
        """The signature of ``call`` (a :class:`~paddle_graphpp.core.records.Call`), new in phase
        ``WARMUP`` if unseen; ``None`` (with one warning) when ``max_signatures`` are taken."""
        sig = self._table.get(call.key)
        if sig is not None:
            return sig
        if len(self._table) >= self.max_signatures:
            warn_once(("full", call.key),
                      f"{self.name}: input signature {describe(call.shape.specs)} is new and "
                      f"{self.max_signatures} signatures are already captured "
                      f"(max_signatures); it runs eagerly. Pad inputs to a few fixed shapes, or "
                      f"raise max_signatures.")
            return None
        if self._table:
            logger.info("%s: new input signature %s; it will be warmed up and captured anew",
                        self.name, describe(call.shape.specs))
        sig = self._table[call.key] = Signature(call.key, describe(call.shape.specs), call.shape)
        return sig

    # ------------------------------------------------------------ transitions
    def leave_warmup(self, sig: Signature, params: tuple, accumulate: bool, *, in_step: bool) -> None:
        """``WARMUP -> RECORD``: the signature's parameters and gradient path are fixed, and it is
        recorded from this episode on; ``in_step`` (the stream-ordered allocator): ``-> READY``,
        each position captured in the step it first runs in."""
        sig.params, sig.accumulate = params, accumulate
        sig.phase = Phase.READY if in_step else Phase.RECORD

    def captured(self) -> None:
        """``RECORD -> READY``: the batch that captured the recording is over; recorded
        positions replay from now on."""
        for sig in self._table.values():
            sig.recordings.clear()
            if sig.phase is Phase.RECORD:
                sig.phase = Phase.READY

    def dropped(self) -> None:
        """The recording is not captured (the runtime asked to wait): the signatures stay in
        ``RECORD`` and the next episode is recorded instead."""
        for sig in self._table.values():
            sig.recordings.clear()

    def capture_failed(self, key: Any) -> None:
        """A capture of signature ``key`` failed: it forgets its graphs and warms up again."""
        sig = self._table.get(key)
        if sig is not None:
            sig.reset()

    def fall_back(self, reason: str) -> None:
        """The layer runs eagerly from now on (``EAGER``), every signature's graphs forgotten."""
        self.eager_reason = reason
        for sig in self._table.values():
            sig.reset()

    def reset(self) -> None:
        """Forget every signature (and ``EAGER``): the layer starts as newly wrapped."""
        self._table.clear()
        self.eager_reason = None

    def drop_generation(self, gen: Any) -> None:
        """Forget the positions captured into pool generation ``gen`` (they are recorded again
        when they run; their signatures stay ``READY``)."""
        for sig in self._table.values():
            for pos in [p for p, done in sig.positions.items() if done.generation is gen]:
                del sig.positions[pos]

    # ------------------------------------------------------------ reading
    def phase(self, key: Any = None) -> Optional[Phase]:
        """The phase of signature ``key`` (default: the only signature), or ``None``; ``EAGER``
        once the layer went eager for good."""
        if self.eager_reason is not None and (key is None or key in self._table):
            return Phase.EAGER
        if key is None:
            if len(self._table) != 1:
                return None
            return next(iter(self._table.values())).phase
        sig = self._table.get(key)
        return sig.phase if sig is not None else None

    def views(self) -> dict[Any, SignatureView]:
        """``{key: SignatureView}`` (copies, for inspection)."""
        eager = self.eager_reason is not None
        return {key: sig.view(Phase.EAGER if eager else sig.phase) for key, sig in self._table.items()}

    def positions(self) -> list:
        """Every captured position, by signature in the order they were first seen, then by position."""
        return [sig.positions[p] for sig in self._table.values() for p in sorted(sig.positions)]

    def accumulates(self, param: Any) -> bool:
        """Whether a signature past warmup that accumulates holds ``param`` (the layer not eager)."""
        return self.eager_reason is None and any(
            sig.accumulate and any(q is param for q in sig.params or ()) for sig in self._table.values())

