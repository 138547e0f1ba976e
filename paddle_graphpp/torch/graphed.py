"""``CUDAGraphedModule``: a torch.nn.Module whose forward and backward replay CUDA graphs."""

from __future__ import annotations

import torch

from ..core.engine import HoldsEngine, graphed_engine, graphed_label, graphed_layer_doc
from .compile import CompiledModule, opaque, options_for
from .runtime import _registered_generators, active_runtime

__all__ = ["CUDAGraphedModule"]

_COMPILE_DOC = """        compile: ``True`` or a dict of ``torch.compile`` keyword arguments: the module runs
            compiled (Inductor) inside the graphs. It compiles in the warmup calls and the
            capture records the compiled kernels; a recompile the capture would need raises
            :class:`paddle_graphpp.CaptureError` with dynamo's reason. Modes that record
            Inductor's own CUDA graphs (``"reduce-overhead"``) are refused. A module the user
            compiled already (``torch.compile(module)``, default mode) is graphed as it is.
            Without CUDA the module runs compiled and eagerly.
"""


class CUDAGraphedModule(HoldsEngine, torch.nn.Module):
    __doc__ = graphed_layer_doc(arg="module", base="torch.nn.Module", no_grad="torch.no_grad()",
                                accumulate_grads=True, generators=True, extra_args=_COMPILE_DOC)

    def __init__(self, module: torch.nn.Module, num_warmup_steps: int = 3, *, fallback: str = "error",
                 memory: str = "shared", max_in_flight: int = 64, max_signatures: int = 4,
                 accumulate_grads: bool | str = "auto", generators=None, compile=None, name: str | None = None):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"CUDAGraphedModule wraps a torch.nn.Module, got {type(module).__name__}")
        label = graphed_label("CUDAGraphedModule", module, name)
        self.module = module
        if isinstance(generators, (list, tuple)):
            try:
                _registered_generators(generators)  # check now, not at the first capture
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{label}: {exc}") from None
        options = options_for(module, compile, label)
        run = module if options is None else CompiledModule(module, options)
        self._engine = graphed_engine(
            run, active_runtime(), lambda: [p for p in module.parameters() if p.requires_grad],
            name=label, num_warmup_steps=num_warmup_steps, fallback=fallback,
            memory=memory, max_in_flight=max_in_flight, max_signatures=max_signatures,
            accumulate_grads=accumulate_grads, generators=generators)

    @opaque  # torch.compile around a graphed module calls it as it is (see .compile)
    def forward(self, *args, **kwargs):
        return self.run(args, kwargs)

    def run(self, args: tuple, kwargs: dict):
        """What ``forward`` does, without a module call: a graphed block calls this (hooks
        registered on this module do not run then)."""
        return self._engine(args, kwargs)
