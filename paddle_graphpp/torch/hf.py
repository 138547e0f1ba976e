"""Hugging Face causal LMs cut into pipeline stages for ``torch.distributed.pipelining``.

A ``transformers`` causal LM is not an ``nn.Sequential``: its forward builds the attention mask,
position ids and (Llama) rotary embeddings before the blocks, and the head comes after the
final norm. :func:`causal_lm_stage` cuts such a model into the stage of one pipeline rank: the
first stage takes token ids through the embeddings and its blocks, middle stages take hidden
states through their blocks, the last adds the final norm and the head and returns logits.
Each stage rebuilds the mask and position inputs itself, calls its blocks the way the model
calls them (``use_cache=False``), and graphs them in place with
:func:`~paddle_graphpp.torch.layers.graph_layers`' machinery::

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from paddle_graphpp.torch.hf import causal_lm_stage

    model = LlamaForCausalLM(config)                 # the same seed on every rank, or load weights
    stage_mod = causal_lm_stage(model, rank, world).to(device)
    x, y = stage_mod.example_io(micro_batch_size, seq_len)
    stage = PipelineStage(stage_mod, rank, world, device, input_args=(x,), output_args=(y,))
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)   # loss_fn(logits, targets)

Two layouts are known: Llama's (``model.model.embed_tokens / layers / norm / rotary_emb``,
``model.lm_head``; Mistral-style models share it) and GPT-2's (``model.transformer.wte / wpe
/ drop / h / ln_f``, ``model.lm_head``). Supported: ``transformers`` 5.0 to 5.24 (see
:data:`paddle_graphpp.support.SUPPORTED`); the causal mask is built through the installed
version's ``create_causal_mask``, whose known signatures are listed in ``_MASK_FORMS``.

The stage holds the model's own modules under the model's own attribute names (the blocks in an
``nn.ModuleDict`` keyed by their index in the model), so ``stage.state_dict()`` keys are the
full model's keys for the parts this stage holds, with the same tensors.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..core.options import EngineOptions
from ..core.warn import warn
from .graphed import CUDAGraphedModule, torch_engine_options
from .integrations import transformers as _transformers
from .layers import check_layer, graph_in_place

__all__ = ["causal_lm_stage", "CausalLMStage"]

_KWARGS_KEPT = 8  # block-argument sets (one per batch shape, dtype, device) past which a stage warns
_SCOPES = ("blocks", "stage")


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a model family keeps its parts (attribute names)."""

    family: str
    base: str  # the base model on the causal LM
    embed: str
    layers: str
    norm: str
    position_embed: Optional[str] = None  # learned absolute positions (GPT-2)
    dropout: Optional[str] = None  # dropout after the embeddings (GPT-2)
    rotary: Optional[str] = None  # rotary embeddings shared by all blocks (Llama)


_LAYOUTS = (
    _Layout("llama", base="model", embed="embed_tokens", layers="layers", norm="norm", rotary="rotary_emb"),
    _Layout("gpt2", base="transformer", embed="wte", layers="h", norm="ln_f", position_embed="wpe", dropout="drop"),
)


def layout_of(model: nn.Module) -> _Layout:
    """The known layout ``model`` has (Llama's or GPT-2's); ``TypeError`` naming both otherwise."""
    for layout in _LAYOUTS:
        base = getattr(model, layout.base, None)
        wanted = [layout.embed, layout.layers, layout.norm, layout.position_embed, layout.rotary]
        if isinstance(base, nn.Module) and isinstance(getattr(model, "lm_head", None), nn.Module) and all(
                isinstance(getattr(base, a, None), nn.Module) for a in wanted if a is not None):
            return layout
    raise TypeError(
        f"causal_lm_stage() knows the Llama layout (model.model.embed_tokens/layers/norm/rotary_emb, model.lm_head) "
        f"and GPT-2's (model.transformer.wte/wpe/drop/h/ln_f, model.lm_head); {type(model).__name__} has neither. "
        f"For another model, build each stage as your own module and call graph_layers() on its blocks.")


def _split(num_layers: int, num_stages: int, layers_per_stage: Optional[Sequence[int]]) -> list:
    if layers_per_stage is None:
        if num_layers < num_stages:
            raise ValueError(f"causal_lm_stage(): {num_layers} blocks cannot fill {num_stages} stages")
        base, extra = divmod(num_layers, num_stages)
        layers_per_stage = [base + (1 if s < extra else 0) for s in range(num_stages)]
    counts = list(layers_per_stage)
    if len(counts) != num_stages or any(not isinstance(c, int) or c < 0 for c in counts) or sum(counts) != num_layers:
        raise ValueError(f"causal_lm_stage(): layers_per_stage={counts} must give {num_stages} counts >= 0 that add "
                         f"up to the model's {num_layers} blocks")
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [list(range(start, start + count)) for start, count in zip(starts, counts)]


def _parameter_names(fn) -> frozenset:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


# transformers.masking_utils.create_causal_mask has changed its required arguments twice within
# the supported range. Each known form, by its required parameters after ``config``; the stage
# passes exactly those, so a form not listed here is refused
# when the stage is built instead of losing an argument at the first forward.
_MASK_FORMS = {
    ("input_embeds", "attention_mask", "cache_position", "past_key_values"): "transformers 5.0-5.1",
    ("inputs_embeds", "attention_mask", "cache_position", "past_key_values"): "transformers 5.2-5.3",
    ("inputs_embeds", "attention_mask", "past_key_values"): "transformers 5.4-5.23",
    ("inputs_embeds", "attention_mask", "cache"): "transformers 5.24",
}


def _mask_builder():
    """``build(config, hidden, cache_position)``: the causal mask (or ``None`` where the attention
    kernel masks causally itself) for an unpadded batch without a cache, through the installed
    transformers' ``create_causal_mask``. Position ids are not passed: given them, transformers
    looks for packed sequences, which reads a device value on the host (5.17) and, traced, builds
    a full mask; an unpadded batch holds one sequence per row."""
    import transformers

    from ..support import SUPPORTED, require

    version = require("transformers", transformers.__version__)
    try:
        from transformers.masking_utils import create_causal_mask
    except ImportError as exc:
        raise ImportError(f"causal_lm_stage() needs transformers.masking_utils, which transformers {version} "
                          f"lacks: {exc}") from exc
    params = list(inspect.signature(create_causal_mask).parameters.values())
    required = tuple(p.name for p in params[1:] if p.default is inspect.Parameter.empty
                     and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    if required not in _MASK_FORMS:
        support = SUPPORTED["transformers"]
        raise TypeError(
            f"causal_lm_stage(): transformers {version} has a create_causal_mask(config, {', '.join(required)}) "
            f"this version of paddle_graphpp does not know (known: transformers {support.oldest} to "
            f"{support.newest_tested}). Install a transformers in that range, e.g. "
            f"`pip install 'transformers<={support.newest_tested}'`, or build the stage yourself and call "
            f"graph_layers() on its blocks.")

    def build(config, hidden, cache_position):
        known = {"input_embeds": hidden, "inputs_embeds": hidden, "attention_mask": None,
                 "cache_position": cache_position, "past_key_values": None, "cache": None}
        return create_causal_mask(config, **{name: known[name] for name in required})

    return build


class _Part(nn.Module):
    """Holds a stage's share of the base model under the base model's attribute names."""


class CausalLMStage(nn.Module):
    """One pipeline stage of a Hugging Face causal LM; made by :func:`causal_lm_stage`.

    ``forward(x)``: on the first stage ``x`` is token ids ``(batch, seq)``, elsewhere the hidden
    state ``(batch, seq, hidden)``; the last stage returns logits ``(batch, seq, vocab)``, the
    others the hidden state. Sequences are taken as unpadded (a causal mask, positions
    ``0..seq-1``), as pipeline training on packed sequences feeds them.

    Attributes:
        stage_index, num_stages: this stage's place in the pipeline.
        layer_indices: the model's blocks this stage holds, by index.
        blocks: those blocks, in order (graphed in place unless built with ``graph=False``).
        config: the model's config.
    """

    def __init__(self, model: nn.Module, layout: _Layout, stage_index: int, num_stages: int,
                 layer_indices: Sequence[int]):
        super().__init__()
        base = getattr(model, layout.base)
        blocks = getattr(base, layout.layers)
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.layer_indices = list(layer_indices)
        self.__dict__["config"] = model.config
        self.__dict__["_layout"] = layout
        part = _Part()
        for attr in [layout.embed, layout.position_embed, layout.dropout] if self.is_first else []:
            if attr is not None:
                setattr(part, attr, getattr(base, attr))
        setattr(part, layout.layers, nn.ModuleDict({str(i): blocks[i] for i in self.layer_indices}))
        for attr in [layout.rotary] + ([layout.norm] if self.is_last else []):
            if attr is not None:
                setattr(part, attr, getattr(base, attr))
        setattr(self, layout.base, part)
        if self.is_last:
            self.lm_head = model.lm_head
        block_cls = type(blocks[0]) if len(blocks) else None
        original = getattr(block_cls, "_graphpp_original", block_cls)
        self.__dict__["_block_params"] = _parameter_names(original.forward) if original is not None else frozenset()
        self.__dict__["_causal_mask"] = _mask_builder()
        self.__dict__["_kwargs_kept"] = {}

    @property
    def blocks(self) -> list:
        return list(getattr(self._part, self._layout.layers).values())

    @property
    def _part(self) -> nn.Module:
        return getattr(self, self._layout.base)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kwargs = self.block_kwargs(x)
        whole = self.__dict__.get("_whole")
        if whole is not None:  # scope="stage": the whole stage is one graphed call
            whole.module.refuse_checkpointing("causal_lm_stage(scope='stage')")  # turned on after graphing
            return whole.run((x, kwargs), {})
        return self.body(x, kwargs)

    def body(self, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """The stage's computation, given the arguments its blocks take (:meth:`block_kwargs`)."""
        layout, part = self._layout, self._part
        if self.is_first:
            hidden = getattr(part, layout.embed)(x)
            if layout.position_embed is not None:
                positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
                hidden = hidden + getattr(part, layout.position_embed)(positions)
            if layout.dropout is not None:
                hidden = getattr(part, layout.dropout)(hidden)
        else:
            hidden = x
        for block in getattr(part, layout.layers).values():
            hidden = block(hidden, **kwargs)
            if isinstance(hidden, tuple):  # blocks of transformers 4.x return (hidden, ...)
                hidden = hidden[0]
        if not self.is_last:
            return hidden
        return self.lm_head(getattr(part, layout.norm)(hidden))

    def block_kwargs(self, x: torch.Tensor) -> dict:
        """What the model's own forward passes its blocks for an unpadded causal batch of ``x``'s
        batch size and length: the mask (``None`` where the attention kernel masks causally
        itself), positions and (Llama) rotary embeddings.

        They depend only on the batch's shape, dtype and device, so they are built once per such
        key (and attention kernel), eagerly, and kept for good (graphs read them where they are; a
        warning past :data:`_KWARGS_KEPT` keys). Built inside a capture, the
        installed transformers would take its traced path (a full mask, slower attention), so a
        key first seen inside a capture is refused; the warmup calls build every key first.
        """
        dtype = self._hidden_dtype(x)
        config = self.config  # the attention kernel decides whether a mask is materialised
        key = (tuple(x.shape[:2]), dtype, x.device, torch.is_autocast_enabled(x.device.type),
               getattr(config, "_attn_implementation", None), getattr(config, "sliding_window", None))
        kwargs = self._kwargs_kept.get(key)
        if kwargs is not None:
            return kwargs
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            from ..core.errors import CaptureError

            raise CaptureError(
                f"CausalLMStage {self.stage_index}: the block arguments (mask, positions) for a batch of shape "
                f"{list(x.shape[:2])} are first needed inside a capture, where transformers would build them on "
                f"its traced path (a full mask, no causal attention kernel). Run this shape eagerly once first "
                f"(num_warmup_steps >= 1).")
        with torch.no_grad():
            kwargs = self._build_block_kwargs(torch.empty(*x.shape[:2], 1, dtype=dtype, device=x.device))
        # Never dropped: a whole-step graph reads these tensors where they are.
        if len(self._kwargs_kept) == _KWARGS_KEPT:
            warn(f"CausalLMStage {self.stage_index}: block arguments for {_KWARGS_KEPT + 1} batch shapes "
                          f"are kept now (one set per shape, never dropped); pad batches to a few fixed shapes")
        self._kwargs_kept[key] = kwargs
        return kwargs

    def _hidden_dtype(self, x: torch.Tensor) -> torch.dtype:
        if not self.is_first:
            return x.dtype
        return getattr(getattr(self._part, self._layout.embed), "weight").dtype

    def _build_block_kwargs(self, hidden: torch.Tensor) -> dict:
        cache_position = torch.arange(hidden.shape[1], device=hidden.device)
        position_ids = cache_position.unsqueeze(0)
        mask = self._causal_mask(self.config, hidden, cache_position)
        kwargs: dict[str, Any] = dict(attention_mask=mask, position_ids=position_ids, use_cache=False)
        if "cache_position" in self._block_params:  # transformers < 5.17 blocks take it
            kwargs["cache_position"] = cache_position
        if self._layout.rotary is not None:
            kwargs["position_embeddings"] = getattr(self._part, self._layout.rotary)(hidden, position_ids)
        return kwargs

    def example_io(self, micro_batch_size: int, seq_len: int) -> tuple:
        """Example ``(input, output)`` tensors of one micro-batch, for ``PipelineStage``'s
        ``input_args``/``output_args``, on the stage's device and in its dtype. Hidden-state
        inputs require grad (the stage sends their gradient back), as do outputs."""
        param = next(self.parameters())
        hidden = self.config.hidden_size
        if self.is_first:
            x = torch.zeros(micro_batch_size, seq_len, dtype=torch.long, device=param.device)
        else:
            x = torch.zeros(micro_batch_size, seq_len, hidden, dtype=param.dtype, device=param.device,
                            requires_grad=True)
        width = self.lm_head.out_features if self.is_last else hidden
        y = torch.zeros(micro_batch_size, seq_len, width, dtype=param.dtype, device=param.device, requires_grad=True)
        return x, y

    def extra_repr(self) -> str:
        return (f"family={self._layout.family}, stage={self.stage_index}/{self.num_stages}, "
                f"blocks={self.layer_indices}")


def causal_lm_stage(
    model: nn.Module,
    stage_index: int,
    num_stages: int,
    *warmup: int,
    layers_per_stage: Optional[Sequence[int]] = None,
    graph: bool = True,
    compile: Any = None,
    scope: str = "blocks",
    options: Optional[EngineOptions] = None,
    **engine_kwargs: Any,
) -> CausalLMStage:
    """Cut a Hugging Face causal LM into pipeline stage ``stage_index`` of ``num_stages``.

    The first stage holds the embeddings, the last the final norm and ``lm_head``; the blocks
    are split evenly (earlier stages take one more when they do not divide) unless
    ``layers_per_stage`` says otherwise. The stage shares the model's modules (no copies):
    move it with ``.to(device)`` and build the optimizer on ``stage.parameters()``. Its blocks
    are graphed in place (see :func:`~paddle_graphpp.torch.layers.graph_layers`), which also
    changes them in ``model``.

    Args:
        model: a ``transformers`` causal LM with the Llama or GPT-2 layout (see the module
            docstring), built the same way on every rank.
        stage_index, num_stages: which stage to build, of how many.
        layers_per_stage: blocks per stage, ``num_stages`` counts adding up to the model's.
        graph: ``False`` builds the same stage with eager blocks (a reference run).
        compile: see :func:`~paddle_graphpp.torch.layers.graph_layers`.
        options, **engine_kwargs: the engine options of each block's ``CUDAGraphedModule`` (an
            :class:`paddle_graphpp.EngineOptions`, or its fields by keyword, ``num_warmup_steps``
            also positionally after ``num_stages``).
        scope: ``"blocks"`` (default) graphs each block in place; ``"stage"`` graphs the whole
            stage as one :class:`~paddle_graphpp.torch.graphed.CUDAGraphedModule`, embeddings,
            final norm and head included: one forward and one backward launch per micro-batch.
            The blocks stay plain modules then. The mask, positions and rotary tables are built
            once per batch shape outside the graph (:meth:`CausalLMStage.block_kwargs`), so
            attention keeps its causal kernel and nothing in the graph reads the device.

    Returns:
        A :class:`CausalLMStage`; ``example_io(micro_batch_size, seq_len)`` gives the example
        tensors ``PipelineStage`` wants.

    Raises:
        TypeError: the model has neither known layout, or the installed transformers has a
            ``create_causal_mask`` signature this version does not know; a keyword that is not
            an option (the message lists the valid names).
        UnsupportedVersionError: transformers is older than the supported range (5.0).
        ValueError: a bad ``stage_index`` or split; embeddings tied to the head across stages
            (the message says to build the model with ``tie_word_embeddings=False``); a block
            already graphed or with gradient checkpointing on.

    Warning:
        With more than one stage, the input embedding and ``lm_head`` live on different ranks,
        so a model that ties them (GPT-2's default) is refused: nothing here would reduce the
        tied weight's gradients across ranks. Build it with ``tie_word_embeddings=False``.
    """
    chosen = torch_engine_options("causal_lm_stage()", causal_lm_stage, warmup, engine_kwargs, options)
    layout = layout_of(model)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"causal_lm_stage(): num_stages must be an int >= 1, got {num_stages!r}")
    if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
        raise ValueError(f"causal_lm_stage(): stage_index must be in [0, {num_stages}), got {stage_index!r}")
    base = getattr(model, layout.base)
    embed_weight = getattr(getattr(base, layout.embed), "weight", None)
    if num_stages > 1 and embed_weight is not None and getattr(model.lm_head, "weight", None) is embed_weight:
        raise ValueError(
            f"causal_lm_stage(): {type(model).__name__} ties its input embedding to lm_head, which would sit on "
            f"stages 0 and {num_stages - 1} with nothing to reduce the shared weight's gradients. Build the model "
            f"with tie_word_embeddings=False in its config.")
    if scope not in _SCOPES:
        raise ValueError(f"causal_lm_stage(): scope must be one of {_SCOPES}, got {scope!r}")
    blocks = getattr(base, layout.layers)
    indices = _split(len(blocks), num_stages, layers_per_stage)[stage_index]
    stage = CausalLMStage(model, layout, stage_index, num_stages, indices)
    if graph and scope == "stage":
        for i in indices:  # a graph inside a graph, or a recomputation inside one, is refused
            check_layer(f"{layout.base}.{layout.layers}.{i}", blocks[i], check_config=False)
            _transformers.refuse_checkpointing(f"{layout.base}.{layout.layers}.{i}", blocks[i],
                                               "causal_lm_stage(scope='stage')")
        stage.__dict__["_whole"] = CUDAGraphedModule(_StageBody(stage), compile=compile, options=chosen,
                                                     name=f"causal_lm_stage({stage_index}/{num_stages})")
    elif graph and indices:
        prefix = f"{layout.base}.{layout.layers}"
        graph_in_place([(str(i), blocks[i]) for i in indices], [f"{prefix}.{i}" for i in indices],
                       check_config=False, compile=compile, options=chosen)
    return stage


class GraphBody(nn.Module):
    """A module a whole-stage or whole-model graph runs, over modules it does not own.

    Its one submodule is the stage, so its parameters and the state a replay checks are the
    stage's; it is held outside the stage's and the model's submodules (their ``__dict__``), so
    their names and ``state_dict()`` keys stay the model's. Its train/eval mode (which keys the
    engine's signatures) is that of ``mode_of``: ``model.train()`` and ``model.eval()`` reach it.
    """

    def __init__(self, stage: CausalLMStage, mode_of: nn.Module):
        super().__init__()
        self.stage = stage
        self.__dict__["_mode_of"] = mode_of

    @property
    def training(self) -> bool:  # type: ignore[override]
        owner = self.__dict__.get("_mode_of")
        return owner.training if owner is not None else True

    @training.setter
    def training(self, value: bool) -> None:
        pass  # follows mode_of

    def refuse_checkpointing(self, door: str) -> None:
        """Refuse a training call while a block has gradient checkpointing on (turned on after
        graphing): the one graph does not recompute (see integrations.transformers.refuse_checkpointing)."""
        if self.training and torch.is_grad_enabled():
            stage = self.stage
            for i, block in zip(stage.layer_indices, stage.blocks):
                _transformers.refuse_checkpointing(f"{stage._layout.base}.{stage._layout.layers}.{i}", block, door)


class _StageBody(GraphBody):
    """What a whole-stage graph runs: :meth:`CausalLMStage.body`, given the block arguments."""

    def __init__(self, stage: CausalLMStage):
        super().__init__(stage, stage)

    def forward(self, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        return self.stage.body(x, kwargs)

