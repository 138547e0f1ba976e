"""Whole-model graphs for Hugging Face causal LMs: :func:`graph_model`, :func:`ungraph_model`.

:func:`graph_model` graphs everything from the token ids to the loss as one
:class:`~paddle_graphpp.torch.graphed.CUDAGraphedModule` (one forward and one backward launch
per micro-batch), in place: the model keeps its class, names, ``state_dict()`` keys and hooks;
only the instance's ``forward`` is replaced (:func:`ungraph_model` puts it back). The graph runs
the model's own forward for an unpadded causal batch without a cache; its masks are recorded once
per batch shape, outside the graph. Calls it does not cover (``torch.no_grad()``; with one
warning naming the argument, an ``attention_mask``, ``inputs_embeds``, a cache, ...) run the
model's own forward. A model whose forward it cannot reproduce is refused when graphed, naming
what to do. Details: docs/scopes.md and docs/zoo.md.
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Any, Optional

import torch
from torch import nn

from ..core.options import EngineOptions
from . import integrations
from .graphed import CUDAGraphedModule, torch_engine_options
from .hf import CausalLMStage, GraphBody, layout_of
from .layers import check_layer
from .memory.handout import views_keep_values

__all__ = ["graph_model", "ungraph_model", "GraphedCausalLM"]

logger = logging.getLogger("paddle_graphpp")

_SLOT = "_graphpp_whole"
_ABSENT = object()
# Arguments the graphed forward takes, and the values with which it still covers a call.
_NEUTRAL = types.MappingProxyType({
    "attention_mask": None, "position_ids": None, "past_key_values": None, "inputs_embeds": None,
    "cache_position": None, "use_cache": (None, False), "output_attentions": (None, False),
    "output_hidden_states": (None, False), "logits_to_keep": (0,), "token_type_ids": None})
# Arguments handed on to the model's own forward inside the graph (a Python value is part of the
# signature): the Hugging Face Trainer's loss normaliser, and the router outputs of mixtures of
# experts (their load-balancing loss is computed inside the graph from outputs it produces).
_MODEL_KWARGS = ("num_items_in_batch", "output_router_logits")


class _LMBody(GraphBody):
    """What the whole-model graph runs: the model's own forward (its loss included), with the
    masks recorded for the batch, returning the loss attached and every other output detached
    (the backward graph differentiates the loss), or the logits attached without labels."""

    def __init__(self, stage: CausalLMStage, model: nn.Module):
        super().__init__(stage, model)
        self.__dict__["_model"] = model  # its class's forward runs; not a submodule

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor], masks: list, model_kwargs: dict):
        model = self._model
        with self.stage._masks.replaying(masks):
            out = model.__class__.forward(model, input_ids=input_ids, labels=labels, use_cache=False,
                                          return_dict=True, **model_kwargs)
        self.__dict__["output_class"] = type(out)
        kept = "loss" if labels is not None else "logits"
        return {k: (v if k == kept else _detached(v)) for k, v in out.items() if v is not None}


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    return value


class GraphedCausalLM:
    """What :func:`graph_model` keeps on the model (``model._graphpp_whole``).

    Attributes:
        stage: the one-stage :class:`~paddle_graphpp.torch.hf.CausalLMStage` over the model's modules.
        graphed: the :class:`~paddle_graphpp.torch.graphed.CUDAGraphedModule` that runs it.
        original_forward: the model's own forward (bound), taken for calls the graph does not cover.
    """

    def __init__(self, model: nn.Module, stage: CausalLMStage, graphed: CUDAGraphedModule):
        self.stage, self.graphed = stage, graphed
        self.original_forward = model.forward
        # A forward set on the instance before (accelerate's hooks set one): put back by ungraph_model
        self.own_forward = model.__dict__.get("forward", _ABSENT)
        self.name = graphed._engine.name
        self._warned: set = set()
        self._aux_problem: Any = _ABSENT  # why the load-balancing loss cannot be captured, once probed on a GPU

    def __deepcopy__(self, memo):
        raise TypeError(f"{self.name}: a model graphed by graph_model() cannot be copied (its graphs read the "
                        f"original's memory); copy the model before graph_model(), or call ungraph_model() first")

    def forward(self, *args, **kwargs):
        why = self._not_covered(args, kwargs)
        if why is not None:
            if why != "no grad" and why not in self._warned:
                self._warned.add(why)
                logger.warning("%s: %s; this call runs the model's own forward (no whole-model graph)", self.name, why)
            return self.original_forward(*args, **kwargs)
        self.graphed.module.refuse_checkpointing("graph_model()")  # turned on after graphing
        input_ids = args[0] if args else kwargs.pop("input_ids")
        labels, return_dict = kwargs.pop("labels", None), kwargs.pop("return_dict", None)
        model_kwargs = {k: kwargs[k] for k in _MODEL_KWARGS if kwargs.get(k) is not None}
        masks = self.stage.masks(input_ids)
        out = self.graphed.run((input_ids, labels, masks, model_kwargs), {})
        if out.get("loss") is not None and not views_keep_values():
            # A torch that cannot re-point a storage keeps only the handed-out loss itself; a
            # loop logs loss.detach(), which would then raise when read after the next launch.
            # One scalar copy keeps what the caller holds its own.
            out["loss"] = out["loss"].clone()
        output = self.graphed.module.output_class(**out)
        if return_dict is None:
            return_dict = getattr(self.stage.config, "use_return_dict", True)
        return output if return_dict is not False else output.to_tuple()

    def _aux_loss_problem(self) -> Optional[str]:
        """Why the model's load-balancing loss cannot be captured (``None``: it can), probed once
        on the GPU: a model graphed on the CPU and moved later (as trainers do) is probed at its
        first call with router logits on the GPU."""
        if self._aux_problem is not _ABSENT:
            return self._aux_problem
        model = self.graphed.module._model
        why = integrations.aux_loss_capture_problem(model)
        weight = next(model.parameters(), None)
        if why is not None or (weight is not None and weight.is_cuda):  # else asked again: not on a GPU yet
            self._aux_problem = why
        return why

    def _not_covered(self, args: tuple, kwargs: dict) -> Optional[str]:
        if not torch.is_grad_enabled():
            return "no grad"
        if len(args) > 1:
            return "arguments after input_ids are passed by position (pass them by name)"
        input_ids = args[0] if args else kwargs.get("input_ids")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            return "input_ids is not a (batch, sequence) tensor"
        router_logits = kwargs.get("output_router_logits")
        if router_logits is None:
            router_logits = getattr(self.stage.config.get_text_config(), "output_router_logits", False)
        if router_logits:
            why = self._aux_loss_problem()
            if why is not None:
                return f"output_router_logits=True, and the load-balancing loss cannot be captured ({why})"
        for arg, value in kwargs.items():
            if arg in _MODEL_KWARGS or arg in ("input_ids", "labels", "return_dict"):
                continue
            if arg not in _NEUTRAL:
                return f"the argument {arg!r} is not one the whole-model graph takes"
            neutral = _NEUTRAL[arg]
            if (value is not None) if neutral is None else (value not in neutral):
                return (f"{arg}={_short(value)} is given; the whole-model graph covers unpadded causal batches "
                        f"without a cache (pass no {arg} to graph the call)")
        return None


def graph_model(model: nn.Module, *warmup: int, compile: Any = None, options: Optional[EngineOptions] = None,
                **engine_kwargs: Any) -> nn.Module:
    """Graph a Hugging Face causal LM whole, from the token ids to the loss, in place.

    Args:
        model: a ``transformers`` causal LM (a base model under its ``base_model_prefix``
            with one list of decoder blocks), with its blocks not graphed and gradient
            checkpointing off.
        compile: as for :class:`~paddle_graphpp.torch.graphed.CUDAGraphedModule` (``True``:
            Inductor kernels inside the graph).
        options, **engine_kwargs: the engine options of the whole-model ``CUDAGraphedModule``
            (an :class:`paddle_graphpp.EngineOptions`, or its fields by keyword,
            ``num_warmup_steps`` also positionally after the model); ``num_warmup_steps`` must
            be at least 1 here (the masks of each batch shape are recorded in an eager call).

    Returns:
        ``model``, whose ``forward`` now runs the graph for the calls it covers;
        :func:`ungraph_model` on it undoes this: the model's own ``forward`` again, the graphs released.

    Raises:
        TypeError: the model has no base model with one list of blocks, is graphed already (by
            this function or by ``graph_layers()`` on its blocks: a graph inside a graph), or a
            keyword is not an engine option.
        ValueError: a block has gradient checkpointing on, ``num_warmup_steps`` is not an int >= 1,
            or, on a GPU, the config asks for router logits (``output_router_logits``) and the
            load-balancing loss the model adds then reads the host (``torch.bincount`` in
            transformers 5.16 to 5.22).

    Warnings:
        * Each micro-batch shape is a signature of its own, captured anew (``max_signatures``
          of ``CUDAGraphedModule``).
        * The calls the graph does not cover run the model's own forward (see the module
          docstring); a warning names each kind once.
        * The logits come back detached when ``labels`` is given. They are the graph's output
          buffer: the engine watches its memory, and before a later replay overwrites it, what
          still uses it keeps its values (torch with ``UntypedStorage._swap_data_ptr_``) or, on
          older torch, the tensor itself keeps them and a view or ``.detach()`` of it raises
          when read (clone what you keep there). The loss is a copy on older torch.
    """
    chosen = torch_engine_options("graph_model()", graph_model, warmup, engine_kwargs, options)
    if _SLOT in model.__dict__:
        raise TypeError(f"graph_model(): {type(model).__name__} is graphed already; call ungraph_model() first")
    if not isinstance(chosen.num_warmup_steps, int) or chosen.num_warmup_steps < 1:
        raise ValueError(f"graph_model(): num_warmup_steps must be an int >= 1 (the block arguments are built in an "
                         f"eager call), got {chosen.num_warmup_steps!r}")
    layout = layout_of(model)
    blocks = getattr(getattr(model, layout.base), layout.layers)
    for i, block in enumerate(blocks):
        check_layer(f"{layout.base}.{layout.layers}.{i}", block, check_config=False)
        integrations.refuse_in_whole_graph(f"{layout.base}.{layout.layers}.{i}", block, "graph_model()")
    if getattr(model.config.get_text_config(), "output_router_logits", False):
        why = integrations.aux_loss_capture_problem(model)
        if why is not None:
            raise ValueError(
                f"graph_model(): {type(model).__name__} has output_router_logits=True in its config, and the "
                f"load-balancing loss its forward then adds cannot be captured: {why}. Set "
                f"model.config.output_router_logits = False, or graph the blocks with graph_layers() after "
                f"model.set_experts_implementation('eager') (the routers are graphed on their own, the loss is "
                f"computed outside the graphs), or use a transformers whose loss reads nothing on the host "
                f"(5.15 and earlier, or 5.23 and later).")
    stage = CausalLMStage(model, layout, 0, 1, range(len(blocks)), 0)
    graphed = CUDAGraphedModule(_LMBody(stage, model), compile=compile, options=chosen,
                                name=f"graph_model({type(model).__name__})")
    whole = GraphedCausalLM(model, stage, graphed)

    def forward(self, *args, **kwargs):
        return self.__dict__[_SLOT].forward(*args, **kwargs)

    functools.update_wrapper(forward, type(model).forward)  # its signature: trainers read the columns it takes
    model.__dict__[_SLOT] = whole
    model.forward = types.MethodType(forward, model)  # on the instance: found before the class's
    return model


def ungraph_model(model: nn.Module) -> nn.Module:
    """Undo :func:`graph_model`: the model's own forward again (the one set on the instance before
    graphing, if any), its graphs released.

    Returns:
        ``model``.

    Raises:
        TypeError: ``model`` is not graphed by :func:`graph_model` (or was undone already).
        GraphScheduleError: a micro-batch's backward has not run yet (undo between steps); nothing
            changes then.
    """
    whole = model.__dict__.get(_SLOT)
    if whole is None:
        raise TypeError(f"ungraph_model(): {type(model).__name__} is not graphed by graph_model() (or was ungraphed "
                        f"already); nothing to undo")
    whole.graphed.engine.retire("call the model (ungraph_model() gave it its own forward back)")
    del model.__dict__[_SLOT]
    if whole.own_forward is _ABSENT:
        model.__dict__.pop("forward", None)
    else:
        model.__dict__["forward"] = whole.own_forward
    return model


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return repr(value)[:40]
