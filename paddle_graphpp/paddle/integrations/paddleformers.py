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
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from paddle import nn

from paddle_graphpp.support import require

from . import Adapter

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


@dataclass(frozen=True, slots=True)
class PaddleFormersAdapter(Adapter):
    """PaddleFormers' version for its models; its in-layer recompute and ``autocudagraph``, refused."""

    def start(self, model) -> None:
        if type(model).__module__.startswith(f"{_PACKAGE}."):
            require(_PACKAGE)

    def refuse(self, model, subject: str, entries) -> None:
        _refuse_config_recompute(model, subject)
        _refuse_autocudagraph(subject, entries)


ADAPTER = PaddleFormersAdapter()
