"""Graph the repeated blocks of an existing model in place: :func:`graph_layers`, :func:`ungraph_layers`.

Each block stays the same object in the same place: its class becomes a subclass of its own
(``GraphedLlamaDecoderLayer`` of ``LlamaDecoderLayer``) whose ``forward`` runs a
:class:`~paddle_graphpp.torch.graphed.CUDAGraphedModule` around the block's original forward,
kept on the block (``layer.graphed``) but not a submodule. Names, ``state_dict()`` keys, the
optimizer's parameters, ``isinstance`` checks and hooks on the block are as before. What a
graph cannot replay (caches, recorded attention weights, FSDP2 layouts) is refused by the
adapters of :mod:`paddle_graphpp.torch.integrations`, with checks bound when the block is
graphed. Gradient checkpointing recomputes inside the block's own graphs. A block an adapter
cannot capture whole (a mixture of experts' host-reading dispatch) is graphed in parts around
what cannot be captured. ``undo()`` on the returned list (or :func:`ungraph_layers`) gives the
blocks back. Usage: docs/pytorch.md, docs/moe.md.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

from ..core.errors import SignatureError
from ..core.layer import EngineHooks
from ..core.options import EngineOptions
from ..core.process import current_process
from ..core.records import Phase
from ..core.tree import flatten
from . import integrations
from .compile import RunsInPlaceOf, compile_options, opaque, refuse_inner_graphs
from .graphed import CUDAGraphedModule, torch_engine_options

__all__ = ["graph_layers", "ungraph_layers", "is_graphed_layer", "GraphedLayer", "GraphedLayers"]

_SLOT = "_graphpp_graphed"  # where a graphed block keeps its CUDAGraphedModule (outside _modules)
_NAME = "_graphpp_name"
_USER_COMPILED = "_graphpp_compiled_call_impl"  # a block.compile() taken over, given back by ungraph_layers
_CHECKS = "_graphpp_call_checks"  # the adapters' per-call checks, bound when graphed
_CHECKPOINTING = "_graphpp_checkpointing"  # a library's checkpointing switch of the block (or None), bound when graphed
_PARTS = "_graphpp_parts"  # on a block graphed in parts (around its experts): its graphed submodules
_PROBE = "_graphpp_parts_probe"  # ... and, until every part is judged, its _PartsProbe
_BLOCK = "_graphpp_block"  # on a part of a block graphed in parts: that block
_REGRAPH = "_graphpp_regraph"  # on a graphed block: (compile, options, its listing) to graph it again in parts
_INSTEAD = "_graphpp_instead"  # on a whole block whose capture failed: why, until its next call graphs it in parts


@dataclasses.dataclass(frozen=True)
class _OwnParameter:
    """Stands for one of a block's own parameters passed to its forward as an argument (Megatron's
    output layer gets its tied weight as ``weight=``). The engine sees a constant, not an input
    tensor, so the graphs read the parameter in place and accumulate its gradient like every other
    parameter's, instead of copying it into an input buffer and handing its gradient out."""

    name: str


@dataclasses.dataclass(frozen=True)
class _GivenParameter:
    """Stands for a parameter of another module passed to a block's forward as an argument
    (Megatron-Core's output layer handed the embedding's weight when both are on one stage). It is
    registered on the block's :class:`_OriginalForward` under ``slot`` when first given, before
    the block's graphs are fixed on its parameters, so the engine counts it among them: read in
    place and its storage watched like theirs (a replaced one stops the replay with an error). Its
    gradient has a part from outside the block, so the graphs hand theirs to autograd
    (``EngineHooks.summed_outside``), which sums the parts before adding them to ``.grad``."""

    slot: str


def _is_parameter(x: Any) -> bool:
    """``isinstance(x, nn.Parameter)``, without that check's Python-level ``__instancecheck__``
    for the arguments a block call usually gets (plain tensors, ``None``, flags, tuples)."""
    kind = type(x)
    if kind is torch.Tensor:
        return False
    return kind is nn.Parameter or (isinstance(x, torch.Tensor) and isinstance(x, nn.Parameter))


def _mark_parameters(layer: "GraphedLayer", args: tuple, kwargs: dict) -> tuple:
    """``args`` and ``kwargs`` with each top-level argument that is a parameter replaced by a
    constant the graphs resolve in place: an :class:`_OwnParameter` for one of ``layer``'s own, a
    :class:`_GivenParameter` for another module's (registered on the block's original forward)."""
    if not any(map(_is_parameter, args)) and not any(map(_is_parameter, kwargs.values())):
        return args, kwargs  # activations are never Parameters: the usual call stops here
    names = {id(p): n for n, p in layer.named_parameters()}
    original = layer.__dict__[_SLOT].module

    def mark(x):
        if not _is_parameter(x):
            return x
        if id(x) in names:
            return _OwnParameter(names[id(x)])
        slot = original.given(x)
        if slot is None:
            if not torch.is_grad_enabled():
                return x  # an inference call runs the forward as it is: nothing to register
            slot = _register_given(layer, original, x)
        return _GivenParameter(slot)

    return tuple(map(mark, args)), {k: mark(v) for k, v in kwargs.items()}


def _register_given(layer: "GraphedLayer", original: "_OriginalForward", param: nn.Parameter) -> str:
    """Register another module's parameter given to ``layer`` (see :class:`_GivenParameter`).

    Raises:
        SignatureError: the block's graphs are fixed on its parameters already (a signature left
            warmup): they would hold gradient buffers for another set of parameters.
    """
    name = layer.__dict__.get(_NAME, type(layer).__name__)
    if any(view.phase is not Phase.WARMUP for view in layer.engine.signatures().values()):
        raise SignatureError(
            f"{name}: a parameter that is not this block's own (shape {tuple(param.shape)}) is passed to it as an "
            f"argument for the first time after its graphs were fixed on its parameters. Pass the same parameters "
            f"from the first training call on, or call paddle_graphpp.reset_graphs(model) after changing them.")
    slot = original.register_given(param)
    layer.engine.state.reset()  # the next capture's storage watch includes it
    return slot


class _OriginalForward(RunsInPlaceOf):
    """The block's original ``forward``, called on the block itself, as the module the engine
    wraps. Its parameters are the block's (under ``layer.``); its train/eval mode is the block's."""

    _wrapped = "layer"

    def __init__(self, layer: nn.Module, forward, *, compiled: bool, checkpointing: Optional[Callable[[], bool]]):
        super().__init__()
        self.layer = layer
        self._forward = forward
        self._compiled = compiled
        self._checkpointing = checkpointing

    def graph_engine_hooks(self, name: str, options: EngineOptions) -> EngineHooks:
        """The engine sees the block itself: the adapters' view of it around each capture (FSDP2's
        unsharded parameters), its gradient checkpointing read per call (:func:`_recomputes`),
        what the adapters say when its capture fails (a mixture of experts' dispatch), and, for a
        block an adapter could graph in parts, that way on when its whole capture fails."""
        parts = integrations.graph_parts(name, self.layer, failed="")
        in_parts = parts is not None and bool(parts.graphed)
        return EngineHooks(capture_view=functools.partial(integrations.capture_view, self.layer, name),
                           recomputes=functools.partial(_recomputes, self.layer, options.recompute, self._compiled,
                                                        self._checkpointing),
                           capture_hint=integrations.capture_hint(name, self.layer),
                           another_way=functools.partial(_in_parts_instead, self.layer) if in_parts else None,
                           summed_outside=lambda: tuple(self._parameters.values()))

    def given(self, param: nn.Parameter) -> Optional[str]:
        """The attribute under which ``param``, another module's parameter passed to the block as
        an argument, is one of this module's parameters; ``None``: not registered yet."""
        return next((slot for slot, p in self._parameters.items() if p is param), None)

    def register_given(self, param: nn.Parameter) -> str:
        """Register ``param`` (see :meth:`given`); returns its attribute."""
        slot = f"given_{len(self._parameters)}"
        self.register_parameter(slot, param)
        return slot

    def forward(self, *args, **kwargs):
        def resolve(x):  # the parameter as the block holds it now: inside a capture, its alias
            if isinstance(x, _OwnParameter):
                return functools.reduce(getattr, x.name.split("."), self.layer)
            return getattr(self, x.slot) if isinstance(x, _GivenParameter) else x

        if any(isinstance(x, (_OwnParameter, _GivenParameter)) for x in (*args, *kwargs.values())):
            args, kwargs = tuple(map(resolve, args)), {k: resolve(v) for k, v in kwargs.items()}
        return self._forward(self.layer, *args, **kwargs)


class GraphedLayer(nn.Module):
    """Base of the classes :func:`graph_layers` gives graphed blocks (``Graphed<Class>``).

    Placed before the block's own class in the method resolution order; it only replaces
    ``forward`` (which checks the call, then runs the block's ``CUDAGraphedModule``) and adds
    ``graphed`` and ``engine``.
    """

    _graphpp_original: type = nn.Module

    def __call__(self, *args, **kwargs):
        checkpointing = self.__dict__[_CHECKPOINTING]
        if checkpointing is not None and checkpointing() and torch.is_grad_enabled():
            # the library's checkpoint would call the graphed forward twice (forward, then recompute
            # in the backward); the block's graphs recompute instead (_OriginalForward.graph_engine_hooks)
            return nn.Module.__call__(self, *args, **kwargs)
        return super().__call__(*args, **kwargs)

    @opaque  # torch.compile around the model calls the graphed block as it is (see .compile)
    def forward(self, *args, **kwargs):
        own = self.__dict__
        if _INSTEAD in own and not own[_SLOT].engine.in_flight:  # its whole capture failed (_in_parts_instead)
            return _graph_in_parts_now(self, args, kwargs)
        if integrations.PREPARED not in own:  # the first call: FSDP2 may have sharded the block since graphing
            integrations.prepare(self, own[_NAME])
        if torch.is_grad_enabled():
            for check in own[_CHECKS]:
                check(args, kwargs)
            _refuse_second_gradient_input(own[_NAME], args, kwargs)
        args, kwargs = _mark_parameters(self, args, kwargs)
        return own[_SLOT].run(args, kwargs)  # its forward, without a second module call

    @property
    def graphed(self) -> CUDAGraphedModule:
        """The ``CUDAGraphedModule`` that runs this block's forward (not a submodule of it)."""
        return self.__dict__[_SLOT]

    @property
    def engine(self):
        """The graph engine: ``replays``, ``captures``, ``in_flight`` and ``graph_count()``."""
        return self.__dict__[_SLOT].engine

    def extra_repr(self) -> str:
        own = self._graphpp_original.extra_repr(self)
        return f"{own}, cuda_graphs=True" if own else "cuda_graphs=True"

    def __reduce_ex__(self, protocol):
        raise TypeError(
            f"{self.__dict__.get(_NAME, type(self).__name__)} is graphed in place and cannot be pickled or "
            f"deep-copied (it holds CUDA graphs). Save model.state_dict() (its keys are the ungraphed model's), "
            f"copy the model before graph_layers(), or call paddle_graphpp.torch.ungraph_layers() first.")


def _refuse_second_gradient_input(name: str, args: tuple, kwargs: dict) -> None:
    """A block given two or more activations that carry a gradient (the hidden state and, say, the
    earlier blocks' states, as Inkling2 passes them) hands their gradients to autograd from one
    node, where eagerly they come from many: the model's shared tensors then sum them in another
    order, and training differs from eager in the last bits. Refused before anything runs."""
    def flows(a):  # an activation carrying a gradient (a parameter's gradient goes straight to its .grad)
        return isinstance(a, torch.Tensor) and a.grad_fn is not None

    if sum(map(flows, (*args, *kwargs.values()))) > 1:  # checked on every call: the arguments named only then
        flowing = [f"argument {i}" for i, a in enumerate(args) if flows(a)]
        flowing += [f"{k}=" for k, a in kwargs.items() if flows(a)]
        flowing = [f if f.startswith("argument ") else f[:-1] for f in flowing]
        raise SignatureError(
            f"{name}: graph_layers() takes blocks whose only input carrying a gradient is the hidden state; this "
            f"call passes {len(flowing)} ({', '.join(flowing)}). Their gradients would be summed in another order "
            f"than the model's own backward sums them, so training would differ from eager in the last bits. "
            f"Graph the whole model instead (graph_model(model)), or un-graph these blocks.")


class GraphedClasses(dict):
    """A block's class -> its class graphed in place, made once (a part of the process's torch section)."""


def _graphed_classes() -> GraphedClasses:
    return current_process().section("torch").part(GraphedClasses)


class GraphedLayers(list):
    """What :func:`graph_layers` returns: the graphed modules, in order (the blocks of the list it
    was given, or, for a block graphed around its experts, its graphed submodules), with
    :meth:`undo` and :attr:`eager` (what runs eagerly between graphs, and why).

    A part of a block graphed in parts that its block's first training call gives back to eager
    (see :class:`_PartsProbe`) leaves this list then, and ``eager`` says why.
    """

    def __init__(self, modules=(), eager=()):
        super().__init__(modules)
        #: ``(name, why)`` of each submodule left eager inside a block graphed in parts (a mixture of
        #: experts' routed experts whose dispatch reads the host); empty when every block is graphed whole.
        self.eager = list(eager)

    def undo(self) -> list:
        """:func:`ungraph_layers` on these modules: each gets its own class back and its graphs are
        released (a block graphed in parts is whole again). Returns them, in order.

        Raises:
            GraphScheduleError: a block has micro-batches in flight (undo between steps).
            RuntimeError: a block is not graphed any more (undone already); nothing changes.
            TypeError: a block was wrapped again after graphing (see :func:`ungraph_layers`).
        """
        for i, layer in enumerate(self):
            if not isinstance(layer, GraphedLayer):
                raise RuntimeError(f"graph_layers(...).undo(): block {i} ({type(layer).__name__}) is not graphed "
                                   f"(undone already, by undo() or ungraph_layers()); nothing was changed.")
        return ungraph_layers(list(self)) if len(self) else []


def _graphed_class(cls: type) -> type:
    graphed = _graphed_classes().get(cls)
    if graphed is None:
        graphed = type(f"Graphed{cls.__name__}", (GraphedLayer, cls), {
            "__module__": __name__,
            "__doc__": f"{cls.__name__} graphed in place by paddle_graphpp.torch.graph_layers().",
            "_graphpp_original": cls,
        })
        if "forward" in graphed.__dict__:
            # a base class's __init_subclass__ wrapped the new class's forward (transformers 5.25's
            # GradientCheckpointingLayer does, to checkpoint it): the graphed forward is ours, and
            # its graphs recompute a checkpointed block themselves (_OriginalForward.graph_engine_hooks)
            del graphed.forward
        _graphed_classes()[cls] = graphed
    return graphed


def is_graphed_layer(module: Any) -> bool:
    """Whether ``module`` was graphed in place by :func:`graph_layers`."""
    return isinstance(module, GraphedLayer)


def _entries(layers: Any) -> list:
    """``(key, module)`` pairs of the container, keys as they appear in parameter names."""
    if isinstance(layers, nn.ModuleDict):
        pairs = list(layers.items())
    elif isinstance(layers, (nn.ModuleList, nn.Sequential, list, tuple)):
        pairs = [(str(i), m) for i, m in enumerate(layers)]
    elif isinstance(layers, nn.Module):
        raise TypeError(
            f"graph_layers() takes the list of a model's repeated blocks (e.g. model.model.layers, "
            f"model.transformer.h), got a single {type(layers).__name__}; pass [module] to graph it alone, or wrap "
            f"it in CUDAGraphedModule.")
    else:
        raise TypeError(f"graph_layers() takes an nn.ModuleList, nn.ModuleDict, nn.Sequential or a list of modules, "
                        f"got {type(layers).__name__}")
    if not pairs:
        raise ValueError("graph_layers() got no layers")
    for key, module in pairs:
        if not isinstance(module, nn.Module):
            raise TypeError(f"graph_layers(): entry {key} is a {type(module).__name__}, not an nn.Module")
    return pairs


def check_layer(name: str, layer: nn.Module, check_config: bool) -> None:
    """Refuse a block that cannot be graphed: graphed already, or refused by an adapter
    (``check_config``: a model config that keeps a cache or records attention weights, too)."""
    if isinstance(layer, GraphedLayer) or _PARTS in layer.__dict__:
        raise TypeError(f"{name} is already graphed (graph_layers() was called on it before)")
    if isinstance(layer, CUDAGraphedModule):
        raise TypeError(f"{name} is already a CUDAGraphedModule; pass the plain block to graph_layers()")
    integrations.check_block(name, layer, check_config=check_config)


def graph_layers(
    layers: Union[nn.ModuleList, nn.ModuleDict, nn.Sequential, Iterable[nn.Module]],
    *warmup: int,
    name: Optional[str] = None,
    compile: Any = None,
    options: Optional[EngineOptions] = None,
    **engine_kwargs: Any,
) -> list:
    """Graph each block of a model's list of repeated blocks in place, keeping every name.

    Each block keeps its identity and place; its class becomes ``Graphed<Class>``, a subclass
    of its own, whose forward runs a :class:`~paddle_graphpp.torch.graphed.CUDAGraphedModule`
    built around the original forward (``layer.graphed``; ``layer.engine`` for replay counts).
    Parameter names, ``state_dict()`` keys, ``model.parameters()`` (so an optimizer built
    before or after) and hooks on the block are unchanged.

    Hugging Face decoder blocks are called as their models call them: the hidden state plus
    keyword arguments (``attention_mask``, ``position_ids``, ``position_embeddings`` as a
    ``(cos, sin)`` tuple, ``cache_position``, ``use_cache=False``, ``past_key_values=None``);
    tensors among them are copied into static buffers at each replay, ``None``/bool/int values
    are part of the input signature, and a tensor or a tuple output is returned as the block
    returns it. A parameter passed to a block as an argument, the block's own or another
    module's (Megatron-Core hands its output layer the tied weight as ``weight=``: the embedding's
    when both are on one stage), is read in place like the block's parameters and must keep its
    storage, as they must; another module's goes to autograd for its gradient (summed with the
    parts from outside the block, as eagerly), and must be given from the first training call on.

    Args:
        layers: the blocks: ``nn.ModuleList`` (``model.model.layers``, ``model.transformer.h``),
            ``nn.ModuleDict``, ``nn.Sequential`` or a list of modules. Graphed in place.
        name: prefix of the blocks' names in messages: ``f"{name}.{key}"`` (key: the index, or
            the ``ModuleDict`` key); default ``f"{Class}[{key}]"``.
        compile: ``True`` or a dict of ``torch.compile`` keyword arguments: each block's forward
            runs compiled (Inductor) inside its graphs, compiled in the warmup and captured
            (blocks of one class share the compiled code). A block compiled with
            ``block.compile()`` before this call is compiled this way too (with these options,
            or torch.compile's defaults: its own options are not recoverable), and
            ``mode="reduce-overhead"`` is refused. See ``CUDAGraphedModule``.
        options, **engine_kwargs: the engine options of every block (an
            :class:`paddle_graphpp.EngineOptions`, or its fields by keyword, ``num_warmup_steps``
            also positionally), documented on ``CUDAGraphedModule``.

    Mixtures of experts: a block whose routed experts dispatch with host reads (transformers'
    ``experts_implementation="eager"``; ``"grouped_mm"`` except for bf16 weights on sm90+) is
    graphed around the dispatch: its attention and its router are graphed, each in place, and
    the experts, norms, shared experts and the block's own code run eagerly between them (bit for
    bit as the model; docs/moe.md). Blocks whose experts capture (``"batched_mm"``) are graphed whole;
    should such a block's capture fail, it is graphed around its experts from its next call
    instead, with one ``CaptureFallbackWarning``, and the returned list names its parts.

    Returns:
        The graphed modules, in order, as a list (:class:`GraphedLayers`): the blocks of
        ``layers`` (the same objects), or for a block graphed around its experts its graphed
        submodules; ``.eager`` lists ``(name, why)`` of what runs eagerly inside such blocks;
        ``undo()`` is :func:`ungraph_layers` on them: each gets its own class back and its
        graphs are released.

    Raises:
        TypeError: ``layers`` is not a container of modules, or a block is already graphed; a
            keyword that is not an option (the message lists the valid names).
        ValueError: the model's config has ``use_cache`` or ``output_attentions`` on (the
            message names the block and the fix); an invalid option; a block compiled with
            Inductor's own CUDA graphs (``mode="reduce-overhead"``).

    Gradient checkpointing (``model.gradient_checkpointing_enable()``, before or after this
    call) is honoured inside the graphs: a checkpointed block's forward graph keeps only its
    inputs, and its backward graph recomputes the forward (the same dropout masks) before the
    backward, so memory drops as under eager checkpointing. ``recompute=True`` does the same for
    blocks without transformers' switch.

    Warning:
        Set ``model.config.use_cache = False`` for training. A graphed block called with grad
        enabled and ``use_cache=True``, a cache object or ``output_attentions=True`` raises
        ``ValueError``; under ``torch.no_grad()`` it runs eagerly, so ``generate()`` works.

    Warning:
        Keep input shapes fixed (pad to a fixed sequence length): each new shape is captured
        anew, up to ``max_signatures`` per block.

    Warning:
        Outputs alias graph memory until the same micro-batch position replays again (or,
        for an output the recorded step freed within the step, until the graphs captured after
        that point run); whatever still uses an output's memory then (the output, which
        ``output_hidden_states=True`` hands out, its ``.detach()``, slices, views) is first moved
        to memory of its own (a copy). On a torch without ``UntypedStorage._swap_data_ptr_``
        (2.11) only the output object moves, and tensors made from it without a copy raise when
        read after the overwrite: clone those if you keep them.

    Warning:
        Move the model to its GPU and dtype before the first step, and do not rebind
        parameters afterwards (``param.data = ...``): graphs read fixed addresses. A graphed
        model cannot be pickled or deep-copied; save its ``state_dict()``.
    """
    chosen = torch_engine_options("graph_layers()", graph_layers, warmup, engine_kwargs, options)
    pairs = _entries(layers)
    names = [f"{name}.{key}" if name else f"{type(m).__name__}[{key}]" for key, m in pairs]
    return graph_in_place(pairs, names, check_config=True, compile=compile, options=chosen)


def graph_in_place(pairs: list, names: list, *, check_config: bool, compile: Any, options: EngineOptions,
                   failed: Optional[str] = None) -> list:
    """The work of :func:`graph_layers` on ``(key, block)`` pairs named ``names``, each block's
    engine with ``options``.

    ``check_config=False`` skips the model-config checks (``use_cache``, ``output_attentions``):
    for callers that call the blocks themselves with ``use_cache=False``
    (:mod:`paddle_graphpp.torch.hf`). The per-call checks stay.

    A block an adapter cannot capture whole (:func:`~paddle_graphpp.torch.integrations.graph_parts`:
    a mixture of experts whose dispatch reads the host) is graphed in parts: its submodules the
    adapter names are graphed in place (named ``f"{name}.{submodule}"``), the rest of its forward
    runs eagerly between their graphs. ``failed``: why the blocks' whole capture failed; they
    are graphed in parts where an adapter can (:func:`_in_parts_instead`).
    """
    pairs, names, split, eager = _graphed_parts(pairs, names, failed)
    for label, (_, module) in zip(names, pairs):
        check_layer(label, module, check_config)
    seen: set = set()
    for label, (_, module) in zip(names, pairs):
        if id(module) in seen:
            raise ValueError(f"graph_layers(): {label} appears twice in the list; each block is graphed once")
        seen.add(id(module))
    compiled = compile_options(compile, "graph_layers()")
    user_compiled = [refuse_inner_graphs(layer, label) is not None for label, (_, layer) in zip(names, pairs)]
    if compiled is None and any(user_compiled):
        compiled = {}  # block.compile(): compiled inside the graphs, with torch.compile's defaults
    checkpointing = [integrations.recomputes(layer) for _, layer in pairs]
    runners = [CUDAGraphedModule(_OriginalForward(layer, _forward_of(type(layer), compiled), compiled=compiled is not None,
                                                  checkpointing=switch),
                                 name=label, options=options)
               for label, (_, layer), switch in zip(names, pairs, checkpointing)]  # every option checked first
    checks = [integrations.call_checks(label, layer) + _part_checks(label, layer, split)
              for label, (_, layer) in zip(names, pairs)]
    graphed = GraphedLayers(eager=eager)
    for label, (_, layer), runner, own, switch, bound in zip(names, pairs, runners, user_compiled, checkpointing, checks):
        layer.__dict__[_SLOT] = runner  # not a submodule: no new parameter names
        layer.__dict__[_NAME] = label
        layer.__dict__[_CHECKS] = bound
        layer.__dict__[_CHECKPOINTING] = switch
        layer.__dict__[_REGRAPH] = (compile, options, weakref.ref(graphed))
        if own:  # its call would trace the graphed block: the compiled code runs inside the graphs instead
            layer.__dict__[_USER_COMPILED] = layer._compiled_call_impl
            layer._compiled_call_impl = None
        layer.__class__ = _graphed_class(type(layer))
        graphed.append(layer)
    for block, block_label, parts in split.values():
        if _PARTS not in block.__dict__:
            block.__dict__[_PARTS] = GraphedLayers([part for _, part in parts])
            for _, part in parts:
                part.__dict__[_BLOCK] = block
            block.__dict__[_PROBE] = _PartsProbe(block, [(part.__dict__[_NAME], part) for _, part in parts], graphed)
    return graphed


def _forget_part(part: nn.Module) -> None:
    """``part`` (ungraphed now) is no longer a part of its block; a block left with none is whole."""
    block = part.__dict__.pop(_BLOCK, None)
    if block is None:
        return
    probe = block.__dict__.get(_PROBE)
    if probe is not None:
        probe.parts = [(n, p) for n, p in probe.parts if p is not part]
    parts = block.__dict__.get(_PARTS)
    if parts is not None:
        parts[:] = [p for p in parts if p is not part]
        if not parts:
            del block.__dict__[_PARTS]
            if probe is not None:
                probe.remove()


def _in_parts_instead(block: nn.Module, error: BaseException) -> Optional[str]:
    """The capture of ``block``, graphed whole, failed (an experts dispatch the adapter expected to
    capture did not): its next call with nothing of it in flight graphs it in parts instead
    (:func:`_graph_in_parts_now`). Returns what the warning says; ``None`` (the ``fallback``
    option decides) for a failure parts would not mend (out of memory), a block with its
    library's checkpointing on (its parts refuse it) or one wrapped again after graphing (FSDP2)."""
    own = block.__dict__
    switch = own.get(_CHECKPOINTING)
    if (isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (switch is not None and switch())
            or type(block) is not _graphed_classes().get(type(block)._graphpp_original)):
        return None
    first = (str(error).splitlines() or [""])[0][:200]
    own[_INSTEAD] = f"its whole capture failed ({type(error).__name__}: {first})"
    return ("from its next call it is graphed around its routed experts instead (its attention and router graphed, "
            "the experts eager), as exact as the model (docs/moe.md).")


def _graph_in_parts_now(block: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Ungraph ``block``, graph it in parts (listed where it was, in what :func:`graph_layers`
    returned), and run this call as the first call of a block graphed in parts runs: its parts
    eager and judged (:class:`_PartsProbe`)."""
    own = block.__dict__
    why, (compile, options, listing_ref), label = own[_INSTEAD], own[_REGRAPH], own[_NAME]
    listing = listing_ref()
    ungraph_layers([block])
    # the hook was given only where an adapter names parts to graph (_OriginalForward.graph_engine_hooks)
    new = graph_in_place([(label, block)], [label], check_config=False, compile=compile, options=options, failed=why)
    if listing is not None:
        at = next((i for i, m in enumerate(listing) if m is block), len(listing))
        listing[at:at + 1] = list(new)
        listing.eager += new.eager
    probe = own.get(_PROBE)
    if probe is None:
        return type(block).forward(block, *args, **kwargs)
    if listing is not None:
        probe.listing = listing
    probe._before(block, args, kwargs)  # the block's hooks ran for this call before its parts existed
    output = None
    try:
        output = type(block).forward(block, *args, **kwargs)
        return output
    finally:
        probe._after(block, args, kwargs, output)


class _PartsProbe:
    """Grad-enabled calls of a block graphed in parts run the block eagerly, its undecided parts as
    their own classes, until each part is judged from the autograd graph such a call made. A
    graphed part hands autograd one gradient per input, the sum of what its own code read of it;
    eager autograd adds every read one by one, in the order their nodes run. The two agree bit for
    bit when the part's code reads an input once, or when nothing outside the part reads it. A
    part where neither holds (an attention reading the residual stream it also adds to, a parallel
    attention and MLP on one norm's output) is given back to eager, before any of its graphs runs,
    and listed in ``graph_layers(...).eager`` with why. A part whose first input carries no
    gradient in that call (frozen embeddings before block 0) stays undecided, and eager, until a
    call where it does. The call that judges a part counts as the first warmup call of its engine
    (:meth:`~paddle_graphpp.core.lifecycle.Lifecycle.credit_warmup`). Once every part is judged the
    probe removes itself."""

    def __init__(self, block: nn.Module, parts: list, listing: "GraphedLayers"):
        self.block, self.parts, self.listing = block, parts, listing  # parts: the undecided ones
        self.calls: Optional[list] = None
        self.swapped: list = []
        self.hooks: list = []
        self.inputs: list = []
        self.checkpointing = integrations.recomputes(block)  # then the parts refuse the call (_part_checks)
        self.handles = (block.register_forward_pre_hook(self._before, with_kwargs=True),
                        block.register_forward_hook(self._after, with_kwargs=True, always_call=True))

    def remove(self) -> None:
        self._restore()
        for handle in self.handles:
            handle.remove()
        self.block.__dict__.pop(_PROBE, None)

    def _before(self, block, args, kwargs):
        self._restore()  # a probed call cut short before its hook ran
        if not torch.is_grad_enabled() or (self.checkpointing is not None and self.checkpointing()):
            return None
        self.inputs = [t for t in _tensors((args, kwargs)) if t.requires_grad]
        self.calls = []
        for name, part in self.parts:
            part.__class__ = type(part)._graphpp_original
            self.swapped.append(part)
            self.hooks.append(part.register_forward_hook(functools.partial(self._called, name), with_kwargs=True))
        return None

    def _called(self, name, part, args, kwargs, output):
        tensors = _tensors((args, kwargs))
        self.calls.append((name, bool(tensors) and tensors[0].requires_grad, [t for t in tensors if t.requires_grad],
                           [t for t in _tensors(output) if t.grad_fn is not None]))

    def _after(self, block, args, kwargs, output):
        calls, inputs = self.calls, self.inputs
        self._restore()
        if calls is None or output is None:  # not probed, or the call raised: judged at a later call
            return None
        ends = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        stops = {_edge(t).node for t in inputs}
        unsafe, undecided = {}, set()
        for name, carries, part_inputs, outputs in calls:
            if not carries:
                undecided.add(name)
            elif name not in unsafe:
                why = _reordered_sum(part_inputs, [t.grad_fn for t in outputs], ends, stops)
                if why:
                    unsafe[name] = why
        for name, why in unsafe.items():
            self._give_back(name, why)
        ran = {name for name, carries, _, _ in calls if carries}
        for name, part in self.parts:
            if name in ran and name not in unsafe and _SLOT in part.__dict__:
                # an eager training call of the part, outside its engine: its warmup counts it, so
                # that parts judged in the block's first training call capture with the blocks graphed
                # whole beside them (one pool generation). Not under the stream-ordered allocator,
                # which captures in the first call past warmup: that call would have no eager run.
                engine = part.__dict__[_SLOT].engine
                if not engine.plan.async_allocator:
                    engine.phases.credit_warmup(1)
        self.parts = [(n, p) for n, p in self.parts if n in undecided and n not in unsafe]
        if not self.parts:
            self.remove()
        return None

    def _restore(self) -> None:
        for hook in self.hooks:
            hook.remove()
        for part in self.swapped:
            if _SLOT in part.__dict__:  # still graphed
                part.__class__ = _graphed_class(type(part))
        self.hooks, self.swapped, self.inputs, self.calls = [], [], [], None

    def _give_back(self, name: str, why: str) -> None:
        part = next((p for n, p in self.parts if n == name), None)
        if part is None or not isinstance(part, GraphedLayer):
            return
        ungraph_layers([part])  # _forget_part takes it out of the block's parts
        for i, p in enumerate(self.listing):
            if p is part:
                del self.listing[i]
                break
        self.listing.eager.append((name, why))


def _tensors(tree) -> list:
    """The tensors in nested tuples, lists and dicts."""
    return [x for x in flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _edge(tensor: torch.Tensor):
    from torch.autograd.graph import get_gradient_edge

    return get_gradient_edge(tensor)


def _reads(target, ends: list, stops: set) -> int:
    """How many edges of the autograd graph above ``ends`` (not going below ``stops``) lead into
    ``target`` (a gradient edge: a node and its output number)."""
    seen, todo, count = set(), [n for n in ends if n is not None], 0
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for nxt, nr in node.next_functions:
            if nxt is None:
                continue
            if nxt is target.node and nr == target.output_nr:
                count += 1
            elif nxt not in stops:
                todo.append(nxt)
    return count


def _reordered_sum(inputs: list, part_ends: list, block_ends: list, block_stops: set) -> Optional[str]:
    """Why graphing a part would sum an input's gradient in another order than eager (``None``:
    it would not): its code reads the input more than once, and the block reads it elsewhere too."""
    edges = [_edge(t) for t in inputs]
    own_stops = {e.node for e in edges}
    for tensor, edge in zip(inputs, edges):
        inside = _reads(edge, part_ends, own_stops)
        outside = _reads(edge, block_ends, block_stops | {edge.node}) - inside
        if inside > 1 and outside > 0:
            return (f"its code reads an input carrying a gradient (shape {tuple(tensor.shape)}) {inside} times, and the "
                    f"block reads it elsewhere too ({outside} more): graphed, its gradient would be summed in another "
                    f"order than the model's backward sums it (not bit for bit)")
    return None


def _graphed_parts(pairs: list, names: list, failed: Optional[str] = None) -> tuple:
    """``pairs`` and ``names`` with each block the adapters graph in parts replaced by those parts;
    ``{id(part): (block, its name, its parts)}`` for the parts; ``(name, why)`` of what stays eager."""
    out_pairs, out_names, split, eager = [], [], {}, []
    for label, (key, block) in zip(names, pairs):
        if isinstance(block, GraphedLayer) or _PARTS in block.__dict__:
            raise TypeError(f"{label} is already graphed (graph_layers() was called on it before)")
        parts = integrations.graph_parts(label, block, failed)
        if parts is None:
            out_pairs.append((key, block))
            out_names.append(label)
            continue
        if not parts.graphed:
            raise ValueError(f"{label}: nothing in it can be graphed around "
                             f"{', '.join(n for n, _ in parts.eager)}; leave it out of graph_layers()")
        for rel, part in parts.graphed:
            out_pairs.append((f"{key}.{rel}", part))
            out_names.append(f"{label}.{rel}")
            split[id(part)] = (block, label, parts.graphed)
        eager += [(f"{label}.{rel}", why) for rel, why in parts.eager]
    return out_pairs, out_names, split, eager


def _part_checks(label: str, part: nn.Module, split: dict) -> tuple:
    """For a part of a block graphed in parts: the refusal of that block's library checkpointing
    (which would run the part's graphed forward again in the backward), bound now."""
    if id(part) not in split:
        return ()
    block, block_label, _ = split[id(part)]
    switch = integrations.recomputes(block)
    if switch is None:
        return ()
    return (functools.partial(_refuse_checkpointed_block, label, block_label, switch),)


def _refuse_checkpointed_block(label: str, block: str, switch: Callable[[], bool], args: tuple, kwargs: dict) -> None:
    if switch():
        raise ValueError(
            f"{label}: its block has gradient checkpointing on, and it is graphed around its experts: the "
            f"checkpoint would run the graphed parts again in the backward. Call "
            f"model.gradient_checkpointing_disable(), or graph whole blocks (an experts implementation without "
            f"host reads: model.set_experts_implementation('batched_mm')), whose graphs recompute {block} inside.")


def _recomputes(layer: nn.Module, always: bool, compiled: bool, checkpointing: Optional[Callable[[], bool]]) -> bool:
    """Whether a call of the graphed block recomputes: ``recompute=True``, or its library's
    gradient checkpointing (``checkpointing``, bound when graphed) on while it trains (read per
    call: it may be turned on later).

    Raises:
        ValueError: it would, and the block runs compiled (``compile=``): the compiled forward is
            not captured without autograd, as a recomputing forward graph is.
    """
    recompute = always or (checkpointing is not None and checkpointing())
    if recompute and compiled:
        raise ValueError(
            f"{layer.__dict__.get(_NAME, type(layer).__name__)}: gradient checkpointing (recompute) with compile= "
            f"is not supported: the compiled forward would compile anew for the capture without autograd. Graph "
            f"the blocks without compile=, or turn checkpointing off (model.gradient_checkpointing_disable()).")
    return recompute


def _forward_of(cls: type, compiled: Optional[dict]):
    """The class's forward function, compiled with ``compiled`` (``torch.compile`` options) if
    given: one function per class, so that its blocks share dynamo's compiled entry."""
    forward = cls.forward
    return forward if compiled is None else torch.compile(forward, **compiled)


def ungraph_layers(layers: Union[nn.ModuleList, nn.ModuleDict, nn.Sequential, Iterable[nn.Module]]) -> list:
    """Undo :func:`graph_layers`: each graphed block gets its own class back, and its attributes
    and compiled call as they were; its graphs are released (their memory is freed once no
    output of theirs is held). Blocks that are not graphed are left as they are.

    Returns:
        The blocks, in order.

    Raises:
        GraphScheduleError: a block has micro-batches in flight (run their backwards first: undo
            between steps). Nothing is changed then.
        TypeError: a block was wrapped again after graphing (``fully_shard``); nothing is changed.
    """
    entries = _entries(layers)
    split = [layer for _, layer in entries if _PARTS in layer.__dict__]
    if split:  # a block graphed in parts: its parts are ungraphed (and it is whole once none is left)
        parts = [part for block in split for part in block.__dict__[_PARTS]]
        others = [layer for _, layer in entries if _PARTS not in layer.__dict__] + parts
        for i, layer in enumerate(others):  # what the call below would refuse, refused before a probe goes
            if isinstance(layer, GraphedLayer):
                if type(layer) is not _graphed_classes().get(type(layer)._graphpp_original):
                    raise TypeError(f"ungraph_layers(): {layer.__dict__.get(_NAME, type(layer).__name__)} was "
                                    f"wrapped again after graph_layers() (fully_shard, say), which its class would "
                                    f"lose. Build the model anew without graph_layers(), or ungraph before wrapping.")
                layer.engine.check_undo()
        for block in split:
            if _PROBE in block.__dict__:
                block.__dict__[_PROBE].remove()
        ungraph_layers(others)
        return [layer for _, layer in entries]
    out = []
    for key, layer in entries:
        if isinstance(layer, GraphedLayer) and type(layer) is not _graphed_classes().get(type(layer)._graphpp_original):
            raise TypeError(
                f"ungraph_layers(): block {key} ({type(layer).__name__}) was wrapped again after graph_layers() "
                f"(fully_shard, say), which its class would lose. Build the model anew without graph_layers(), or "
                f"ungraph before wrapping.")
        if isinstance(layer, GraphedLayer):
            layer.engine.check_undo()
    for _, layer in entries:
        if isinstance(layer, GraphedLayer):
            layer.engine.retire("call the block itself (ungraph_layers() gave it its own class back)")
            integrations.release(layer)
            layer.__class__ = type(layer)._graphpp_original
            for key in (_SLOT, _NAME, _CHECKS, _CHECKPOINTING, _REGRAPH, _INSTEAD):
                layer.__dict__.pop(key, None)
            if _USER_COMPILED in layer.__dict__:
                layer._compiled_call_impl = layer.__dict__.pop(_USER_COMPILED)
            _forget_part(layer)
        out.append(layer)
    return out
