"""Hugging Face causal LMs cut into pipeline stages for ``torch.distributed.pipelining``.

:func:`causal_lm_stage` cuts a ``transformers`` causal LM into the stage of one pipeline rank:
the first stage takes token ids, the others the hidden state entering their first block; the
last returns logits. A stage computes with the model's own code: it runs the model's own
forward (the base model's, or the causal LM's on the last stage, so embedding scales, masks per
layer type, rotary tables per layer type, the final norm and the head's transforms such as
logit softcapping are the model's), with the block list seen through stand-ins for the blocks
other stages hold: the block before the stage hands on the stage's input, the block after it
ends the call with the hidden state that reaches it. The masks are the model's own, built once
per batch shape outside any graph (:func:`paddle_graphpp.torch.integrations.outside_calls`).
When the stages are built, their chain is checked against the model's own forward on a short
batch; a model they do not reproduce exactly is refused then, with the reason::

    model = AutoModelForCausalLM.from_config(config)   # the same seed on every rank, or load weights
    stage_mod = causal_lm_stage(model, rank, world).to(device)
    x, y = stage_mod.example_io(micro_batch_size, seq_len)
    stage = PipelineStage(stage_mod, rank, world, device, input_args=(x,), output_args=(y,))

The stage holds the model's own modules under the model's own attribute names (the blocks in an
``nn.ModuleDict`` keyed by their index), so ``stage.state_dict()`` keys are the full model's
keys for the parts this stage holds, with the same tensors. Supported: ``transformers`` 5.0 on
(:data:`paddle_graphpp.support.SUPPORTED`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..core.options import EngineOptions
from ..core.warn import warn
from . import integrations
from .graphed import CUDAGraphedModule, torch_engine_options
from .layers import check_layer, graph_in_place, ungraph_layers

__all__ = ["causal_lm_stage", "CausalLMStage"]

_MASKS_KEPT = 8  # mask sets (one per batch shape, dtype, device) past which a stage warns
_SCOPES = ("blocks", "stage")
_PROBE_TOKENS = 8  # the length of the batch the stages' chain is checked on when they are built
_RECORDED = ("output_attentions", "output_hidden_states", "output_router_logits")  # outputs hooks record


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a causal LM keeps its parts (attribute names), read from its module tree."""

    base: str  # the base model on the causal LM (its ``base_model_prefix``)
    layers: str  # the list of decoder blocks on the base model
    first: tuple  # base children with parameters or dropout registered before the blocks: the first stage's
    last: tuple  # base children with parameters or dropout registered after the blocks: the last stage's
    shared: tuple  # other base children (rotary tables): every stage's
    head: tuple  # causal-LM children besides the base (``lm_head``): the last stage's

    @property
    def family(self) -> str:
        return f"{self.base}.{self.layers}"


def _staged(module: nn.Module) -> bool:
    """Whether a base child belongs to one end of the model (weights, or random draws that a
    later stage must not repeat) rather than to every stage (a rotary table)."""
    return isinstance(module, nn.Dropout) or next(module.parameters(), None) is not None


def layout_of(model: nn.Module) -> _Layout:
    """The layout of ``model``: a base model under its ``base_model_prefix`` holding one list of
    ``config.num_hidden_layers`` decoder blocks; ``TypeError`` naming what is missing otherwise."""
    name = type(model).__name__
    prefix = getattr(model, "base_model_prefix", None)
    base = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    if not isinstance(base, nn.Module) or base is model:
        raise TypeError(f"{name} is not a transformers causal LM with a base model under its base_model_prefix "
                        f"({prefix!r}); build each stage as your own module and call graph_layers() on its blocks.")
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    count = getattr(text, "num_hidden_layers", None)
    lists = [n for n, m in base.named_children() if isinstance(m, nn.ModuleList) and len(m) == count and count]
    if len(lists) != 1:
        raise TypeError(f"{name}: its base model {type(base).__name__} holds {len(lists)} lists of "
                        f"num_hidden_layers={count} blocks ({lists}), where the stage cut needs exactly one. Build each "
                        f"stage as your own module and call graph_layers() on its blocks.")
    layers = lists[0]
    children = list(base.named_children())
    at = [n for n, _ in children].index(layers)
    first = tuple(n for n, m in children[:at] if _staged(m))
    last = tuple(n for n, m in children[at + 1:] if _staged(m))
    shared = tuple(n for n, m in children if n != layers and not _staged(m))
    head = tuple(n for n, m in model.named_children() if n != prefix)
    return _Layout(prefix, layers, first, last, shared, head)


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


# ----------------------------------------------------------------------------- stand-ins
class _StageEnd(Exception):
    """Raised by the stand-in after a stage's last block: ``args[0]`` is the hidden state reaching it."""


class _StandIn(nn.Module):
    """Takes a block's place in the model's block list during a stage's call; attributes the
    model's forward reads from its blocks (``attention_type``) are the block's. ``role``: ``"pass"``
    hands its hidden input on (a block before the stage), ``"enter"`` runs the block on the
    stage's input instead (the stage's first block), ``"inject"`` hands the stage's input on (a
    stage without blocks), ``"end"`` ends the stage's call with the hidden input."""

    def __init__(self, block: nn.Module, role: str, stage_input: Optional[list] = None):
        super().__init__()
        self.__dict__.update(_block=block, _role=role, _input=stage_input)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_block"], name)

    def forward(self, hidden, *args, **kwargs):
        role = self._role
        if role == "end":
            raise _StageEnd(hidden)
        if role == "enter":
            return self._block(self._input[0], *args, **kwargs)
        out = self._input[0] if role == "inject" else hidden
        return (out,) if _returns_tuple(self._block) else out


def _returns_tuple(block: nn.Module) -> bool:
    """Whether a block returns ``(hidden, ...)`` (transformers before 5.x for some models, by its
    forward's annotation); the stage check at build covers a wrong guess."""
    forward = getattr(type(block), "_graphpp_original", type(block)).forward
    annotation = getattr(forward, "__annotations__", {}).get("return")
    return str(annotation).lower().startswith(("tuple", "typing.tuple"))


class _Absent(nn.Module):
    """Takes the place of a module another stage holds (a position embedding before the blocks)
    whose result is dead in this stage's call (the stage's input replaces what it feeds): zeros
    of its result's shape and dtype, found on the meta device."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.__dict__["_module"] = module

    def forward(self, *args, **kwargs):
        module = self.__dict__["_module"]
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
        meta = {n: torch.empty_like(t, device="meta") for n, t in (*module.named_parameters(), *module.named_buffers())}

        def to_meta(x):
            return x.to("meta") if isinstance(x, torch.Tensor) else x

        out = torch.func.functional_call(module, meta, tuple(map(to_meta, args)),
                                         {k: to_meta(v) for k, v in kwargs.items()})
        if isinstance(out, torch.Tensor):
            return torch.zeros(out.shape, dtype=out.dtype, device=device)
        raise TypeError(f"{type(module).__name__} returns {type(out).__name__}; the stage cut stands in for tensors only")


class _Part(nn.Module):
    """Holds a stage's share of the base model under the base model's attribute names."""


class CausalLMStage(nn.Module):
    """One pipeline stage of a Hugging Face causal LM; made by :func:`causal_lm_stage`.

    ``forward(x)``: on the first stage ``x`` is token ids ``(batch, seq)``, elsewhere the hidden
    state ``(batch, seq, hidden)``; the last stage returns logits ``(batch, seq, vocab)``, the
    others the hidden state. Sequences are taken as unpadded (the model's causal masks for
    positions ``0..seq-1``), as pipeline training on packed sequences feeds them.

    Attributes:
        stage_index, num_stages: this stage's place in the pipeline.
        layer_indices: the model's blocks this stage holds, by index.
        blocks: those blocks, in order (graphed in place unless built with ``graph=False``).
        config: the model's config.
    """

    def __init__(self, model: nn.Module, layout: _Layout, stage_index: int, num_stages: int,
                 layer_indices: Sequence[int], start: int):
        super().__init__()
        base = getattr(model, layout.base)
        blocks = getattr(base, layout.layers)
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.layer_indices = list(layer_indices)
        self.__dict__["_start"] = start  # the index of the model's block this stage's input enters
        self.__dict__["config"] = model.config
        self.__dict__["_layout"] = layout
        self.__dict__["_model"] = model  # the whole model, whose forward the stage runs; not a submodule
        part = _Part()
        held = set(layout.shared) | (set(layout.first) if self.is_first else set()) | (
            set(layout.last) if self.is_last else set())
        for attr, module in base.named_children():
            if attr in held:
                setattr(part, attr, module)
        setattr(part, layout.layers, nn.ModuleDict({str(i): blocks[i] for i in self.layer_indices}))
        setattr(self, layout.base, part)
        if self.is_last:
            for attr in layout.head:
                setattr(self, attr, getattr(model, attr))
        absent = [a for a in layout.first if a not in held]
        self.__dict__["_absent"] = {a: nn.Identity() if isinstance(getattr(base, a), nn.Dropout)
                                    else _Absent(getattr(base, a)) for a in absent}
        # A stage before the last that ends after the model's last block ends where the model's
        # forward reaches what comes after its blocks (the final norm).
        self.__dict__["_ends_at_last"] = {} if self.is_last else {
            a: _StandIn(getattr(base, a), "end") for a in layout.last}
        self.__dict__["_masks"] = integrations.outside_calls(f"CausalLMStage {stage_index}", model, base)
        self.__dict__["_stage_input"] = [None]  # what the stand-ins hand on, during a call
        self.__dict__["_cut"] = self._cut_before(start + len(self.layer_indices))
        self.__dict__["_masks_kept"] = {}
        self.__dict__["_graphed"] = None  # set by causal_lm_stage: "blocks", "stage" (its scope), or None

    @property
    def blocks(self) -> list:
        return list(getattr(self._part, self._layout.layers).values())

    @property
    def _part(self) -> nn.Module:
        return getattr(self, self._layout.base)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        masks = self.masks(x)
        whole = self.__dict__.get("_whole")
        if whole is not None:  # scope="stage": the whole stage is one graphed call
            whole.module.refuse_checkpointing("causal_lm_stage(scope='stage')")  # turned on after graphing
            return whole.run((x, masks), {})
        return self.body(x, masks)

    def body(self, x: torch.Tensor, masks: list) -> torch.Tensor:
        """The stage's computation: the model's own forward over this stage's blocks, with the
        masks :meth:`masks` recorded for ``x``'s batch key."""
        with self._masks.replaying(masks):
            return self._run(x)

    def _run(self, x: torch.Tensor, end_at: Optional[int] = None) -> torch.Tensor:
        """The model's own forward with the block list cut to this stage (or ended before block
        ``end_at``): the base model's for a stage before the last, the causal LM's on the last."""
        model, layout = self._model, self._layout
        base = getattr(model, layout.base)
        if not self.is_first and not self.is_last and not self.layer_indices and end_at is None:
            return x  # a middle stage without blocks
        self._stage_input[0] = x
        cut = self._cut if end_at is None else self._cut_before(end_at)
        inputs = dict(input_ids=x) if self.is_first else dict(inputs_embeds=x.detach())
        # Nothing recorded through hooks while blocks are stood in for: transformers installs its
        # recording hooks once, at the first call that records, on the modules it finds then.
        text = self.config.get_text_config()
        inputs.update({k: False for k in _RECORDED if getattr(text, k, False)})
        swaps = {layout.layers: cut, **self._absent, **self._ends_at_last}
        with _swapped(base, swaps):
            try:
                if self.is_last and end_at is None:
                    return model.__class__.forward(model, **inputs, use_cache=False, return_dict=True).logits
                out = base(**inputs, use_cache=False, return_dict=True)
            except _StageEnd as end:
                return end.args[0]
            finally:
                self._stage_input[0] = None
        return out.last_hidden_state

    def _cut_before(self, stop: int) -> nn.ModuleList:
        """The model's block list as this stage's call sees it, ending before block ``stop``."""
        blocks = getattr(getattr(self._model, self._layout.base), self._layout.layers)
        start, box = self._start, self._stage_input

        def role(i, block):
            if i >= stop:
                return _StandIn(block, "end")
            if self.is_first or i > start:
                return block
            if i == start:
                return _StandIn(block, "enter", box)
            if start == stop == len(blocks) and i == start - 1:  # a last stage without blocks
                return _StandIn(block, "inject", box)
            return _StandIn(block, "pass")

        return nn.ModuleList([role(i, b) for i, b in enumerate(blocks)])

    def masks(self, x: torch.Tensor) -> list:
        """The masks the model's own forward builds for an unpadded batch of ``x``'s batch size and
        length, as ``(function name, result)`` in call order (results are ``None`` where the
        attention kernel masks causally itself).

        They depend only on the batch's shape, dtype and device and the attention kernel, so they
        are built once per such key, eagerly, by the model's own forward up to its first block
        (the random state is put back afterwards), and kept for good (graphs read them where they
        are; a warning past :data:`_MASKS_KEPT` keys). A key first seen inside a capture is
        refused: transformers would build the masks on its traced path there.
        """
        dtype = self._hidden_dtype(x)
        config = self.config
        key = (tuple(x.shape[:2]), dtype, x.device, torch.is_autocast_enabled(x.device.type),
               getattr(config, "_attn_implementation", None))
        kept = self._masks_kept.get(key)
        if kept is not None:
            return kept
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            from ..core.errors import CaptureError

            raise CaptureError(
                f"CausalLMStage {self.stage_index}: the masks for a batch of shape {list(x.shape[:2])} are first "
                f"needed inside a capture, where transformers would build them on its traced path (a full mask, no "
                f"causal attention kernel). Run this shape eagerly once first (num_warmup_steps >= 1).")
        recorded: list = []
        sample = x if self.is_first else torch.zeros(x.shape, dtype=dtype, device=x.device)
        devices = [x.device] if x.is_cuda else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices), self._masks.recording(recorded):
            self._run(sample, end_at=self._start)
        # Never dropped: a whole-step graph reads these tensors where they are.
        if len(self._masks_kept) == _MASKS_KEPT:
            warn(f"CausalLMStage {self.stage_index}: masks for {_MASKS_KEPT + 1} batch shapes are kept now "
                 f"(one set per shape, never dropped); pad batches to a few fixed shapes")
        self._masks_kept[key] = recorded
        return recorded

    def _hidden_dtype(self, x: torch.Tensor) -> torch.dtype:
        if not self.is_first:
            return x.dtype
        embed = self._model.get_input_embeddings()
        return embed.weight.dtype

    def example_io(self, micro_batch_size: int, seq_len: int) -> tuple:
        """Example ``(input, output)`` tensors of one micro-batch, for ``PipelineStage``'s
        ``input_args``/``output_args``, on the stage's device and in its dtype. Hidden-state
        inputs require grad (the stage sends their gradient back), as do outputs."""
        param = next(self.parameters())
        hidden = self.config.get_text_config().hidden_size
        if self.is_first:
            x = torch.zeros(micro_batch_size, seq_len, dtype=torch.long, device=param.device)
        else:
            x = torch.zeros(micro_batch_size, seq_len, hidden, dtype=param.dtype, device=param.device,
                            requires_grad=True)
        head = self._model.get_output_embeddings() if self.is_last else None
        width = getattr(head, "out_features", None) or self.config.get_text_config().vocab_size if self.is_last \
            else hidden
        y = torch.zeros(micro_batch_size, seq_len, width, dtype=param.dtype, device=param.device, requires_grad=True)
        return x, y

    def extra_repr(self) -> str:
        return (f"model={type(self._model).__name__}, stage={self.stage_index}/{self.num_stages}, "
                f"blocks={self.layer_indices}")

    def undo(self) -> nn.Module:
        """Release this stage's graphs and return the model it was cut from: with ``scope="blocks"``
        its blocks get their own classes back (:func:`~paddle_graphpp.torch.ungraph_layers`, in the
        model too); with ``scope="stage"`` the stage's one graph is dropped. The stage then runs
        eagerly (the model's own forward over its blocks).

        Raises:
            GraphScheduleError: micro-batches are in flight (undo between steps); nothing changes.
            RuntimeError: the stage is not graphed (built with ``graph=False``, or undone already).
        """
        scope = self.__dict__["_graphed"]
        if scope is None:
            raise RuntimeError(f"CausalLMStage {self.stage_index}: undo() on a stage that is not graphed (built with "
                               f"graph=False, or undone already); nothing to undo")
        if scope == "stage":
            self.__dict__["_whole"].engine.retire(
                "call the stage (undo() made it run eagerly), or build it again with causal_lm_stage()")
            del self.__dict__["_whole"]
        elif self.blocks:
            ungraph_layers(self.blocks)
        self.__dict__["_graphed"] = None
        return self._model


@contextlib.contextmanager
def _swapped(module: nn.Module, children: dict):
    """``module``'s children ``children`` (name -> stand-in) in place of its own, for the call."""
    own = {name: module._modules[name] for name in children}
    module._modules.update(children)
    try:
        yield
    finally:
        module._modules.update(own)


def _check_cut(model: nn.Module, stages: list) -> None:
    """Refuse a cut whose chain of stages computes other logits than the model's own forward, on
    a short batch, eagerly (before any graphing), on the device the model sits on. A model on
    the meta device or spread over devices is not checked (the cut is the model's own code but
    for the stand-ins, which the check covers on every model it can run)."""
    params = list(model.parameters())
    devices = {p.device for p in params}
    if len(devices) != 1 or next(iter(devices)).type == "meta":
        return
    device = next(iter(devices))
    vocab = model.config.get_text_config().vocab_size
    # two rows: an indexing slip between batch and row shows
    ids = torch.arange(2 * _PROBE_TOKENS, device=device).remainder(vocab).view(2, _PROBE_TOKENS)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            try:
                own = model.__class__.forward(model, input_ids=ids, use_cache=False, return_dict=True).logits
                again = model.__class__.forward(model, input_ids=ids, use_cache=False, return_dict=True).logits
                out = ids
                for stage in stages:
                    out = stage(out)
            except Exception as exc:  # noqa: BLE001 - any failure of the cut is the refusal's reason
                raise TypeError(
                    f"causal_lm_stage(): {type(model).__name__} cannot be cut into {len(stages)} stages that run its own "
                    f"forward ({type(exc).__name__}: {exc}). Build each stage as your own module and call "
                    f"graph_layers() on its blocks.") from exc
    finally:
        model.train(was_training)
    # Kernels with atomics (an expert scatter on a GPU) differ between two runs of the model's own
    # forward; a cut that loses a transform differs by far more than that.
    spread = (own.float() - again.float()).abs().max().item()
    diff = (out.float() - own.float()).abs().max().item() if out.shape == own.shape else float("inf")
    if diff > 10 * spread:
        shown = diff if out.shape == own.shape else f"shapes {list(out.shape)} and {list(own.shape)}"
        raise TypeError(
            f"causal_lm_stage(): {type(model).__name__} cut into {len(stages)} stages computes other logits than its "
            f"own forward (max difference {shown}, where two runs of its forward differ by {spread}): its forward "
            f"does more between or around its blocks than the stage cut can reproduce. Build each stage as your "
            f"own module and call graph_layers() on its blocks.")


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

    The first stage holds the embeddings, the last the final norm and the head; the blocks are
    split evenly (earlier stages take one more when they do not divide) unless
    ``layers_per_stage`` says otherwise. The stage shares the model's modules (no copies):
    move it with ``.to(device)`` and build the optimizer on ``stage.parameters()``. Its blocks
    are graphed in place (see :func:`~paddle_graphpp.torch.layers.graph_layers`), which also
    changes them in ``model``.

    Args:
        model: a ``transformers`` causal LM (a base model under its ``base_model_prefix`` with
            one list of decoder blocks), built the same way on every rank.
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
            The blocks stay plain modules then. The masks are built once per batch shape outside
            the graph (:meth:`CausalLMStage.masks`), so attention keeps its causal kernel and
            nothing in the graph reads the device.

    Returns:
        A :class:`CausalLMStage`; ``example_io(micro_batch_size, seq_len)`` gives the example
        tensors ``PipelineStage`` wants, and ``undo()`` releases its graphs (its blocks get their
        own classes back, in ``model`` too) and returns ``model``.

    Raises:
        TypeError: the model has no base model with one block list, or its stages' chain does
            not compute its own logits on a short batch (checked here, before graphing: the
            message gives the difference or the failure); a keyword that is not an option.
        UnsupportedVersionError: transformers is older than the supported range (5.0).
        ValueError: a bad ``stage_index`` or split; embeddings tied to the head across stages
            (the message says to build the model with ``tie_word_embeddings=False``); the
            model records router logits (a load-balancing loss needs every stage's); a block
            already graphed or with gradient checkpointing on.

    Warning:
        With more than one stage, the input embedding and the head live on different ranks,
        so a model that ties them (GPT-2's default) is refused: nothing here would reduce the
        tied weight's gradients across ranks. Build it with ``tie_word_embeddings=False``.
    """
    import transformers

    from ..support import require

    chosen = torch_engine_options("causal_lm_stage()", causal_lm_stage, warmup, engine_kwargs, options)
    require("transformers", transformers.__version__)
    layout = layout_of(model)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"causal_lm_stage(): num_stages must be an int >= 1, got {num_stages!r}")
    if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
        raise ValueError(f"causal_lm_stage(): stage_index must be in [0, {num_stages}), got {stage_index!r}")
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    embed_weight = getattr(embed, "weight", None)
    if num_stages > 1 and embed_weight is not None and getattr(head, "weight", None) is embed_weight:
        raise ValueError(
            f"causal_lm_stage(): {type(model).__name__} ties its input embedding to its head, which would sit on "
            f"stages 0 and {num_stages - 1} with nothing to reduce the shared weight's gradients. Build the model "
            f"with tie_word_embeddings=False in its config.")
    if num_stages > 1 and getattr(model.config.get_text_config(), "output_router_logits", False):
        raise ValueError(
            f"causal_lm_stage(): {type(model).__name__} has output_router_logits=True: its load-balancing loss needs "
            f"the router logits of every stage, which a stage's output does not carry. Set "
            f"model.config.output_router_logits = False for pipeline training.")
    if scope not in _SCOPES:
        raise ValueError(f"causal_lm_stage(): scope must be one of {_SCOPES}, got {scope!r}")
    blocks = getattr(getattr(model, layout.base), layout.layers)
    split = _split(len(blocks), num_stages, layers_per_stage)
    for i in split[stage_index]:  # a graph inside a graph is refused before the check runs the blocks
        check_layer(f"{layout.family}.{i}", blocks[i], check_config=False)
    starts = [sum(len(s) for s in split[:i]) for i in range(num_stages)]
    _check_cut(model, [CausalLMStage(model, layout, s, num_stages, split[s], starts[s]) for s in range(num_stages)])
    indices = split[stage_index]
    stage = CausalLMStage(model, layout, stage_index, num_stages, indices, starts[stage_index])
    if graph and scope == "stage":
        for i in indices:  # a recomputation inside one graph is refused
            integrations.refuse_in_whole_graph(f"{layout.family}.{i}", blocks[i], "causal_lm_stage(scope='stage')")
        stage.__dict__["_whole"] = CUDAGraphedModule(_StageBody(stage), compile=compile, options=chosen,
                                                     name=f"causal_lm_stage({stage_index}/{num_stages})")
        stage.__dict__["_graphed"] = "stage"
    elif graph:
        if indices:
            graph_in_place([(str(i), blocks[i]) for i in indices], [f"{layout.family}.{i}" for i in indices],
                           check_config=False, compile=compile, options=chosen)
        stage.__dict__["_graphed"] = "blocks"
    return stage


class GraphBody(nn.Module):
    """A module a whole-stage or whole-model graph runs, over modules it does not own.

    Its one submodule is the stage (or the model's parts), so its parameters and the state a
    replay checks are theirs; it is held outside the stage's and the model's submodules (their
    ``__dict__``), so their names and ``state_dict()`` keys stay the model's. Its train/eval mode
    (which keys the engine's signatures) is that of ``mode_of``: ``model.train()`` and
    ``model.eval()`` reach it.
    """

    def __init__(self, stage: nn.Module, mode_of: nn.Module):
        super().__init__()
        self.stage = stage
        self.__dict__["_mode_of"] = mode_of
        # the blocks' checkpointing switches, bound now: read per training call, as they may be turned on later
        self.__dict__["_switches"] = tuple((name, block, on) for name, block in self.blocks()
                                           if (on := integrations.recomputes(block)) is not None)

    @property
    def training(self) -> bool:  # type: ignore[override]
        owner = self.__dict__.get("_mode_of")
        return owner.training if owner is not None else True

    @training.setter
    def training(self, value: bool) -> None:
        pass  # follows mode_of

    def blocks(self) -> list:
        """``(name, block)`` of the blocks this graph runs."""
        stage = self.stage
        return [(f"{stage._layout.family}.{i}", b) for i, b in zip(stage.layer_indices, stage.blocks)]

    def refuse_checkpointing(self, door: str) -> None:
        """Refuse a training call while a block has gradient checkpointing on (turned on after
        graphing): the one graph does not recompute (the adapters' ``refuse_in_whole_graph``)."""
        if self.training and torch.is_grad_enabled():
            for name, block, on in self.__dict__["_switches"]:
                if on():
                    integrations.refuse_in_whole_graph(name, block, door)


class _StageBody(GraphBody):
    """What a whole-stage graph runs: :meth:`CausalLMStage.body`, given the recorded masks."""

    def __init__(self, stage: CausalLMStage):
        super().__init__(stage, stage)

    def forward(self, x: torch.Tensor, masks: list) -> torch.Tensor:
        return self.stage.body(x, masks)
