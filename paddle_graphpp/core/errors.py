"""Errors the engine raises. Each message names the graphed layer and says what to do."""

__all__ = ["GraphedLayerError", "CaptureError", "GraphScheduleError", "SignatureError"]


class GraphedLayerError(RuntimeError):
    """Base class of every error the graph engine raises."""


class CaptureError(GraphedLayerError):
    """Capturing a layer's forward or backward failed; the capture's memory was released."""


class GraphScheduleError(GraphedLayerError):
    """Forwards and backwards did not pair up as a FIFO schedule requires."""


class SignatureError(GraphedLayerError, ValueError):
    """The inputs cannot be graphed as given (non-tensor where a tensor was captured, ...)."""
