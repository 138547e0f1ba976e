"""What a batch of captures, the recording and the process's services ask of one graphed layer.

:class:`CaptureParticipant` is the layer as the process-wide machinery sees it (implemented by
:class:`~paddle_graphpp.core.layer_capture.LayerCapture`); it is also the identity under which the
recording, the handed-out outputs, the replay watchdog and the gradient owners keep a layer's
entries. This module imports nothing of the package, so that each of them can name it.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

__all__ = ["CaptureParticipant"]


class CaptureParticipant(Protocol):
    """What a capture batch asks of one graphed layer (each call between two captures, never
    inside one; ``batch`` is the running :class:`~paddle_graphpp.core.batch.CaptureBatch`)."""

    name: str

    def forward(self, key: Any, position: int, batch: Any) -> Optional[Any]:
        """Capture the forward of recorded ``position``; its live autograd graph, or ``None``
        when the position cannot be captured now (it is recorded again when it next runs).
        The live state (and an input half's) names its pool as ``generation``, and a failure
        of capture (not of the layer's own code) the pool it failed in the same way."""

    def backward(self, key: Any, position: int, live: Any, batch: Any) -> None:
        """Capture its whole backward from ``live``, completing the position."""

    def backward_input(self, key: Any, position: int, live: Any, batch: Any) -> Any:
        """Capture the input half of its split backward; what the weight half needs."""

    def backward_weight(self, key: Any, position: int, half: Any, batch: Any) -> None:
        """Capture the weight half, completing the position."""

    def failed(self, key: Any, error: BaseException) -> Optional[BaseException]:
        """A capture of signature ``key`` failed: the error to raise (after the batch), or
        ``None`` when the layer turned eager instead."""

    def grad_slots(self, key: Any, position: int) -> tuple:
        """The slots (or links) of the incoming gradients recorded for ``position``."""

    def recording_dropped(self) -> None:
        """The recording is not captured (the runtime asked to wait)."""

    def recording_captured(self) -> None:
        """The batch is over: recorded positions replay from now on."""

    def drop_generation(self, gen: Any) -> None:
        """(Asked by the process after a batch.) Forget the positions captured into pool
        generation ``gen``: they are recorded and captured again."""

    def accumulates_in_graphs(self, param: Any) -> bool:
        """(Asked by the process.) Whether this layer's graphs add ``param``'s gradient into ``.grad``."""
