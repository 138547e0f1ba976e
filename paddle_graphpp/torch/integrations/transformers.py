"""Hugging Face ``transformers``' adapter (:data:`ADAPTER`): decoder blocks under
:func:`~paddle_graphpp.torch.layers.graph_layers`, the model's mask functions for the whole-model
and stage graphs (:class:`MaskCalls`), and the whole-step guard (:func:`traced_masks_refused`).

:func:`check_block` refuses to graph a block whose model config asks for a key/value cache,
attention weights or router logits; :func:`check_call` (bound per block when graphed, for the
blocks this adapter owns: :func:`owns`) refuses a call with grad enabled that passes
``use_cache=True``, a cache object or ``output_attentions=True``, or that transformers' output
recording asks anything of from inside the block (:func:`recorded_outputs`); each names the fix.
Under ``torch.no_grad()`` a graphed block runs eagerly, and caches work. Gradient checkpointing is
recomputation inside the block's own graphs (:func:`checkpointing`); the whole-model and
whole-stage graphs refuse it (:func:`refuse_checkpointing`). Transformers is read from
``sys.modules``, never imported here. Why: docs/pytorch.md#graph_layers-a-models-blocks-in-place.

Private names of transformers read here, checked on transformers 5.0 to 5.25:
``transformers.utils.output_capturing._active_collector`` and its hooks' ``key`` (from 5.3; 5.0
records by replacing forwards, which :func:`check_call` detects instead) and ``masking_utils._preprocess_mask_arguments``
(:func:`traced_masks_refused`). The ``create_*`` mask functions :class:`MaskCalls` swaps are public.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch
from torch import nn

from . import Adapter, ExpertsCapacity, OutsideCalls, Parts

__all__ = ["MaskCalls", "arg_positions", "owns", "check_block", "check_call", "checkpointing", "refuse_checkpointing",
           "recorded_outputs", "traced_masks_refused", "experts_modules", "experts_capture_problem", "graph_parts", "refuse_experts_in_whole_graph", "aux_loss_capture_problem", "CAPACITY", "capacity_experts_forward", "capacity_dispatch", "capacity_restore",
           "ADAPTER"]

# Arguments of a decoder block that carry a key/value cache or ask for attention weights, under
# the names transformers' decoder blocks use for them (``cache`` from transformers 5.24 on).
CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
FLAG_ARGS = ("use_cache", "output_attentions")


def arg_positions(forward) -> dict:
    """Positional indices (``self`` excluded) of the cache and flag arguments of a block's ``forward``."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return {}
    positional = [p.name for p in params
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return {n: positional.index(n) for n in (*CACHE_ARGS, *FLAG_ARGS) if n in positional}


def owns(layer: nn.Module) -> bool:
    """Whether ``layer`` is a transformers block for the per-call checks: it or a module inside it
    is of a class defined in transformers (or its remote code), or its ``forward`` names a cache or
    flag argument (a block in transformers' style)."""
    if any(type(m).__module__.startswith(("transformers.", "transformers_modules.")) for m in layer.modules()):
        return True
    try:
        names = inspect.signature(type(layer).forward).parameters
    except (TypeError, ValueError):
        return False
    return any(n in names for n in (*CACHE_ARGS, *FLAG_ARGS))


def _config_of(layer: nn.Module) -> Any:
    """The model config a block's submodules hold (transformers' attention modules keep one)."""
    for module in layer.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "use_cache"):
            return config
    return None


def checkpointing(layer: nn.Module) -> bool:
    """Whether transformers' gradient checkpointing is on for ``layer`` and it is training (its
    ``GradientCheckpointingLayer.__call__`` would then recompute it)."""
    return bool(getattr(layer, "gradient_checkpointing", False)) and layer.training


def refuse_checkpointing(name: str, layer: nn.Module, door: str) -> None:
    """Refuse ``layer`` (named ``name``) with gradient checkpointing on inside a graph of ``door``
    (a whole-model or whole-stage graph, which does not recompute).

    Raises:
        ValueError: naming the block, the door and the two ways on.
    """
    if getattr(layer, "gradient_checkpointing", False):
        raise ValueError(
            f"{name} has gradient checkpointing on, which {door} does not recompute (its one graph keeps every "
            f"activation). Call model.gradient_checkpointing_disable(), or graph the blocks with "
            f"graph_layers(), whose graphs recompute checkpointed blocks inside their backward graphs.")


def check_block(name: str, layer: nn.Module, check_config: bool) -> None:
    """Refuse to graph ``layer`` (named ``name``), with ``check_config``, under a model config
    with ``use_cache`` or ``output_attentions`` on.

    Raises:
        ValueError: naming the block and the setting to change.
    """
    config = _config_of(layer) if check_config else None
    if config is not None and getattr(config, "use_cache", False):
        raise ValueError(
            f"{name}: the model's config has use_cache=True, and a graphed layer cannot update a key/value cache "
            f"(the update would happen at capture only). Set `model.config.use_cache = False` before "
            f"graph_layers() (and pass use_cache=False to forward if you set it there); generate() under "
            f"torch.no_grad() still runs the layers eagerly and may use the cache.")
    if config is not None and getattr(config, "output_attentions", False):
        raise ValueError(
            f"{name}: the model's config has output_attentions=True; attention weights are recorded by hooks "
            f"inside the layer, which graph replays do not run. Set `model.config.output_attentions = False`.")
    if config is not None and (getattr(config, "num_kv_shared_layers", 0) or 0) > 0:
        raise ValueError(
            f"{name}: the model's config has num_kv_shared_layers={config.num_kv_shared_layers}: its last layers "
            f"read keys and values an earlier layer computed, passed outside the layers' arguments, so gradients "
            f"through them would not reach the graphed layer that made them. Graph the whole model with "
            f"graph_model() instead.")
    if config is not None and getattr(config, "output_router_logits", False) and experts_modules(layer):
        raise ValueError(
            f"{name}: the model's config has output_router_logits=True; router logits (and the load-balancing "
            f"loss made of them) are recorded by hooks inside the layer, which graph replays do not run. Set "
            f"`model.config.output_router_logits = False`, or graph the whole model with graph_model(), whose "
            f"graph computes them, or call model.set_experts_implementation('eager') so that graph_layers() "
            f"graphs around the dispatch (the router's own graph then hands its logits to the hooks).")


def check_call(name: str, layer: nn.Module, positions: Mapping[str, int], args: tuple, kwargs: dict) -> None:
    """Refuse a call of the graphed block ``layer`` (with grad enabled) that a graph cannot
    replay: ``positions`` are :func:`arg_positions` of its class's forward.

    Raises:
        ValueError: ``use_cache=True``, a cache object, attention weights asked for, or any
            output transformers records with hooks inside the block (router logits) (the
            message names the block and the fix).
    """
    def given(arg):
        if arg in kwargs:
            return kwargs[arg]
        index = positions.get(arg)
        return args[index] if index is not None and index < len(args) else None

    recorded = recorded_outputs()  # read once: the checks below ask it twice
    if given("use_cache"):
        raise ValueError(
            f"{name}: use_cache=True reached a graphed layer, which cannot update a key/value cache (the "
            f"update would happen at capture only). For training set `model.config.use_cache = False` or "
            f"pass use_cache=False to the model's forward; under torch.no_grad() (generate()) the layer runs "
            f"eagerly and the cache works.")
    for arg in CACHE_ARGS:
        cache = given(arg)
        if cache is not None:
            raise ValueError(
                f"{name}: a cache object ({type(cache).__name__}, argument {arg}) reached a graphed layer, "
                f"which cannot update it (the update would happen at capture only). For training set "
                f"`model.config.use_cache = False` or pass use_cache=False (and no cache object) to the "
                f"model's forward; under torch.no_grad() the layer runs eagerly and caches work.")
    if given("output_attentions") or "attentions" in recorded:
        raise ValueError(
            f"{name}: output_attentions=True with a graphed layer: attention weights are recorded by hooks "
            f"inside the layer, which graph replays do not run. Pass output_attentions=False (and leave "
            f"model.config.output_attentions off) while training with graphs.")
    # The block's own output (hidden_states) is recorded by a hook on the block, which runs; any
    # other recorded output comes from hooks inside it.
    if "transformers.utils.output_capturing" in sys.modules:
        inside = sorted(k for k in recorded if k != "hidden_states" and not k.startswith("_"))
        if inside:  # only what hooks on modules inside this one record (its own hooks run around its graphs)
            hooked = _recorded_inside(layer)
            inside = [k for k in inside if hooked is None or k in hooked]
    else:  # older transformers record by replacing the forward of the modules they record, per call
        inside = [f"the outputs of {n}" for n, m in layer.named_modules() if n and "forward" in m.__dict__]
    if inside:
        raise ValueError(
            f"{name}: the model's forward records {', '.join(inside)} with hooks inside a graphed layer, which "
            f"graph replays do not run (a load-balancing loss made of router logits would be wrong). Pass "
            f"output_router_logits=False (and leave it off in the config) while training with graphed layers, or "
            f"graph the whole model with graph_model(), whose graph computes them.")


def _recorded_inside(layer: nn.Module) -> Optional[set]:
    """The outputs transformers' recording hooks on ``layer``'s submodules (not on ``layer``)
    record, read from each hook's ``key`` (its ``install_output_capuring_hook`` closure, a private
    structure, checked on 5.3 to 5.25); ``None`` when a hook inside is not one of those (or
    cannot be read): then every recorded output counts as recorded inside."""
    keys = set()
    for name, module in layer.named_modules():
        if not name:
            continue
        for hook in module._forward_hooks.values():
            code = getattr(hook, "__code__", None)
            if code is None or getattr(hook, "__name__", "") != "output_capturing_hook" or "key" not in code.co_freevars:
                return None
            keys.add(hook.__closure__[code.co_freevars.index("key")].cell_contents)
    return keys


def recorded_outputs() -> Any:
    """What ``transformers``' output recording collects in the current forward (its hooks feed a
    context variable, ``transformers.utils.output_capturing._active_collector``, a private name:
    read defensively); empty when transformers is not loaded or records nothing."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    try:
        found = collector.get() if collector is not None else None
    except LookupError:  # a context variable without a default, never set
        found = None
    return found if isinstance(found, dict) else {}


class MaskCalls(OutsideCalls):
    """The mask functions a model's own forward calls, run eagerly once per batch key and handed
    back by value inside graphs.

    Transformers' mask helpers (``transformers.masking_utils.create_*``: causal, sliding-window,
    chunked, per layer type) read a device value on the host when run eagerly (packed-sequence
    detection) and take a slower traced path (a full mask, no causal attention kernel) when run
    inside a stream capture. The whole-model and stage bodies run the model's own forward; around
    it, the ``create_*`` names that the model's modeling modules imported from
    ``masking_utils`` are swapped for the duration of the call: :meth:`recording` runs them and
    keeps their results in call order, :meth:`replaying` hands those results back in the same
    order. For an unpadded batch without a cache the masks depend only on the batch's shape,
    dtype, device and the attention kernel, which key the recordings.

    Raises (from :meth:`replaying`): ``RuntimeError`` when the forward asks for other masks
    than it did when recorded (a model that builds masks from the values of its inputs).
    """

    def __init__(self, owner: str, *models: nn.Module):
        self.owner = owner
        self._swaps = []  # (module, global name, original function)
        seen = set()
        for model in models:
            module = sys.modules.get(type(model).__module__)
            if module is None or id(module) in seen:
                continue
            seen.add(id(module))
            for name, value in vars(module).items():
                if (name.startswith("create_") and callable(value)
                        and getattr(value, "__module__", None) == "transformers.masking_utils"):
                    self._swaps.append((module, name, value))

    @property
    def names(self) -> tuple:
        """The mask functions swapped, as ``module.name``."""
        return tuple(f"{m.__name__}.{n}" for m, n, _ in self._swaps)

    def recording(self, into: list):
        """Context: the model's mask functions run and append ``(name, result)`` to ``into``."""
        def wrap(name, fn):
            def record(*args, **kwargs):
                result = fn(*args, **kwargs)
                into.append((name, result))
                return result
            return record
        return self._swapped(wrap)

    def replaying(self, recorded: list):
        """Context: the model's mask functions hand back ``recorded``'s results in order."""
        done = [0]  # an index, not an iterator: torch.compile traces list indexing

        def wrap(name, fn):
            def replay(*args, **kwargs):
                made = recorded[done[0]] if done[0] < len(recorded) else None
                done[0] += 1
                if made is None or made[0] != name:
                    raise RuntimeError(
                        f"{self.owner}: the model's forward asked for the mask {name} where it asked for "
                        f"{made[0] if made else 'no further mask'} when its masks were recorded; its masks depend "
                        f"on more than the batch's shape. Graph its blocks with graph_layers() instead.")
                return made[1]
            return replay
        return self._swapped(wrap)

    def _swapped(self, wrap):
        @contextlib.contextmanager
        def swapped():
            for module, name, fn in self._swaps:
                setattr(module, name, wrap(name, fn))
            try:
                yield
            finally:
                for module, name, fn in self._swaps:
                    setattr(module, name, fn)
        return swapped()


@contextlib.contextmanager
def traced_masks_refused():
    """transformers builds attention masks on its traced path inside a capture (it counts stream
    capture as tracing): a full mask, so attention loses its causal kernel, and with dropout it
    draws other random numbers than eagerly. Silently slower and different: refused around a
    whole-step capture, naming the way round (graph_model builds the mask outside the graph).
    Patches the private ``masking_utils._preprocess_mask_arguments`` (transformers 5.0 to 5.25),
    which every ``create_*`` mask function calls first; does nothing where it is absent."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "_preprocess_mask_arguments", None)
    if original is None:
        yield
        return

    def refused(*args, **kwargs):
        raise RuntimeError(
            "transformers built an attention mask inside the capture, where it takes its traced path (a "
            "materialised mask: no causal attention kernel, other dropout draws). Graph the model with "
            "paddle_graphpp.torch.graph_model(model) before graph_step (it builds the mask once per shape, "
            "outside the graph)")

    masking._preprocess_mask_arguments = refused
    try:
        yield
    finally:
        masking._preprocess_mask_arguments = original


# transformers' mixture-of-experts blocks dispatch their routed experts by the config's experts
# implementation (``use_experts_implementation`` classes, read through the private
# ``config._experts_implementation``; checked on transformers 5.0, 5.3 and 5.25 source). What each
# implementation does in a capture, from its code and torch's grouped matmul (torch 2.11, 2.13):
#: The experts implementation :func:`capacity_dispatch` registers in transformers' experts interface.
CAPACITY = "graphpp_capacity"
_EXPERTS_IN_A_CAPTURE = MappingProxyType({
    "batched_mm": None,  # fixed-shape gathers and batched matmuls: nothing read on the host
    CAPACITY: None,  # fixed per-expert buffers (capacity_experts_forward)
    "grouped_mm": "torch's grouped matmul reads the group offsets on the host except for bf16 weights on sm90+",
    "eager": "a Python loop over the experts the batch hits (nonzero, host reads)",
})


def experts_modules(layer: nn.Module) -> list:
    """``(name, module, implementation)`` of each experts module inside ``layer`` that transformers
    dispatches by its experts implementation; ``[]`` for a dense block."""
    found = []
    for name, module in layer.named_modules():
        config = getattr(module, "config", None)
        if hasattr(type(module), "_apply_gate") and config is not None and hasattr(config, "_experts_implementation"):
            found.append((name, module, config._experts_implementation or "grouped_mm"))
    return found


def experts_capture_problem(module: nn.Module, implementation: str) -> Optional[str]:
    """Why ``module``'s expert path (dispatching with ``implementation``) cannot be captured as it
    is, or ``None`` when it can. An implementation this table does not know is reported too."""
    if implementation == "grouped_mm":
        weight = next(module.parameters(), None)
        if (weight is not None and weight.is_cuda and weight.dtype == torch.bfloat16
                and torch.cuda.get_device_capability(weight.device) >= (9, 0)):
            return None
    if implementation in _EXPERTS_IN_A_CAPTURE:
        return _EXPERTS_IN_A_CAPTURE[implementation]
    return f"its implementation {implementation!r} is not known to be free of host reads"


def moe_capture_hint(name: str, layer: nn.Module, error: BaseException) -> Optional[str]:
    """What to say when a capture of the block ``layer``, graphed whole, fails with an experts
    module inside it (``None`` for a block without one)."""
    found = experts_modules(layer)
    if not found:
        return None
    where, module, impl = found[0]
    why = experts_capture_problem(module, impl)
    ways = [] if why is None else ["model.set_experts_implementation('batched_mm') before graphing (no host read, in "
                                   "any dtype, at some memory cost) to graph whole blocks"]
    ways += ["model.set_experts_implementation('eager') to graph around the dispatch (attention and router graphed, "
             "experts eager)", "paddle_graphpp.torch.capacity_experts(model) for a fixed per-expert capacity",
             "fallback='eager'"]
    return (f"{name}.{where} dispatches its routed experts with experts_implementation={impl!r} "
            f"({why or 'it was expected to capture'}). Call " + ", or ".join(ways) + ".")


def refuse_experts_in_whole_graph(name: str, layer: nn.Module, door: str) -> None:
    """Refuse ``layer`` inside one graph of ``door`` (a whole model or stage) when an experts
    module in it, on a GPU, dispatches in a way a capture cannot hold (off a GPU nothing is
    captured, and the graph runs eagerly).

    Raises:
        ValueError: naming the experts module, its implementation and the ways on.
    """
    for where, module, impl in experts_modules(layer):
        weight = next(module.parameters(), None)
        why = experts_capture_problem(module, impl) if weight is not None and weight.is_cuda else None
        if why:
            raise ValueError(
                f"{name}.{where} dispatches its routed experts with experts_implementation={impl!r} ({why}), which "
                f"the one graph of {door} cannot hold. Call model.set_experts_implementation('batched_mm') before "
                f"graphing (no host read, in any dtype, at some memory cost), train in bf16 on an sm90+ GPU with "
                f"'grouped_mm', or graph the blocks with graph_layers(), which graphs around the dispatch.")


def aux_loss_capture_problem(model: nn.Module) -> Optional[str]:
    """Why ``model``'s load-balancing loss cannot be captured, or ``None``: the
    ``load_balancing_loss_func`` of its modeling module (what its forward adds with
    ``output_router_logits=True``) is called once, on a GPU, on a small input with torch's sync
    debug mode set to raise, so a host read there (``torch.bincount``, which reads the largest
    count, in transformers 5.16 to 5.22) raises.
    Off a GPU nothing is captured: ``None``."""
    weight = next(model.parameters(), None)
    func = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    if func is None or weight is None or not weight.is_cuda:
        return None
    found = experts_modules(model)
    if not found:
        return None
    experts = getattr(found[0][1], "num_experts", None)
    top_k = getattr(model.config.get_text_config(), "num_experts_per_tok", None)
    if not isinstance(experts, int) or not isinstance(top_k, int):
        return None
    logits = (torch.randn(4 * experts, experts, device=weight.device),)
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        func(logits, experts, top_k, None)
    except RuntimeError as exc:  # only a host read is this function's business
        if "synchroniz" in str(exc):
            return f"{type(model).__module__}.load_balancing_loss_func reads the host ({str(exc).strip()[:120]})"
    except Exception:  # noqa: BLE001 - a signature this probe does not know: the capture will tell
        pass
    finally:
        torch.cuda.set_sync_debug_mode(before)
    return None


_CAPACITY = "_graphpp_capacity"  # an experts module's ExpertsCapacity (in its __dict__)
_DROPPED = "_graphpp_capacity_dropped"  # ... and its drop counter, a buffer that is not saved


def capacity_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts of ``self`` (a transformers experts module, its weights stacked per
    expert) at a fixed capacity, registered as the experts implementation :data:`CAPACITY`.

    The (token, expert) pairs take their experts' slots choice by choice: every token's first
    choice, in token order, then every token's second, and so on (the order drop-and-pad routers
    use, so that a first choice is dropped last); an expert has :meth:`ExpertsCapacity.slots` of
    them. Pairs past the last slot are dropped (their output is zero) and, in a call with grad
    enabled, counted on the device. The slots are filled by one scatter, each projection is one
    batched matmul over every expert's slots, and each pair's output is gathered back: every
    shape is fixed by the batch's, nothing is read on the host, and nothing is summed with atomics.
    The routing weights multiply and sum in their own dtype, as the other implementations do."""
    capacity = self.__dict__.get(_CAPACITY)
    if capacity is None:
        raise RuntimeError(
            f"{type(self).__name__}: experts_implementation={CAPACITY!r} is set by "
            f"paddle_graphpp.torch.capacity_experts(model) for the experts modules of the model it was given, and "
            f"this one was not among them (a model sharing its config, or a submodule's call?). Call it on this "
            f"model itself, or choose another experts implementation.")
    if getattr(self, "_is_expert_parallel", False):
        raise NotImplementedError(f"{capacity.name}: the capacity mode does not take expert parallelism yet")
    gated = getattr(self, "has_gate", True)  # the flags transformers' decorator sets (5.0 has no has_gate: gated)
    bias, transposed = getattr(self, "has_bias", False), getattr(self, "is_transposed", False)
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.size(-1)
    experts = (self.gate_up_proj if gated else self.up_proj).size(0)
    slots = capacity.slots(tokens * top_k, experts)
    ids = top_k_index.t().reshape(-1)  # choice-major: (choice, token)
    hits = torch.nn.functional.one_hot(ids, experts)  # (pairs, experts)
    place = (hits.cumsum(0) * hits).sum(-1) - 1  # each pair's place among its expert's pairs
    kept = place < slots
    if torch.is_grad_enabled():  # training calls: what the optimizer step's check reads
        dropped = getattr(self, _DROPPED)
        dropped.add_((~kept).sum().to(dropped.device))
    sink = experts * slots  # one row past the slots, where dropped pairs go
    slot = torch.where(kept, ids * slots + place, sink)
    rows = hidden_states.repeat(top_k, 1)
    filled = hidden_states.new_zeros(sink + 1, hidden).index_put((slot,), rows)[:sink].view(experts, slots, hidden)

    def linear(x, weight, offset):
        out = torch.bmm(x, weight if transposed else weight.transpose(1, 2))
        return out if offset is None else out + offset.unsqueeze(1)

    if gated:
        up = self._apply_gate(linear(filled, self.gate_up_proj, self.gate_up_proj_bias if bias else None))
    else:
        up = self.act_fn(linear(filled, self.up_proj, self.up_proj_bias if bias else None))
    out = linear(up, self.down_proj, self.down_proj_bias if bias else None)
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    out = torch.cat([out.reshape(sink, hidden), out.new_zeros(1, hidden)])[slot]  # dropped pairs: zero
    weighted = out * top_k_weights.t().reshape(-1, 1)
    return weighted.view(top_k, tokens, hidden).sum(dim=0).to(hidden_states.dtype)


def _register_capacity() -> None:
    """Register :func:`capacity_experts_forward` in transformers' experts interface (public:
    ``ALL_EXPERTS_FUNCTIONS.register``, 5.0 to 5.25), once, if transformers' MoE code is loaded."""
    moe = sys.modules.get("transformers.integrations.moe")
    if moe is not None and CAPACITY not in moe.ALL_EXPERTS_FUNCTIONS:
        moe.ALL_EXPERTS_FUNCTIONS.register(CAPACITY, capacity_experts_forward)


def capacity_dispatch(model: nn.Module, factor: float, on_overflow: str) -> Optional[tuple]:
    """:meth:`Adapter.capacity_dispatch` for transformers' experts modules: registers
    :func:`capacity_experts_forward` (:func:`_register_capacity`), gives each experts module its
    drop counter (a buffer that is not saved, so that it moves with the model) and sets the
    implementation in the configs they hold (:func:`_set_implementation`); the undo sets the ones
    before. Refuses a config that is not the model's own (a submodule given, or a shared config):
    the other modules holding it would switch too."""
    found = experts_modules(model)
    if not found:
        return None
    if any(_CAPACITY in module.__dict__ for _, module, _ in found):
        raise ValueError(f"capacity_experts(): {type(model).__name__}'s experts are in capacity mode already; undo() "
                         f"the capacity mode first")
    own = getattr(model, "config", None)
    owned = {id(own)} | ({id(own.get_text_config())} if hasattr(own, "get_text_config") else set())
    owned |= {id(getattr(own, k)) for k in getattr(own, "sub_configs", {}) if getattr(own, k, None) is not None}
    for name, module, _ in found:
        if id(module.config) not in owned:
            raise TypeError(
                f"capacity_experts(): {name} holds a config that is not {type(model).__name__}'s own; its experts "
                f"implementation would switch for every module holding it. Pass the whole model (the "
                f"PreTrainedModel), and give each model its own config.")
    before = {id(module.config): (module.config, module.config._experts_implementation) for _, module, _ in found}
    _register_capacity()
    states = []
    for name, module, _ in found:
        weight = next(module.parameters(), None)
        module.register_buffer(_DROPPED, torch.zeros((), dtype=torch.int64, device=getattr(weight, "device", None)),
                               persistent=False)
        states.append(ExpertsCapacity(name, factor, on_overflow, module, _DROPPED))
        module.__dict__[_CAPACITY] = states[-1]
    _set_implementation([(c, CAPACITY) for c, _ in before.values()])
    return states, tuple(before.values())


def _set_implementation(configs) -> None:
    """Each ``(config, experts implementation)``: what the experts modules holding that config
    dispatch by (the private ``config._experts_implementation`` they read per call, 5.0 to 5.25;
    ``set_experts_implementation`` takes only the implementations it lists before 5.25)."""
    for config, implementation in configs:
        config._experts_implementation = implementation


def capacity_restore(model: nn.Module, before: Any) -> bool:
    """Undo :func:`capacity_dispatch`: the experts implementation ``before`` it, no capacity state."""
    found = [module for _, module, _ in experts_modules(model) if _CAPACITY in module.__dict__]
    if not found:
        return False
    _set_implementation(before)
    for module in found:
        module.__dict__.pop(_CAPACITY, None)
        module._buffers.pop(_DROPPED, None)
    return True


def capacity_suspended(model: nn.Module, before: Any) -> Optional[contextlib.AbstractContextManager]:
    """:meth:`Adapter.capacity_suspended`: the experts implementations ``before`` the capacity mode
    inside, the capacity mode's again after."""
    if not any(_CAPACITY in module.__dict__ for _, module, _ in experts_modules(model)):
        return None

    @contextlib.contextmanager
    def suspended():
        _set_implementation(before)
        try:
            yield
        finally:
            _set_implementation([(config, CAPACITY) for config, _ in before])
    return suspended()


_SHARED_INPUT = ("around a dispatch only the attention and the router are graphed: a module beside them may read "
                 "an input the block also reads elsewhere (a norm on the residual stream, a shared expert beside the "
                 "routed experts), and graphed alone it would sum that input's gradient in another order than the "
                 "model's own backward (not bit for bit)")


def _graphable_part(name: str, module: nn.Module, in_moe_block: bool) -> bool:
    """Whether a submodule of a block graphed around its experts can be graphed alone and stay bit
    for bit: one whose input no module outside it reads (the attention: the block's first norm
    feeds it alone), or which reads its input once (the router's one projection). A norm on the
    residual stream or a shared expert reads its input twice while other branches read it too."""
    last = name.rpartition(".")[2].lower()
    if last.endswith(("attn", "attention")):  # self_attn, attention, self_attention (not post_attention_layernorm)
        return True
    return in_moe_block and (last in ("gate", "router") or "router" in type(module).__name__.lower())


def graph_parts(name: str, layer: nn.Module, failed: Optional[str] = None) -> Optional[Parts]:
    """Graphs around the routed experts of a block whose experts dispatch cannot be captured
    (:func:`experts_capture_problem`; with ``failed``, every experts module, for that reason):
    its attention and its router, each graphed in place; the experts, the other submodules
    (:func:`_graphable_part` says why) and the block's own code between them (residual adds, the
    routing glue) run eagerly. ``None`` for a block without such experts (graphed whole)."""
    problems = [(n, m, impl, why) for n, m, impl in experts_modules(layer)
                if (why := failed if failed is not None else experts_capture_problem(m, impl)) is not None]
    if not problems:
        return None
    experts = {id(m) for _, m, _, _ in problems}
    graphed, eager = [], [(n, f"experts_implementation={impl!r}: {why}") for n, _, impl, why in problems]

    def walk(prefix: str, module: nn.Module, in_moe_block: bool) -> None:
        for child_name, child in module.named_children():
            full = f"{prefix}{child_name}"
            if id(child) in experts:
                continue
            if any(id(m) in experts for m in child.modules()):
                walk(f"{full}.", child, any(id(c) in experts for c in child.children()))
            elif _graphable_part(full, child, in_moe_block):
                graphed.append((full, child))
            elif next(child.parameters(), None) is not None:
                eager.append((full, _SHARED_INPUT))

    walk("", layer, any(id(c) in experts for c in layer.children()))
    return Parts(graphed=tuple(graphed), eager=tuple(eager))


@dataclass(frozen=True)
class TransformersAdapter(Adapter):
    """transformers as the front doors see it."""

    name = "transformers"

    def check_block(self, name, layer, *, check_config) -> None:
        check_block(name, layer, check_config)

    def refuse_in_whole_graph(self, name, layer, door) -> None:
        refuse_checkpointing(name, layer, door)
        refuse_experts_in_whole_graph(name, layer, door)

    def aux_loss_capture_problem(self, model):
        return aux_loss_capture_problem(model)

    def graph_parts(self, name, layer, failed=None):
        return graph_parts(name, layer, failed)

    def capacity_dispatch(self, model, factor, on_overflow):
        return capacity_dispatch(model, factor, on_overflow)

    def capacity_restore(self, model, before):
        return capacity_restore(model, before)

    def capacity_suspended(self, model, before):
        return capacity_suspended(model, before)

    def call_check(self, name, layer):
        if not owns(layer):
            return None
        return functools.partial(check_call, name, layer, arg_positions(type(layer).forward))

    def recomputes(self, layer):
        # transformers switches checkpointing only on modules that have the attribute already
        # (PreTrainedModel._set_gradient_checkpointing): a block without it never gets it.
        return functools.partial(checkpointing, layer) if hasattr(layer, "gradient_checkpointing") else None

    def capture_hint(self, name, layer):
        if not experts_modules(layer):
            return None
        return functools.partial(moe_capture_hint, name, layer)

    def outside_calls(self, owner, models):
        calls = MaskCalls(owner, *models)
        return calls if calls.names else None

    def capture_guard(self, owner):
        return traced_masks_refused()


ADAPTER = TransformersAdapter()
_register_capacity()  # a model unpickled in capacity mode finds its implementation
