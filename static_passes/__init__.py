"""Passes over legacy Paddle static programs (``FLAGS_enable_pir_api=0``).

``optimize_pipeline_send_wait`` removes a static pipeline's provably redundant forward-send
``c_sync_comm_stream`` ops and holds the sent variables with a ``nop`` after the backward recv
instead. Importing this package does not import Paddle; calling the pass does.
"""

from paddle_graphpp._lazy import lazy_attributes

from .report import ExistingNop, InsertedNop, KeptSend, PeerInfo, RemovedSync, SendWaitReport

# Loaded on first use, so that ``python -m static_passes.send_wait`` runs that module once.
_LAZY = {"SendWaitError": "static_passes.send_wait", "optimize_pipeline_send_wait": "static_passes.send_wait"}

__all__ = [
    "ExistingNop",
    "InsertedNop",
    "KeptSend",
    "PeerInfo",
    "RemovedSync",
    "SendWaitError",
    "SendWaitReport",
    "optimize_pipeline_send_wait",
]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
