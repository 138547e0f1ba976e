"""paddle_graphpp: CUDA Graphs for pipeline-parallel training.

``import paddle_graphpp`` imports neither Paddle nor PyTorch. The Paddle API lives in
``paddle_graphpp.paddle`` and is re-exported here (Paddle first); the PyTorch API lives in
``paddle_graphpp.torch``; the cross-framework entry points (the allocator switch, the graphed
optimizer, the graph API) are the modules at this level. Every name loads its framework on first use.
"""

import os

from ._lazy import lazy_attributes
from .paddle import _LAZY as _PADDLE_API

__version__ = "0.1.0"

# Public name -> module defining it. Resolved on first attribute access (PEP 562), so that
# importing the package stays free of framework imports.
_LAZY = {
    **_PADDLE_API,  # the Paddle API, re-exported (paddle_graphpp.paddle imports no framework)
    "EngineOptions": "paddle_graphpp.core.options",
    "mark_not_capturable": "paddle_graphpp.core.segment",
    "memory_report": "paddle_graphpp.core.memory",
    "MemoryMode": "paddle_graphpp.core.memory",
    "CaptureError": "paddle_graphpp.core.errors",
    "CaptureFallbackWarning": "paddle_graphpp.core.errors",
    "GraphScheduleError": "paddle_graphpp.core.errors",
    "StateReplacedError": "paddle_graphpp.core.errors",
    "ReplayTimeoutError": "paddle_graphpp.core.errors",
    "CollectiveTimeoutError": "paddle_graphpp.core.errors",
    "reset_graphs": "paddle_graphpp.core.engine",
    "drop_in_flight": "paddle_graphpp.core.engine",
    "use_cuda_malloc_async_allocator": "paddle_graphpp.allocator",
    "AllocatorSwitchError": "paddle_graphpp.allocator",
    "capture_custom_allreduce": "paddle_graphpp.core.collectives",
    "sot_warmup_guard": "paddle_graphpp.core.guards",
    "in_sot_warmup_mode": "paddle_graphpp.core.guards",
    "graph_process": "paddle_graphpp.graph_api",
    "create_graph": "paddle_graphpp.graph_api",
    "capture_to_graph": "paddle_graphpp.graph_api",
    "replay_graph": "paddle_graphpp.graph_api",
    "GraphedOptimizer": "paddle_graphpp.optim",
    "clip_by_global_norm": "paddle_graphpp.optim",
    "global_grad_norm": "paddle_graphpp.optim",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

if os.environ.get("FLAGS_use_cuda_malloc_async_allocator"):
    # The environment switch: takes effect for torch if it is not imported yet (Paddle reads the
    # flag itself). Imports no framework; a switch that comes too late warns.
    from .allocator import apply_env_switch as _apply_env_switch

    _apply_env_switch()
