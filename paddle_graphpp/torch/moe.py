"""A fixed per-expert capacity for mixtures of experts (PyTorch): :func:`capacity_experts`.

Each routed expert takes at most ``ceil(capacity_factor * tokens * top_k / experts)`` token slots
per call. Every call then has fixed shapes and reads nothing on the host, in any dtype, so the
blocks are graphed whole. A slot past an expert's capacity is dropped, and a counter on the device
counts it, also inside graph replays. The counters are read once per optimizer step, before the
step. With ``on_overflow="raise"`` (the default) an overflow raises :class:`CapacityOverflow`
before any parameter changes. With ``"drop"`` the dropped slots are accepted and counted in
:func:`capacity_overflows`. Usage: docs/moe.md.
"""

from __future__ import annotations

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
    :meth:`overflows` and :meth:`undo`."""

    def __init__(self, model: Any, states: list, before: Any, on_overflow: str):
        self.model, self.states, self.before, self.on_overflow = model, states, before, on_overflow

    def __setstate__(self, state: dict) -> None:  # a copy of the model (copy.deepcopy) is watched too
        self.__dict__.update(state)
        _watch().modes.add(self)

    def overflows(self, reset: bool = False) -> dict:
        """``{experts module name: token slots dropped}`` since the last reset (reads the device)."""
        counts = torch.stack([s.dropped for s in self.states]).tolist() if self.states else []
        if reset:
            for s in self.states:
                s.dropped.zero_()
        return {s.name: c for s, c in zip(self.states, counts)}

    def undo(self) -> Any:
        """Give the model its experts implementation back; returns the model."""
        integrations.capacity_restore(self.model, self.before)
        _watch().modes.discard(self)
        self.model.__dict__.pop(_MODE, None)
        self.states = []
        return self.model


def capacity_experts(model: Any, capacity_factor: float = 1.25, *, on_overflow: str = "raise") -> CapacityMode:
    """Make ``model``'s routed experts dispatch at a fixed capacity, before graphing it.

    Each expert of each mixture-of-experts block takes at most
    ``ceil(capacity_factor * tokens * top_k / num_experts)`` (token, expert) pairs per call, in
    token order. Its inputs fill a fixed-size buffer and one batched matmul per projection runs
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

    Raises:
        TypeError: ``model`` holds no experts module the adapters know.
        ValueError: a bad ``capacity_factor`` or ``on_overflow``, or the model is in capacity mode already.

    Warning:
        With ``"raise"``, the counters are read by an eager ``optimizer.step()``. A step graphed by
        ``graph_step`` or ``GraphedOptimizer`` does not run that check in its replays: use
        :func:`capacity_overflows` after each step there.
    """
    if not isinstance(capacity_factor, (int, float)) or capacity_factor <= 0:
        raise ValueError(f"capacity_experts(): capacity_factor must be a number > 0, got {capacity_factor!r}")
    if on_overflow not in ON_OVERFLOW:
        raise ValueError(f"capacity_experts(): on_overflow must be one of {ON_OVERFLOW}, got {on_overflow!r}")
    watch = _watch()
    if _MODE in model.__dict__:
        raise ValueError(f"capacity_experts(): {type(model).__name__} is in capacity mode already; undo() it first")
    done = integrations.capacity_dispatch(model, float(capacity_factor), on_overflow)
    if done is None:
        raise TypeError(f"capacity_experts(): {type(model).__name__} holds no mixture-of-experts experts module that "
                        f"paddle_graphpp knows (transformers' experts modules dispatched by experts_implementation).")
    states, before = done
    mode = CapacityMode(model, states, before, on_overflow)
    model.__dict__[_MODE] = mode  # the model keeps its mode alive; the watch follows it weakly
    watch.modes.add(mode)
    if watch.hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        watch.hook = register_optimizer_step_pre_hook(_before_optimizer_step)
    return mode


def capacity_overflows(model: Any, reset: bool = False) -> dict:
    """``{experts module name: token slots dropped}`` of ``model`` in capacity mode, since the last
    reset (reads the device); ``{}`` when it is not in capacity mode."""
    mode = model.__dict__.get(_MODE)
    return {} if mode is None else mode.overflows(reset)


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    modes = [m for m in list(_watch().modes) if m.on_overflow == "raise" and m.states]
    if not modes:
        return
    dropped = {name: count for mode in modes for name, count in mode.overflows(reset=True).items() if count}
    if dropped:
        shown = ", ".join(f"{name}: {count}" for name, count in list(dropped.items())[:4])
        more = f" and {len(dropped) - 4} more" if len(dropped) > 4 else ""
        raise CapacityOverflow(
            f"{sum(dropped.values())} (token, expert) pairs were dropped at their experts' capacity since the last "
            f"optimizer step ({shown}{more}); this step was not taken, and the counters are reset. Raise "
            f"capacity_factor (num_experts / top_k drops nothing), or pass on_overflow='drop' to capacity_experts() "
            f"to accept dropped tokens.")
