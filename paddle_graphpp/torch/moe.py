"""A fixed per-expert capacity for mixtures of experts (PyTorch): :func:`capacity_experts`.

Each routed expert takes at most ``ceil(capacity_factor * tokens * top_k / experts)`` (token,
expert) pairs per call, choice by choice. Every call then has fixed shapes and reads nothing on
the host, in any dtype, so the blocks are graphed whole. A pair past its expert's capacity is
dropped, and in calls with grad enabled a counter on the device counts it, inside graph replays
too. The counters are read before each eager optimizer step. With ``on_overflow="raise"`` (the
default) an overflow raises :class:`CapacityOverflow` before any parameter changes. With
``"drop"`` the dropped pairs are accepted and counted in :func:`capacity_overflows`. A step that
is captured (``graph_step``, ``GraphedOptimizer``) skips the check. Usage and limits: docs/moe.md.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from ..core.process import current_process
from . import integrations

__all__ = ["capacity_experts", "capacity_overflows", "CapacityOverflow", "CapacityMode"]

ON_OVERFLOW = ("raise", "drop")
_MODE = "_graphpp_capacity_mode"  # on the model: its CapacityMode


class CapacityOverflow(RuntimeError):
    """Tokens were dropped at an expert's capacity under ``on_overflow="raise"``; raised by the
    next optimizer step before it changes any parameter (the counters are reset)."""


class CapacityWatch:
    """The experts in capacity mode in this process, and the optimizer hook that reads their
    counters (a part of the process's torch section)."""

    def __init__(self) -> None:
        self.modes: "weakref.WeakSet[CapacityMode]" = weakref.WeakSet()
        self.hook: Any = None


def _watch() -> CapacityWatch:
    return current_process().section("torch").part(CapacityWatch)


class CapacityMode:
    """What :func:`capacity_experts` returns: the experts modules in capacity mode, with
    :meth:`overflows` and :meth:`undo`. The model keeps it (and its copies keep theirs); it
    holds the model weakly."""

    def __init__(self, model: Any, states: list, before: Any, on_overflow: str):
        self._model = weakref.ref(model)
        self.owner = type(model).__name__
        self.states, self.before, self.on_overflow = states, before, on_overflow

    @property
    def model(self) -> Any:
        return self._model()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_model"] = self.model  # a copy (or an unpickled model) gets its own model's mode
        return state

    def __setstate__(self, state: dict) -> None:
        model = state.pop("_model")
        self.__dict__.update(state)
        self._model = weakref.ref(model) if model is not None else (lambda: None)
        integrations.adapters()  # an unpickled model's experts implementation is registered there
        _watch_mode(self)

    def overflows(self, reset: bool = False) -> dict:
        """``{experts module name: token slots dropped}`` in calls with grad enabled since the last
        reset (reads the device, once per device)."""
        by_device: dict = {}
        for s in self.states:
            by_device.setdefault(s.dropped.device, []).append(s)
        counts = {}
        for states in by_device.values():
            for s, c in zip(states, torch.stack([s.dropped for s in states]).tolist()):
                counts[s.name] = c
        if reset:
            for s in self.states:
                s.dropped.zero_()
        return {s.name: counts[s.name] for s in self.states}

    def undo(self) -> Any:
        """Give the model its experts implementation back; returns the model. A mode the model no
        longer holds (undone already, or replaced by a later ``capacity_experts``) changes nothing."""
        model = self.model
        if model is not None and model.__dict__.get(_MODE) is self:
            integrations.capacity_restore(model, self.before)
            model.__dict__.pop(_MODE, None)
        _watch().modes.discard(self)
        self.states = []
        return model


def _watch_mode(mode: CapacityMode) -> None:
    watch = _watch()
    watch.modes.add(mode)
    if watch.hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        watch.hook = register_optimizer_step_pre_hook(_before_optimizer_step)


def capacity_experts(model: Any, capacity_factor: float = 1.25, *, on_overflow: str = "raise") -> CapacityMode:
    """Make ``model``'s routed experts dispatch at a fixed capacity, before graphing it.

    Each expert of each mixture-of-experts block takes at most
    ``ceil(capacity_factor * tokens * top_k / num_experts)`` (token, expert) pairs per call,
    choice by choice: every token's first choice, in token order, then every second choice. Its inputs fill a fixed-size buffer and one batched matmul per projection runs
    over all experts. The dispatch is then sync-free in any dtype, and ``graph_layers``,
    ``graph_model`` and whole stages graph these blocks whole. A pair past its expert's capacity is
    dropped (its output is zero) and counted on the device.

    Without overflow the model computes what its own experts compute, up to the order of float
    operations inside the matmuls (the batched shapes differ). Under graphs it computes what the
    same capacity mode computes eagerly, bit for bit.

    Args:
        model: a transformers model with mixture-of-experts blocks (any class whose experts module
            dispatches by ``experts_implementation``).
        capacity_factor: slots per expert, as a multiple of an even share of the pairs.
            ``num_experts / top_k`` guarantees that nothing is dropped.
        on_overflow: ``"raise"``: the next optimizer step raises :class:`CapacityOverflow`
            before changing any parameter (its counters are read there: one device read per
            step, outside the graphs); ``"drop"``: dropped pairs are accepted, and
            :func:`capacity_overflows` counts them.

    Returns:
        A :class:`CapacityMode`; its ``undo()`` restores the experts implementation.

    The counters count calls with grad enabled (training; evaluation and ``generate()`` are not
    checked). They are per process: under data parallelism each rank checks its own, so with
    ``"raise"`` one rank may stop while others step (catch it on every rank, or use ``"drop"``
    and reduce the counts yourself). A block recomputed by gradient checkpointing counts its
    drops twice.

    Raises:
        TypeError: ``model`` holds no experts module the adapters know, or an experts module
            holds a config that is not the model's own (a submodule passed, a shared config).
        ValueError: a bad ``capacity_factor`` or ``on_overflow``, or the model is in capacity mode already.

    Warning:
        With ``"raise"``, the counters are read by an eager ``optimizer.step()``. A step graphed by
        ``graph_step`` or ``GraphedOptimizer`` skips that check when it is captured and does not
        run it in its replays: pass ``"drop"`` there and read :func:`capacity_overflows` after
        each step.
    """
    if (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float))
            or not math.isfinite(capacity_factor) or capacity_factor <= 0):
        raise ValueError(f"capacity_experts(): capacity_factor must be a finite number > 0, got {capacity_factor!r}")
    if on_overflow not in ON_OVERFLOW:
        raise ValueError(f"capacity_experts(): on_overflow must be one of {ON_OVERFLOW}, got {on_overflow!r}")
    if _MODE in model.__dict__:
        raise ValueError(f"capacity_experts(): {type(model).__name__} is in capacity mode already; undo() it first")
    done = integrations.capacity_dispatch(model, float(capacity_factor), on_overflow)
    if done is None:
        raise TypeError(f"capacity_experts(): {type(model).__name__} holds no mixture-of-experts experts module that "
                        f"paddle_graphpp knows (transformers' experts modules dispatched by experts_implementation).")
    states, before = done
    mode = CapacityMode(model, states, before, on_overflow)
    model.__dict__[_MODE] = mode  # the model keeps its mode alive; the watch follows it weakly
    _watch_mode(mode)
    return mode


def capacity_overflows(model: Any, reset: bool = False) -> dict:
    """``{experts module name: token slots dropped}`` of ``model`` in capacity mode, since the last
    reset (reads the device); ``{}`` when it is not in capacity mode."""
    mode = model.__dict__.get(_MODE)
    return {} if mode is None else mode.overflows(reset)


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return  # a step being captured (graph_step, GraphedOptimizer): no device read can run there
    modes = [m for m in list(_watch().modes) if m.on_overflow == "raise" and m.states and m.model is not None]
    if not modes:
        return
    dropped = {(mode.owner, name): count for mode in modes for name, count in mode.overflows(reset=True).items()
               if count}
    if dropped:
        shown = ", ".join(f"{owner} {name}: {count}" for (owner, name), count in list(dropped.items())[:4])
        more = f" and {len(dropped) - 4} more" if len(dropped) > 4 else ""
        raise CapacityOverflow(
            f"{sum(dropped.values())} (token, expert) pairs were dropped at their experts' capacity in training calls "
            f"since the last optimizer step ({shown}{more}); this step was not taken, and the counters are reset. "
            f"Raise capacity_factor (num_experts / top_k drops nothing), or pass on_overflow='drop' to "
            f"capacity_experts() to accept dropped tokens.")
