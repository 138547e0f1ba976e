"""Passes over legacy Paddle static programs (``FLAGS_enable_pir_api=0``).

``optimize_pipeline_send_wait`` removes a static pipeline's provably redundant forward-send
``c_sync_comm_stream`` ops and holds the sent variables with a ``nop`` after the backward recv
instead. Importing this package does not import Paddle; calling the pass does.
"""

import importlib

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


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'static_passes' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
