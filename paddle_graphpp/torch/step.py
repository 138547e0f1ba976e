"""Whole-step graphs: every micro-batch of a training step, the gradient accumulation and the
optimizer step captured as one CUDA graph and replayed once per step (:func:`graph_step`).

The step is the user's own function; its host cost becomes one copy of the batch into static
buffers and one launch. Each call signature goes through the one lifecycle
(:mod:`paddle_graphpp.core.lifecycle`): ``num_warmup_steps`` eager calls, then a capture into a
pool of its own (nothing runs during it) and one replay per call. Graphed layers inside the step
run their wrapped call directly (:mod:`paddle_graphpp.core.scope`): the step's graph holds their
work. Refused: host reads inside the step (:class:`~paddle_graphpp.CaptureError` naming the line),
schedulers stepped inside it, replaced parameters or optimizer state
(:class:`~paddle_graphpp.StateReplacedError`), changed hyperparameters other than the lr.
docs/scopes.md shows a training loop with it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import linecache
import os
import traceback
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..core.errors import CaptureError, StateReplacedError
from ..core.lifecycle import Lifecycle, signature_key
from ..core.options import EngineOptions, engine_options
from ..core.records import CallShape, Phase, Signature
from ..core.scope import inline_layers
from ..core.state import StateWatch
from ..core.tree import flatten, unflatten
from . import integrations
from .optim import frozen_hyperparameters, make_capturable, optimizer_state_slots
from .runtime import active_runtime

__all__ = ["graph_step", "GraphedStep"]

logger = logging.getLogger("paddle_graphpp")

_CAPTURABLE_AS_IS = (torch.optim.SGD,)  # no host reads in its step, and no capturable flag to set
_REFUSED = MappingProxyType({  # engine options that have no meaning for one graph of a whole step
    "memory": "each signature of a step is captured into a pool of its own",
    "max_in_flight": "a step holds no micro-batches in flight between calls",
    "accumulate_grads": "the step's own backward accumulates into .grad inside its graph",
    "generators": "the step's capture registers the default CUDA generator only",
})
# Frames a failure is not reported in: torch's, this package's, and the context managers between.
_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep,
                 os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
                 os.path.abspath(contextlib.__file__), os.path.abspath(functools.__file__))


@dataclass(slots=True)
class _Captured:
    """One signature's graph and the tensors it reads and writes."""

    graph: Any
    static_inputs: list
    outputs_spec: Any
    outputs: list  # the output leaves; tensors are the graph's buffers
    grads_in: list  # each parameter's .grad when the capture began (a step that accumulates reads it)
    grads: list  # each parameter's .grad after the capture (the graph writes these tensors)
    watch: StateWatch
    hyper: list  # the optimizers' hyperparameters other than lr at the capture


class GraphedStep:
    """A training-step function whose calls, after warmup, replay one CUDA graph.

    Made by :func:`graph_step`; see it for the arguments and the contract. Its signatures go
    through the lifecycle every graphed scope goes through (:class:`~paddle_graphpp.core.lifecycle.Lifecycle`,
    ``lifecycle``), each captured in the call after its warmup. Attributes: ``captures`` and
    ``replays`` count graphs captured and launched; ``eager_reason(*args, **kwargs)`` says why a
    signature runs eagerly (``None`` when it does not).
    """

    def __init__(self, fn: Callable, optimizers: Sequence[torch.optim.Optimizer], *, options: EngineOptions,
                 clone_outputs: bool, name: str):
        self.fn = fn
        self.name = name
        self.optimizers = list(optimizers)
        self.num_warmup_steps = options.num_warmup_steps
        self.clone_outputs = clone_outputs
        self.runtime = active_runtime()
        self.params = _unique(p for opt in self.optimizers for g in opt.param_groups for p in g["params"])
        self.lifecycle = Lifecycle(name, max_signatures=options.max_signatures,
                                   num_warmup_steps=options.num_warmup_steps, fallback=options.fallback,
                                   noun="the step", retry=False)
        self._unavailable = self.runtime.graphs_unavailable_reason(self.params)
        self._lrs: list = []  # per optimizer, per param group: the lr tensor the graphs read
        if self._unavailable is None:
            self._lrs = [make_capturable(opt) for opt in self.optimizers]

    @property
    def captures(self) -> int:
        return self.lifecycle.captures

    @property
    def replays(self) -> int:
        return self.lifecycle.replays

    # ------------------------------------------------------------------ calls
    def __call__(self, *args, **kwargs) -> Any:
        leaves, spec = flatten((args, kwargs))
        key, tensor_index, specs = self._key(leaves, spec)
        tensors = [leaves[i] for i in tensor_index]
        life = self.lifecycle
        reason = self._unavailable or self.runtime.graphs_unavailable_reason(tensors)
        if reason is not None:
            life.warn_once("unavailable", f"{self.name}: CUDA graphs are not used ({reason}); the step runs eagerly.")
            return self.fn(*args, **kwargs)
        if self.runtime.is_capturing():
            return self.fn(*args, **kwargs)  # an enclosing capture takes the step's work
        sig = life.get(key)
        reason = self._eager_reason(key, sig, leaves)
        if reason is not None:
            if life.eager_reason is None:  # a fallback to eager has warned already
                life.warn_once(reason, f"{self.name}: {reason}; the step runs eagerly.")
            return self.fn(*args, **kwargs)
        if sig is None:
            slots = set(tensor_index)
            sig = life.add(key, CallShape(tuple(None if i in slots else x for i, x in enumerate(leaves)), spec,
                                          tuple(tensor_index), specs))
            if sig is None:  # past max_signatures: warned
                return self.fn(*args, **kwargs)
        if sig.graph is not None:
            return self._replay(sig, tensors)
        if not life.warmed(sig):
            sig.warm += 1
            with inline_layers():
                return self.fn(*args, **kwargs)
        life.leave_warmup(sig, in_step=True)
        return self._capture_and_replay(sig, leaves, spec, tensors)

    def eager_reason(self, *args, **kwargs) -> Optional[str]:
        """Why a call with these arguments runs eagerly, or ``None`` when it is (or will be) graphed."""
        if self._unavailable is not None:
            return self._unavailable
        leaves, spec = flatten((args, kwargs))
        key = self._key(leaves, spec)[0]
        sig = self.lifecycle.get(key)
        reason = self._eager_reason(key, sig, leaves)
        if reason is None and sig is None and self.lifecycle.full():
            reason = f"a new call signature past max_signatures={self.lifecycle.max_signatures}"
        return reason

    def _eager_reason(self, key: Any, sig: Optional[Signature], leaves: list) -> Optional[str]:
        if self.lifecycle.eager_reason is not None:
            return self.lifecycle.eager_reason
        if sig is not None:
            return sig.eager_reason
        return _unsupported_leaf(leaves)  # checked until the signature is taken: it then has none

    # ---------------------------------------------------------------- replay
    def _replay(self, sig: Signature, tensors: list) -> Any:
        done = sig.graph
        self._sync_lrs()
        self._check(done)
        if tensors:
            torch._foreach_copy_(done.static_inputs, tensors)
        self._grads_in_place(done)
        self.runtime.replay_graph(done.graph)
        self.lifecycle.replays += 1
        for p, g in zip(self.params, done.grads):
            if p.grad is not g:  # what the step left in .grad at its capture: the graph writes these
                p.grad = g
        return self._hand_out(done)

    def _sync_lrs(self) -> None:
        """An lr assigned to a param group (``group["lr"] = 3e-4``, a hand-written schedule) goes
        into the tensor the graphs read; that tensor goes back into the group."""
        for opt, lrs in zip(self.optimizers, self._lrs):
            for group, lr in zip(opt.param_groups, lrs):
                value = group["lr"]
                if value is not lr:
                    lr.copy_(value) if isinstance(value, torch.Tensor) else lr.fill_(float(value))
                    group["lr"] = lr

    def _grads_in_place(self, done: _Captured) -> None:
        """A step that accumulates into the gradients it found (no zeroing to None inside it) reads
        them: one set to None outside the step becomes zeros, one replaced becomes its values."""
        for p, before, after in zip(self.params, done.grads_in, done.grads):
            if before is None or after is not before or p.grad is before:
                continue
            if p.grad is None:
                before.zero_()
            else:
                before.copy_(p.grad)

    def _check(self, done: _Captured) -> None:
        what = done.watch.changed()
        if what is not None:
            raise StateReplacedError(
                f"{self.name}: {what} since the step was captured; replaying it would train the old memory, so "
                f"the step is refused. Change parameters and optimizer state in place (copy_, load_state_dict "
                f"of the module), or build a new graph_step after replacing them.")
        hyper = _hyperparameters(self.optimizers)
        if hyper != done.hyper:
            raise CaptureError(
                f"{self.name}: an optimizer hyperparameter other than lr changed since the step was captured "
                f"({_first_change(done.hyper, hyper)}); the graph holds the old value. Keep them fixed, or build a "
                f"new graph_step after changing them.")

    def _hand_out(self, done: _Captured) -> Any:
        leaves = [x.clone() if self.clone_outputs and isinstance(x, torch.Tensor) else x for x in done.outputs]
        return unflatten(done.outputs_spec, leaves)

    # ---------------------------------------------------------------- capture
    def _capture_and_replay(self, sig: Signature, leaves: list, spec: Any, tensors: list) -> Any:
        rt = self.runtime
        if not tensors:
            self.lifecycle.warn_once("no inputs", f"{self.name}: the step takes no tensors; its graph replays the same "
                                         f"device work every call (a batch read inside the step is read once).")
        self._sync_lrs()
        static = [t.detach().clone() for t in tensors]
        it = iter(static)
        args, kwargs = unflatten(spec, [next(it) if isinstance(x, torch.Tensor) else x for x in leaves])
        grads_before = [p.grad for p in self.params]
        # Autograd graphs of the warmup steps that only a reference cycle still holds keep their
        # gradient-accumulation nodes, made on the warmup's stream; collected, the capture makes
        # its own on the capture stream.
        gc.collect()
        torch.cuda.synchronize()  # the warmup's work is done before its cache is released
        rt.release_cached_memory()
        graph = rt.create_graph()
        failure, what = None, ""
        try:
            with inline_layers(), _schedulers_refused(self.name), integrations.capture_guard(self.name), \
                    rt.capture_to_graph(graph):
                result = self.fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - every failure is reported, its memory released
            for p, g in zip(self.params, grads_before):
                p.grad = g
            if not isinstance(exc, Exception):
                raise  # an interrupt: the gradients are back, nothing else to undo
            failure, what = exc, _what_failed(exc)  # read the frames before they are cleared
            traceback.clear_frames(exc.__traceback__)  # the failed capture's frames hold its graph
        if failure is not None:
            graph = static = args = kwargs = None
            gc.collect()
            rt.release_cached_memory()  # before the eager run: the failed graph's pool is gone
            return self._capture_failed(sig, failure, what, leaves, spec)
        out_leaves, out_spec = flatten(result)
        watch = StateWatch(rt, _state_slots(self.params, self.optimizers))
        sig.graph = _Captured(graph, static, out_spec, out_leaves, grads_before, [p.grad for p in self.params],
                              watch, _hyperparameters(self.optimizers))
        self.lifecycle.captures += 1
        logger.info("%s: captured the step (%d input tensors, %d parameters)", self.name, len(static),
                    len(self.params))
        return self._replay(sig, tensors)

    def _capture_failed(self, sig: Signature, exc: Exception, what: str, leaves: list, spec: Any) -> Any:
        error = self.lifecycle.capture_failed(
            sig.key, "the step", exc, cause_text=what, hint=(
                "A whole-step graph must not synchronise with the host: no .item(), .cpu(), print(tensor) or "
                "Python branch on a tensor value inside the step (return the values and read them after the "
                "call), no optimizer without a capturable mode (pass every optimizer the step uses to "
                "graph_step(optimizers=...)). Nothing of the step ran."))
        if error is not None:
            raise error from exc
        args, kwargs = unflatten(spec, leaves)
        return self.fn(*args, **kwargs)

    # ----------------------------------------------------------- signatures
    def _key(self, leaves: list, spec: Any) -> tuple:
        autocast = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda")
        trainable = tuple(p.requires_grad for p in self.params)  # frozen or unfrozen parameters: captured anew
        return signature_key(self.runtime, leaves, spec, context=(autocast, torch.is_grad_enabled(), trainable))

    def undo(self) -> Callable:
        """Release the step's graphs, give the optimizers back their ``capturable`` mode, ``lr`` and
        step counts as :func:`graph_step` found them, and return ``fn``; this object refuses
        calls afterwards (call ``fn``, or graph it again).

        Raises:
            RuntimeError: undone already, or called inside a capture.
        """
        from .optim import undo_capturable

        if getattr(self.fn, "_graphpp_undone", False):
            raise RuntimeError(f"{self.name}: undo() was called twice; call the function the first undo() returned")
        if self.runtime.is_capturing():
            raise RuntimeError(f"{self.name}: undo() inside a capture; undo between steps")
        fn = self.fn
        self.lifecycle.reset()  # every signature's graph released
        for opt in self.optimizers if self._lrs else ():
            undo_capturable(opt)
        self._lrs = []

        def undone(*args, **kwargs):
            raise RuntimeError(f"{self.name} was undone and its graphs released; call the function undo() returned, "
                               f"or graph_step() it again")

        undone._graphpp_undone = True
        self.fn = undone  # every path of __call__ ends in fn: a call after undo raises
        return fn


def graph_step(fn: Callable, *warmup: int,
               optimizers: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
               clone_outputs: bool = True, name: Optional[str] = None, options: Optional[EngineOptions] = None,
               **engine_kwargs: Any) -> GraphedStep:
    """Graph a whole training step: all its micro-batches, the accumulation and the optimizer step.

    Args:
        fn: the step. It takes the step's data (tensors, also in lists, tuples and dicts, and
            other values) and returns what the loop needs (a loss, a norm): tensors and plain
            values. Its device work must depend only on its tensor arguments and on tensors
            that stay where they are (parameters, buffers, optimizer state, gradients).
        optimizers: every optimizer the step steps (one or a sequence). Each is switched to its
            capturable mode, and a float ``lr`` becomes a 0-d device tensor that
            ``torch.optim.lr_scheduler`` schedules fill in place; this happens here, so the
            warmup steps run the same arithmetic as the replays.
        clone_outputs: return copies of the graph's output tensors (default). ``False``
            returns the buffers themselves, which the next call overwrites.
        name: how messages name the step (default: the function's qualified name).
        options, **engine_kwargs: of the engine options (:class:`paddle_graphpp.EngineOptions`,
            or its fields by keyword), a step takes three: ``num_warmup_steps`` (eager calls of
            each signature before its capture, at least 1: lazily created state such as
            optimizer moments and gradients must exist first; also positionally after ``fn``),
            ``fallback`` (``"error"`` raises :class:`~paddle_graphpp.CaptureError` when the
            capture fails, ``"eager"`` logs it and runs the step eagerly; either way the
            signature then runs eagerly) and ``max_signatures`` (signatures captured at most,
            each with a pool of its own; calls of another run eagerly, with one warning).

    Returns:
        A :class:`GraphedStep`: call it as you would call ``fn``.

    Raises:
        TypeError: ``fn`` is not callable, an optimizer is not a ``torch.optim.Optimizer``
            with a capturable mode, or an engine option a step does not take.
        ValueError: a bad ``num_warmup_steps``, ``fallback`` or ``max_signatures``.
        CaptureError: (from a call) the capture failed, with the module that was running and
            the line that synchronised; an optimizer hyperparameter other than ``lr`` changed
            after the capture.
        StateReplacedError: (from a call) a parameter or optimizer state tensor was replaced
            after the capture.

    Warnings:
        * Python side effects of ``fn`` (appending to a list, counters, logging, a scheduler
          step) happen in the warmup calls and at the capture, never in a replay. Step LR
          schedules outside the step; one stepped inside the capture is refused.
        * A capture runs nothing: the call that captures replays the graph for its results.
        * Gradients: the graph writes the ``.grad`` tensors it saw at its capture; a replay
          puts them back on the parameters if code outside the step replaced them.
        * Each call copies its tensors into the static buffers (one launch); a data loader that
          yields new shapes or dtypes makes new signatures, each captured anew.
        * ``torch.cuda.amp.GradScaler`` reads a device value on the host and cannot be
          captured; bf16 autocast needs no scaler.
        * Without CUDA, every call runs ``fn`` eagerly.
    """
    if not callable(fn):
        raise TypeError(f"graph_step() takes the step function first, got {type(fn).__name__}")
    label = name or f"graph_step({getattr(fn, '__qualname__', None) or type(fn).__name__})"
    opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    for opt in opts:
        opt = getattr(opt, "optimizer", opt) if not isinstance(opt, torch.optim.Optimizer) else opt
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"{label}: optimizers must be torch.optim.Optimizer objects, got {type(opt).__name__}")
        if "capturable" not in opt.defaults and not isinstance(opt, _CAPTURABLE_AS_IS):
            raise TypeError(f"{label}: torch.optim.{type(opt).__name__} has no capturable mode, so its step may read "
                            f"device values on the host; use one with a capturable mode (Adam, AdamW, ...) or SGD, "
                            f"or step it outside the graphed step.")
    opts = [getattr(o, "optimizer", o) for o in opts]
    chosen = engine_options(f"{label}", graph_step, warmup, engine_kwargs, options=options, refused=_REFUSED)
    chosen.validate(label)
    if chosen.num_warmup_steps < 1:  # lazily made state (moments, gradients) must exist before a capture
        raise ValueError(f"{label}: num_warmup_steps must be an int >= 1, got {chosen.num_warmup_steps!r}")
    return GraphedStep(fn, opts, options=chosen, clone_outputs=bool(clone_outputs), name=label)


# ------------------------------------------------------------------ helpers
def _unique(items) -> list:
    seen, out = set(), []
    for x in items:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


def _state_slots(params: list, optimizers: list) -> list:
    held = dict(enumerate(params))
    slots = [(held, i, f"parameter {i} of the step's optimizers") for i in held]
    for opt in optimizers:
        slots += optimizer_state_slots(opt, [p for g in opt.param_groups for p in g["params"]])
    return slots


def _unsupported_leaf(leaves: list) -> Optional[str]:
    """Why an argument cannot be graphed: an object other than a tensor or a plain value may hold
    tensors the step reads (a ``BatchEncoding``, a dataclass), which would not be copied into the
    graph's buffers; ``None`` when every leaf is fine."""
    for i, x in enumerate(leaves):
        if not (isinstance(x, torch.Tensor) or x is None or isinstance(x, (bool, int, float, str, bytes))):
            return (f"argument leaf {i} is a {type(x).__name__}: a whole step copies the tensors it finds in "
                    f"tuples, lists and dicts into its graph's buffers, and reads nothing else; pass the tensors "
                    f"(for a mapping, dict(batch))")
    return None


def _hyperparameters(optimizers: list) -> list:
    return [frozen_hyperparameters(opt) for opt in optimizers]


def _first_change(old: list, new: list) -> str:
    for i, (a, b) in enumerate(zip(old, new)):
        for j, (ga, gb) in enumerate(zip(a, b)):
            for k in sorted(set(ga) | set(gb)):
                if ga.get(k) != gb.get(k):
                    return f"optimizer {i}, param group {j}: {k} {ga.get(k)!r} -> {gb.get(k)!r}"
    return "the param groups changed"


@contextlib.contextmanager
def _schedulers_refused(name: str):
    """An LR schedule stepped inside the capture would fill its value once, at capture: refuse it."""
    from torch.optim import lr_scheduler

    def refuse(what: str):
        raise RuntimeError(f"{what} was called inside the graphed step; its new lr would be frozen into the "
                           f"graph. Step the schedule after {name}(...) returns")

    original = lr_scheduler.LRScheduler.step
    # Schedules that override step() (warm restarts, on plateau) still write through this helper.
    helper = getattr(lr_scheduler, "_update_param_group_val", None)
    lr_scheduler.LRScheduler.step = lambda self, *args, **kwargs: refuse(f"{type(self).__name__}.step()")
    if helper is not None:
        lr_scheduler._update_param_group_val = lambda *args, **kwargs: refuse("an LR schedule's update")
    try:
        yield
    finally:
        lr_scheduler.LRScheduler.step = original
        if helper is not None:
            lr_scheduler._update_param_group_val = helper


def _what_failed(exc: BaseException) -> str:
    """The error, the innermost module whose code was running, and the line outside torch and this
    library where it was raised (the host read, as a rule)."""
    module, where, tb = None, "", exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module):
            module = type(owner).__name__
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not path.startswith(_LIBRARY_DIRS):
            line = (linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno) or "").strip()
            where = f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}: {line}"
        tb = tb.tb_next
    inside = f" in {module}" if module else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    hint = ""
    if "legacy stream" in first:
        hint = ("; a tensor kept from a warmup step with its autograd graph (a loss not .detach()ed) makes "
                "the capture's backward accumulate gradients on the default stream: keep detached values")
    return f"{type(exc).__name__}: {first}{inside}{where}{hint}"
