"""PyTorch API of paddle_graphpp.

Importing this package does not import torch (:mod:`paddle_graphpp.torch.memory.allocator` must work
before ``import torch``); its public names import torch on first use.
"""

from .._lazy import lazy_attributes

_LAZY = {
    "CUDAGraphedModule": "paddle_graphpp.torch.graphed",
    "graph_stage_module": "paddle_graphpp.torch.pipeline",
    "graph_loss": "paddle_graphpp.torch.pipeline",
    "graph_layers": "paddle_graphpp.torch.layers",
    "ungraph_layers": "paddle_graphpp.torch.layers",
    "causal_lm_stage": "paddle_graphpp.torch.hf",
    "graph_model": "paddle_graphpp.torch.whole",
    "ungraph_model": "paddle_graphpp.torch.whole",
    "graph_step": "paddle_graphpp.torch.step",
    "ColumnParallelLinear": "paddle_graphpp.torch.collectives.tensor_parallel",
    "RowParallelLinear": "paddle_graphpp.torch.collectives.tensor_parallel",
    "agree_on_captures": "paddle_graphpp.torch.collectives.agreement",
    "watch_replays": "paddle_graphpp.torch.watchdog",
    "capacity_experts": "paddle_graphpp.torch.moe",
    "capacity_overflows": "paddle_graphpp.torch.moe",
    "CapacityOverflow": "paddle_graphpp.torch.moe",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
