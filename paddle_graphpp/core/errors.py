"""Errors the engine raises. Each message names the graphed layer and says what to do."""

import traceback

__all__ = ["GraphedLayerError", "CaptureError", "CaptureFallbackWarning", "GraphScheduleError", "SignatureError", "StateReplacedError",
           "ReplayTimeoutError", "CollectiveTimeoutError"]


class GraphedLayerError(RuntimeError):
    """Base class of every error the graph engine raises."""


class CaptureError(GraphedLayerError):
    """Capturing a graph (a layer's forward or backward, a whole step, a ``graph_process``
    function) failed; the capture's memory was released."""


class CaptureFallbackWarning(RuntimeWarning):
    """A capture failed and, as ``fallback="eager"`` asks, the layer or step runs eagerly from now
    on. Filter it like any warning (``warnings.filterwarnings("ignore", category=...)``)."""


class GraphScheduleError(GraphedLayerError):
    """Forwards and backwards did not pair up as a FIFO schedule requires."""


class SignatureError(GraphedLayerError, ValueError):
    """The inputs cannot be graphed as given (non-tensor where a tensor was captured, ...)."""


class StateReplacedError(GraphedLayerError):
    """A parameter, buffer or optimizer state tensor that a captured graph reads was replaced
    (new storage, or another tensor in its place) since the capture; replaying would compute
    with the old memory, so the replay is refused."""


class ReplayTimeoutError(GraphedLayerError):
    """A graph replay did not complete within the replay timeout (a collective in it waits for a
    peer that died or stalled), or a peer rank's capture failed; the process cannot go on."""


class CollectiveTimeoutError(ReplayTimeoutError):
    """A custom all-reduce gave up waiting for a peer (named in the message) after its timeout;
    the group's kernels no longer agree on where they are, so the process cannot go on."""


def release_frames(exc: BaseException) -> None:
    """Clear the local variables of the finished frames in the tracebacks of ``exc`` and of
    every exception it chains (its cause and its context, both). A failed capture's tensors
    (static buffers, partial outputs) and its pool are locals of those frames: an error kept by
    the caller would keep their memory. The traceback's file and line information stays."""
    seen: set = set()
    todo = [exc]
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        todo += [exc.__cause__, exc.__context__]
