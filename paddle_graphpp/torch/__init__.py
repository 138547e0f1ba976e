"""PyTorch API of paddle_graphpp. Importing this module imports torch."""

import importlib

_LAZY = {
    "CUDAGraphedModule": "paddle_graphpp.torch.graphed",
    "graph_stage_module": "paddle_graphpp.torch.pipelining",
    "ColumnParallelLinear": "paddle_graphpp.torch.tensor_parallel",
    "RowParallelLinear": "paddle_graphpp.torch.tensor_parallel",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'paddle_graphpp.torch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
