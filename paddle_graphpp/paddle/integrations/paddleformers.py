"""PaddleFormers, as the pipeline front door meets it: its pipe models are fleet ``PipelineLayer``
subclasses and graph as such; this adapter checks the version and refuses what they add.

Checked on PaddleFormers 1.2.0 (``paddle_graphpp.support.SUPPORTED["paddleformers"]``), and on the
newer sources' ``paddleformers/fleet/cudagraph.py`` for ``autocudagraph`` (read, not run). It
never imports PaddleFormers: a model is one of its own when its class is defined in its package,
and what is refused is recognised on the model itself, whatever library built it:

* ``config.recompute_granularity`` set: the decoder layers recompute inside their own forward,
  that is inside a graphed run (docs/paddle.md#recompute);
* a layer, callable or sublayer method wrapped by ``autocudagraph``, recognised by what the
  decorator leaves on the wrapper (its ``state_registry`` dict and ``clear_cache()``): no graph
  inside a graph (docs/paddle.md#paddleformers-autocudagraph-compared).

Its decoder layers with a mixture of experts (Qwen2-MoE, Qwen3-MoE, Qwen3-Next, GLM-4-MoE,
DeepSeek-V3, GPT-OSS, ERNIE 4.5 MoE: a sublayer holding ``experts`` beside a ``gate`` or
``router``) dispatch over their experts with host reads (a Python loop over the experts,
``paddle.where``, a token count tested on the host), which no capture can hold: they are graphed
in parts (:meth:`PaddleFormersAdapter.graph_parts`, docs/moe.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from paddle import nn

from paddle_graphpp.support import require

from . import Adapter, Parts

__all__ = ["PaddleFormersAdapter", "ADAPTER"]

_PACKAGE = "paddleformers"

# What PaddleFormers' ``paddleformers.fleet.cudagraph.autocudagraph`` leaves on the function it
# wraps (newer sources than 1.2.0): its per-key graph registry and the method that empties it.
_AUTOCUDAGRAPH_MARKS = ("state_registry", "clear_cache")


def _refuse_config_recompute(model, subject):
    """PaddleFormers' pipe models recompute inside their decoder layers when their config asks for
    it (``recompute_granularity``), not through fleet's ``recompute_interval``."""
    granularity = getattr(getattr(model, "config", None), "recompute_granularity", None)
    if granularity is not None:
        raise ValueError(
            f"{subject} cannot take over config.recompute_granularity={granularity!r}: PaddleFormers "
            "recomputes inside each decoder layer's forward (fleet's recompute around the layer, or around its "
            "attention and MLP), that is inside a graphed run, whose backward graph would then capture that "
            "recompute's own backward, which adds the weight gradients into .grad behind the graph and restores "
            "the RNG state on the host only. Set "
            "recompute_granularity=None in the model's config and in TrainingArguments; to recompute with graphs, "
            "set model._recompute_interval = 1 before graph_pipeline (each decoder layer then recomputes inside "
            "its own graphs), or train without graph_pipeline")


def _wrapped_by_autocudagraph(fn) -> bool:
    fn = getattr(fn, "__func__", fn)  # a bound method: the function it binds
    registry, clear = _AUTOCUDAGRAPH_MARKS
    return isinstance(getattr(fn, registry, None), dict) and callable(getattr(fn, clear, None))


def _autocudagraph_methods(layer):
    """Names of ``layer``'s methods wrapped by autocudagraph, its own assignments first, then its
    classes' up to ``nn.Layer`` (whose methods are Paddle's)."""
    found = {}
    for klass in type(layer).__mro__:
        if klass is nn.Layer or klass is object:
            break
        for attr, value in vars(klass).items():
            found.setdefault(attr, value)
    found.update({attr: value for attr, value in vars(layer).items() if callable(value)})
    return sorted(attr for attr, value in found.items() if _wrapped_by_autocudagraph(value))


def _refuse_autocudagraph(subject, entries):
    """No graph inside a graph: a layer (or callable) of the model already graphed by autocudagraph."""
    for _, start, run_function in entries:
        for offset, obj in enumerate(run_function):
            target = obj.func if isinstance(obj, functools.partial) else obj
            where = f"layers[{start + offset}] ({type(target).__name__})"
            wrapped = []
            if _wrapped_by_autocudagraph(target):
                wrapped.append(getattr(target, "__name__", type(target).__name__))
            if isinstance(target, nn.Layer):
                for path, layer in target.named_sublayers(include_self=True):
                    prefix = f"{path}." if path else ""
                    wrapped += [f"{prefix}{method} of {type(layer).__name__}"
                                for method in _autocudagraph_methods(layer)]
            if wrapped:
                raise ValueError(
                    f"{subject}: {where} is already CUDA-graphed by PaddleFormers' autocudagraph "
                    f"decorator ({', '.join(wrapped)} carries its state_registry and clear_cache), and a graph "
                    "cannot be captured inside another graph. Use one of the two: remove @autocudagraph from "
                    "those methods and let graph_pipeline graph the layers, or train without graph_pipeline "
                    "and install()")


# A mixture of experts, as PaddleFormers 1.2.0 builds one: its experts, beside a router under one of
# these names (``gate``: Qwen2/3-MoE, Qwen3-Next, GLM-4-MoE, DeepSeek-V3, ERNIE 4.5; ``router``: GPT-OSS).
_EXPERTS = "experts"
_ROUTERS = ("gate", "router")
_ATTENTION_SUFFIXES = ("attn", "attention")  # self_attn, linear_attn (Qwen3-Next)

_WHY_EXPERTS = ("the dispatch over the experts reads the host (a Python loop over the experts, paddle.where, "
                "a token count tested on the host): no capture can hold it")
_WHY_NORM = ("a norm on the residual stream: graphed alone, the gradient of its input, which the residual add "
             "reads too, would be summed in another order than eager autograd sums it (not bit for bit)")
_WHY_LINEAR = ("a lone linear layer: the mixture's own forward does the softmax and top-k, so a graph of it would "
               "launch one kernel as a graph")
_WHY_SHARED = ("reads the mixture's input, which the router and the experts read too: graphed alone, that "
               "input's gradient would be summed in another order than eager autograd sums it (not bit for bit)")


def _own(layer) -> bool:
    return type(layer).__module__.startswith(f"{_PACKAGE}.")


def _mixture(layer):
    """``(path, block)`` of the sublayer of ``layer`` holding experts beside a router, or ``None``."""
    for path, sub in layer.named_sublayers():
        children = dict(sub.named_children())
        if _EXPERTS in children and any(name in children for name in _ROUTERS):
            return path, sub
    return None


def _parts(layer) -> Parts | None:
    found = _mixture(layer)
    if found is None:
        return None
    path, block = found
    children = dict(block.named_children())
    graphed = [(name, child) for name, child in layer.named_children() if name.endswith(_ATTENTION_SUFFIXES)]
    eager = [(f"{path}.{_EXPERTS}", _WHY_EXPERTS)]
    own_input = []
    for name in (name for name in _ROUTERS if name in children):
        if isinstance(children[name], nn.Linear):
            eager.append((f"{path}.{name}", _WHY_LINEAR))
        else:  # graphed, reading its own copy of the mixture's input (docs/moe.md)
            graphed.append((f"{path}.{name}", children[name]))
            own_input.append((path, f"{path}.{name}"))
    for name in (name for name in children if name.startswith("shared_expert")):
        if own_input:  # beside a graphed router, graphed too, reading a copy of its own
            graphed.append((f"{path}.{name}", children[name]))
            own_input.append((path, f"{path}.{name}"))
        else:
            eager.append((f"{path}.{name}", _WHY_SHARED))
    eager += [(name, _WHY_NORM) for name, child in layer.named_children() if "Norm" in type(child).__name__]
    return Parts(tuple(graphed), tuple(eager), tuple(own_input))


@dataclass(frozen=True, slots=True)
class PaddleFormersAdapter(Adapter):
    """PaddleFormers' version for its models; its in-layer recompute and ``autocudagraph``, refused;
    its decoder layers with a mixture of experts, graphed in parts."""

    def start(self, model) -> None:
        if type(model).__module__.startswith(f"{_PACKAGE}."):
            require(_PACKAGE)

    def refuse(self, model, subject: str, entries) -> None:
        _refuse_config_recompute(model, subject)
        _refuse_autocudagraph(subject, entries)

    def graph_parts(self, name: str, layer) -> Parts | None:
        """For a PaddleFormers decoder layer with a mixture of experts: its attention (each child
        named ``...attn`` / ``...attention``), its router (``gate`` / ``router`` beside
        ``experts``) and, beside such a router, its shared experts graphed in place; its experts
        and norms eager, and why, and a router that is a lone linear layer with the shared experts
        beside it too. The attention's input is its norm's output, read by nothing else, so its
        graph hands autograd the gradient eager autograd sums. The mixture's input is read by the
        router, the experts and the shared experts: each graphed one reads its own copy, and the
        copies' gradients are added up in eager's order where a watched training call's backward
        shows that they can be (:class:`~paddle_graphpp.paddle.own_input.OwnInput`). ``None`` for
        any other layer."""
        if not isinstance(layer, nn.Layer) or not _own(layer):
            return None
        return _parts(layer)


ADAPTER = PaddleFormersAdapter()
