"""Graphed stages for ``torch.distributed.pipelining``: :func:`graph_stage_module`, :func:`graph_loss`.

:func:`graph_stage_module` splits a stage (an ordered list of modules) into runs of contiguous
capturable modules (:mod:`paddle_graphpp.core.segment`) and wraps each run in a
:class:`~paddle_graphpp.torch.graphed.CUDAGraphedModule`; modules listed in ``shared=``, weights
used twice in the stage, plain callables and modules marked not capturable stay eager between
them. The result is an ordinary module for ``PipelineStage`` under the 1F1B, interleaved and
zero-bubble schedules; sends and receives stay outside the graphs, and each run keeps its own
FIFO of micro-batches in flight. :func:`graph_loss` graphs the last stage's loss with the stage's
graphs, in their pool. Both are undone by ``undo()`` on what they return. Bad input (an empty
stage, a ``shared`` module not in it, a stage graphed twice, a loss compiled with Inductor's own
graphs) raises when built. Usage and the schedules: docs/pytorch.md and docs/pipelines.md.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..core import segment
from ..core.options import EngineOptions
from . import integrations
from .compile import compile_options, compiled_module, options_for
from .graphed import CUDAGraphedModule, torch_engine_options

__all__ = ["graph_stage_module", "graph_loss", "GraphedLoss", "GraphedStage"]


class _Call(nn.Module):
    """A plain callable as a module, so that every step of a stage is a module."""

    def __init__(self, fn: Callable, name: str):
        super().__init__()
        self.fn = fn
        self.name = name

    def forward(self, *args):
        return self.fn(*args)

    def extra_repr(self) -> str:
        return self.name


def _chain(steps: Sequence[Callable], args: tuple):
    out = None
    for step in steps:
        out = step(*args)
        args = out if isinstance(out, tuple) else (out,)
    return out


class _Run(nn.Module):
    """Contiguous modules called in order, a tuple output unpacked into the next call; each
    through ``torch.compile`` when ``compiled`` gives its options (modules of one class share the
    compiled code)."""

    def __init__(self, modules: Sequence[nn.Module], compiled: Optional[dict] = None):
        super().__init__()
        self.layers = nn.ModuleList(modules)
        self.__dict__["_calls"] = None if compiled is None else [compiled_module(m, compiled) for m in modules]

    def forward(self, *args):
        return _chain(self._calls or self.layers, args)


class GraphedStage(nn.Module):
    """A pipeline stage split into graphed runs and eager entries; made by :func:`graph_stage_module`.

    Calling it calls each step in order: the stage's inputs go to the first step as positional
    arguments, and each step's output feeds the next (a tuple is unpacked into positional
    arguments). Parameters are the original modules' own (not copies), so an optimizer built on
    either the original stage or this module updates the same tensors; the ``state_dict`` keys
    differ, so save and load checkpoints through the original stage module.

    Attributes:
        steps: ``nn.ModuleList`` of the steps, in order: ``CUDAGraphedModule`` for a graphed
            run, the entry itself (or a wrapper for a plain callable) for an eager one.
        runs: the :class:`paddle_graphpp.core.segment.Run` records behind ``steps``.
    """

    def __init__(self, steps: Sequence[nn.Module], runs: Sequence[segment.Run]):
        super().__init__()
        self.steps = nn.ModuleList(steps)
        self.runs = list(runs)

    def forward(self, *args):
        return _chain(self.steps, args)

    def describe(self) -> str:
        """One line per run: which entries are graphed together and why the others stay eager."""
        return segment.describe_runs(self.runs)

    @property
    def graphed_modules(self) -> list:
        """The ``CUDAGraphedModule`` of each graphed run, in order."""
        return [step for step, run in zip(self.steps, self.runs) if run.graphed]

    def undo(self) -> Any:
        """Release every graphed run's graphs and return the stage :func:`graph_stage_module` was
        given (the same object, which graphing left unchanged). This module refuses calls afterwards.

        Raises:
            GraphScheduleError: micro-batches are in flight in a run (undo between steps); nothing changes.
            RuntimeError: undone already.
        """
        _undo_all(self.graphed_modules, "call the stage GraphedStage.undo() returned, or graph it again")
        return self.__dict__["_original"]


def _stage_items(stage: Any) -> list:
    if isinstance(stage, GraphedStage):
        raise TypeError("graph_stage_module() got a GraphedStage: the stage is already graphed")
    if isinstance(stage, nn.Sequential):
        items = list(stage)
    elif isinstance(stage, (list, tuple, nn.ModuleList)):
        items = list(stage)
    elif isinstance(stage, nn.Module):
        raise TypeError(
            f"graph_stage_module() needs the stage as an ordered list of modules, got a "
            f"{type(stage).__name__}. Build the stage as nn.Sequential(...) (or pass a list of "
            "its modules and callables), or wrap the whole module in CUDAGraphedModule instead."
        )
    else:
        raise TypeError(f"graph_stage_module() expects nn.Sequential or a list of modules, got {type(stage).__name__}")
    if not items:
        raise ValueError("graph_stage_module() got an empty stage; give it at least one module")
    for index, item in enumerate(items):
        if not callable(item):
            raise TypeError(f"stage entry {index} ({item!r}) is neither a module nor a callable")
        if type(item).__name__ == "CUDAGraphedModule":
            raise TypeError(
                f"stage entry {index} is already a CUDAGraphedModule; pass the plain module "
                "and let graph_stage_module() decide what to graph"
            )
    return items


def _tied_entries(items: list, shared: Iterable[nn.Module]) -> set:
    """Indices of entries that hold a shared module, or a parameter also used by another entry."""
    shared = list(shared)
    tied: set = set()
    found = [False] * len(shared)
    owners: dict = {}
    for index, item in enumerate(items):
        if not isinstance(item, nn.Module):
            continue
        subs = list(item.modules())
        for k, module in enumerate(shared):
            if any(sub is module for sub in subs):
                tied.add(index)
                found[k] = True
        for param in item.parameters():
            owners.setdefault(id(param), set()).add(index)
    for k, module in enumerate(shared):
        if not isinstance(module, nn.Module):
            raise TypeError(f"shared= takes modules, got {module!r}")
        if not found[k]:
            raise ValueError(
                f"shared module {type(module).__name__} is not part of this stage; pass the module "
                "(or the entry containing it) whose weights are tied with another stage"
            )
    for indices in owners.values():
        if len(indices) > 1:  # a weight tied between entries of the same stage
            tied.update(indices)
    return tied


def graph_stage_module(
    stage: Any,
    *warmup: int,
    shared: Iterable[nn.Module] = (),
    name: Optional[str] = None,
    compile: Any = None,
    options: Optional[EngineOptions] = None,
    **engine_kwargs: Any,
) -> GraphedStage:
    """Split a pipeline stage into runs of capturable modules, each captured as CUDA graphs.

    Args:
        stage: the stage as ``nn.Sequential``, or a list of modules and plain callables, in
            execution order. Each entry takes the previous entry's output (a tuple is unpacked
            into positional arguments).
        shared: modules to keep eager between the graphs. A weight tied to another stage (a
            tied embedding or output head) need not be listed: graphed, its gradient is added
            into ``.grad`` within each backward, as eagerly, and the reduction across stages
            after the backwards reads it there; graphed, its temporaries share the graphs'
            memory instead of adding to it (docs/memory.md). List it to keep it eager, for
            example when a hook reduces its gradient during the backward. Weights used by two
            entries of this stage are detected and kept eager without being listed.
        name: prefix of the graphed runs' names in logs and errors (``"stage"`` by default).
        compile: ``True`` or a dict of ``torch.compile`` keyword arguments: each module of a
            graphed run runs compiled (Inductor) inside the run's graphs, compiled in the warmup
            and captured; modules of one class share the compiled code. Eager entries stay
            uncompiled. See ``CUDAGraphedModule``.
        options, **engine_kwargs: the engine options of each graphed run's ``CUDAGraphedModule``
            (an :class:`paddle_graphpp.EngineOptions`, or its fields by keyword,
            ``num_warmup_steps`` also positionally).

    Returns:
        A :class:`GraphedStage` sharing the stage's parameters. On CPU tensors the graphed
        runs compute eagerly (``CUDAGraphedModule`` warns once), so the same code serves gloo
        test runs and NCCL GPU runs. Its ``undo()`` releases the graphs and returns ``stage``,
        which graphing leaves unchanged.

    Raises:
        TypeError: ``stage`` is not an ordered list of modules/callables, or is already graphed;
            a keyword that is not an option (the message lists the valid names).
        ValueError: the stage is empty, or a ``shared`` module is not part of it.

    Warning:
        Every graphed run sees fixed input shapes: keep micro-batch size and sequence length
        constant (pad to a fixed length), as pipeline schedules already require.

    Warning:
        Pass ``input_args`` and ``output_args`` to ``PipelineStage``. Without them the stage
        infers shapes by running the module once more (an extra warmup call; on older PyTorch
        on the meta device, where the runs fall back to eager with a warning).

    Warning:
        Modules with data-dependent shapes, host synchronisation (``.item()``) or collectives of
        their own cannot be replayed faithfully: mark them with
        ``paddle_graphpp.mark_not_capturable(module)`` so they stay eager.
    """
    owner = f"graph_stage_module({name or 'stage'})"
    chosen = torch_engine_options(owner, graph_stage_module, warmup, engine_kwargs, options)
    compiled = compile_options(compile, owner)
    items = _stage_items(stage)
    tied = _tied_entries(items, shared)
    entries = [
        segment.classify(
            index,
            item,
            is_layer=lambda obj: isinstance(obj, nn.Module),
            shared=index in tied,
            sublayers=list(item.modules())[1:] if isinstance(item, nn.Module) else None,
        )
        for index, item in enumerate(items)
    ]
    runs = segment.split_into_runs(entries)
    prefix = name or "stage"
    steps: list = []
    for run in runs:
        if run.graphed:
            run_name = f"{prefix}[{run.start}:{run.stop}]"
            steps.append(CUDAGraphedModule(_Run(run.objects(), compiled), name=run_name, options=chosen))
        else:
            entry = run.entries[0]
            steps.append(entry.obj if isinstance(entry.obj, nn.Module) else _Call(entry.obj, entry.name))
    graphed = GraphedStage(steps, runs)
    graphed.__dict__["_original"] = stage  # not a submodule: the stage's names stay out of this module's
    return graphed


def _undo_all(wrappers: list, fix: str) -> None:
    """Release the graphs of each ``CUDAGraphedModule`` of ``wrappers`` (as its ``undo()`` does),
    after checking them all, so that a refusal changes nothing; a later call raises, saying ``fix``."""
    for wrapper in wrappers:
        wrapper.engine.check_undo()
    for wrapper in wrappers:
        wrapper.engine.retire(fix)
        integrations.release(wrapper)


class _Loss(nn.Module):
    """A loss function as a module: ``loss_fn(output, target, **kwargs)``."""

    def __init__(self, loss_fn: Callable):
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, *args, **kwargs):
        return self.loss_fn(*args, **kwargs)

    def extra_repr(self) -> str:
        return getattr(self.loss_fn, "__name__", type(self.loss_fn).__name__)


class GraphedLoss(nn.Module):
    """What :func:`graph_loss` returns: the graphed loss, each call's value copied out of the
    graph's output buffer (a scalar copy), so that the losses a schedule collects over a step are
    each micro-batch's own. (On the last stage every micro-batch is its own episode and replays
    the same graph: without the copy all of a step's losses would be the last one.)

    Attributes:
        graphed: the ``CUDAGraphedModule`` of the loss; ``engine`` is its engine.
    """

    def __init__(self, graphed: nn.Module):
        super().__init__()
        self.graphed = graphed

    @property
    def engine(self):
        return self.graphed.engine

    def forward(self, *args, **kwargs):
        out = self.graphed(*args, **kwargs)
        return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, out)

    def undo(self) -> Callable:
        """Release the loss's graphs and return the loss function :func:`graph_loss` was given
        (unchanged). This module refuses calls afterwards.

        Raises:
            GraphScheduleError: a micro-batch's backward has not run yet (undo between steps).
            RuntimeError: undone already.
        """
        _undo_all([self.graphed], "call the loss function GraphedLoss.undo() returned, or graph it again")
        module = self.graphed.module
        return module.loss_fn if isinstance(module, _Loss) else module


def graph_loss(loss_fn: Callable, *warmup: int, compile: Any = None, name: Optional[str] = None,
               options: Optional[EngineOptions] = None, **engine_kwargs: Any) -> GraphedLoss:
    """The last stage's loss function, captured as CUDA graphs with the stage's graphs.

    Pass the result as the schedule's ``loss_fn``. Each micro-batch position's loss (forward
    and backward) is recorded and captured in the step's order into the shared pool, so its
    temporaries reuse memory the stage's graphs hold anyway, and its launches are replayed.
    Each call returns its own loss tensor (copied out of the graph's output).

    Args:
        loss_fn: ``loss_fn(output, target, **kwargs) -> loss`` (a function or an ``nn.Module``
            without trainable parameters). It must keep shapes fixed (a graph replays the shapes
            it captured); a loss that reads a Python value per call (a changing scale) must take
            it as a tensor.
        compile: ``True`` or a dict of ``torch.compile`` keyword arguments: the loss runs
            compiled (Inductor: the vocabulary-sized softmax, its reduction and their backward
            fused) inside its graphs, as the stage's modules do with ``graph_stage_module(...,
            compile=...)``. Without CUDA it runs compiled and eagerly.
        name: its name in logs and errors (``"loss"`` by default).
        options, **engine_kwargs: the engine options of the loss's ``CUDAGraphedModule``, as for
            :func:`graph_stage_module`, but ``accumulate_grads`` (the loss has no trainable
            parameters).

    Returns:
        A :class:`GraphedLoss`. On CPU tensors it computes eagerly. Its ``undo()`` releases the
        graphs and returns ``loss_fn``, which graphing leaves unchanged.

    Raises:
        TypeError: a keyword that is not an option, or ``accumulate_grads``; ``loss_fn`` is not
            callable, is graphed already, or has trainable parameters
            (the schedules give those no gradient in a zero-bubble input pass, and their weight
            pass covers the stage's parameters only: keep such a loss eager, or move its
            parameters into the stage); ``compile`` is neither a bool nor a dict.
        ValueError: ``compile`` or the user's own ``torch.compile`` of the loss records
            Inductor's CUDA graphs (``mode="reduce-overhead"``), which cannot run inside a
            capture; or a loss compiled already is given ``compile=`` as well.
    """
    owner = f"graph_loss({name or 'loss'})"
    chosen = torch_engine_options(owner, graph_loss, warmup, engine_kwargs, options,
                                  accumulate_grads="a graphed loss has no trainable parameters")
    if not callable(loss_fn):
        raise TypeError(f"graph_loss() needs the loss function, got {loss_fn!r}")
    if isinstance(loss_fn, (CUDAGraphedModule, GraphedLoss)):
        raise TypeError("graph_loss() got a graphed module: the loss is graphed already")
    trainable = [n for n, p in loss_fn.named_parameters() if p.requires_grad] if isinstance(loss_fn, nn.Module) else []
    if trainable:
        raise TypeError(
            f"graph_loss(): the loss {type(loss_fn).__name__} has trainable parameters {trainable[:4]}; a pipeline "
            f"schedule's zero-bubble passes do not give them gradients. Keep this loss eager, or move its "
            f"parameters into the last stage's module")
    if isinstance(loss_fn, nn.Module):
        module = loss_fn
    else:  # CUDAGraphedModule checks the module it gets: the function inside the wrapper is checked here
        options_for(loss_fn, compile, owner)
        module = _Loss(loss_fn)
    return GraphedLoss(CUDAGraphedModule(module, compile=compile, name=name or "loss", options=chosen))
