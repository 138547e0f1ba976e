"""``CUDAGraphedModule``: a torch.nn.Module whose forward and backward replay CUDA graphs."""

from __future__ import annotations

import functools
from types import MappingProxyType

import torch

from ..core.engine import EngineHooks, HoldsEngine, graphed_engine, graphed_label, graphed_layer_doc
from ..core.layer import hooks_for
from ..core.options import EngineOptions, engine_options
from . import integrations
from .compile import CompiledModule, RunsInPlaceOf, opaque, options_for
from .runtime import registered_generators, active_runtime

__all__ = ["CUDAGraphedModule", "TORCH_OPTION_NOTES"]

#: What the PyTorch runtime adds to the engine options' documentation (every torch front door).
TORCH_OPTION_NOTES = MappingProxyType({
    "accumulate_grads": """On PyTorch the hooks that keep ``"auto"`` off are Python
        gradient-accumulation hooks, and a DistributedDataParallel forward around the layer.""",
    "generators": """On PyTorch: ``torch.Generator(device="cuda")`` objects (checked when the
        layer is built); the graph-safe states of Megatron-Core's RNG tracker are found and
        registered without this (:mod:`paddle_graphpp.torch.integrations.megatron`).""",
})

_COMPILE_DOC = """        compile: ``True`` or a dict of ``torch.compile`` keyword arguments: the module runs
            compiled (Inductor) inside the graphs. It compiles in the warmup calls and the
            capture records the compiled kernels; a recompile the capture would need raises
            :class:`paddle_graphpp.CaptureError` with dynamo's reason. Modes that record
            Inductor's own CUDA graphs (``"reduce-overhead"``) are refused. A module the user
            compiled already (``torch.compile(module)``, default mode) is graphed as it is.
            Without CUDA the module runs compiled and eagerly.
"""

_OUTPUTS_DOC = """Whatever still uses an output's memory then (the output, its
       ``.detach()``, a slice, a view, what a hook stored) is first moved to memory of its own,
       at the cost of a copy, and keeps its values. On a torch that cannot re-point a storage
       (``UntypedStorage._swap_data_ptr_``: 2.13 has it, 2.11 does not) only the output object
       moves; tensors made from it without a copy raise an error naming the layer when read
       after the overwrite: clone those."""

_WARNINGS_DOC = """    .. warning:: A backward that asks for input gradients only (``torch.autograd.grad``
       w.r.t. the inputs, as zero-bubble schedules' input pass does) runs the input half; the
       micro-batch stays in flight until a backward asks for the parameters' gradients (the
       weight pass), which receives them as autograd would (the schedule adds them into ``.grad``).
       With ``accumulate_grads`` (default ``"auto"``) the weight graph adds them into ``.grad``
       itself and ``torch.distributed.pipelining``'s weight pass is handed each parameter's
       whole sum with ``.grad`` unset, which it puts back into ``.grad``; per-micro-batch
       parameter gradients do not exist then, and any other weight pass raises
       :class:`paddle_graphpp.GraphScheduleError` (pass ``accumulate_grads=False`` for it).
"""


def torch_engine_options(owner: str, door, positional: tuple, keywords: dict, options, **refused: str) -> EngineOptions:
    """:func:`~paddle_graphpp.core.options.engine_options` for a torch front door, with the
    ``generators`` given as a list checked now (not at the first capture)."""
    chosen = engine_options(owner, door, positional, keywords, options=options, refused=refused)
    if isinstance(chosen.generators, (list, tuple)):
        try:
            registered_generators(chosen.generators)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{owner}: {exc}") from None
    return chosen


class CUDAGraphedModule(HoldsEngine, torch.nn.Module):
    _wraps = "module"
    __doc__ = graphed_layer_doc(arg="module", base="torch.nn.Module", no_grad="torch.no_grad()",
                                outputs=_OUTPUTS_DOC, notes=TORCH_OPTION_NOTES, extra_args=_COMPILE_DOC,
                                warnings=_WARNINGS_DOC)

    def __init__(self, module: torch.nn.Module, *warmup: int, compile=None, name: str | None = None,
                 options: EngineOptions | None = None, **engine_kwargs: object):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"CUDAGraphedModule wraps a torch.nn.Module, got {type(module).__name__}")
        label = graphed_label("CUDAGraphedModule", module, name)
        if not isinstance(module, RunsInPlaceOf):  # graph_layers' blocks are checked by graph_layers (.layers)
            integrations.check_wrapped(label, module)
        self.module = module
        chosen = torch_engine_options(label, CUDAGraphedModule.__init__, warmup, engine_kwargs, options)
        compiled = options_for(module, compile, label)
        if chosen.recompute and compiled is not None:
            raise ValueError(f"{label}: recompute=True with compile= is not supported: the compiled forward would "
                             f"compile anew for the capture without autograd. Pass one of them.")
        run = module if compiled is None else CompiledModule(module, compiled)
        self._engine = graphed_engine(run, active_runtime(), lambda: [p for p in module.parameters() if p.requires_grad],
                                      name=label, options=chosen, hooks=hooks_for(module, label, chosen, EngineHooks(
                                          capture_view=functools.partial(integrations.capture_view, self, label))))

    @opaque  # torch.compile around a graphed module calls it as it is (see .compile)
    def forward(self, *args, **kwargs):
        if integrations.PREPARED not in self.__dict__:  # fully_shard(CUDAGraphedModule(...)) shards this module
            integrations.prepare(self, self._engine.name)
        return self.run(args, kwargs)

    def run(self, args: tuple, kwargs: dict):
        """What ``forward`` does, without a module call: a graphed block calls this (hooks
        registered on this module do not run then)."""
        return self._engine(args, kwargs)

    def undo(self) -> torch.nn.Module:
        """Release the graphs and return ``module`` (graphing left it unchanged); FSDP2 frees its
        unsharded storage after use again. This wrapper refuses calls afterwards.

        Raises:
            GraphScheduleError: micro-batches are in flight (undo between steps); nothing changes.
            RuntimeError: undone already.
        """
        module = super().undo()
        integrations.release(self)
        return module
