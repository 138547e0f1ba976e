"""A fixed per-expert capacity for mixtures of experts (PyTorch): :func:`capacity_experts`.

Each routed expert takes at most ``ceil(capacity_factor * tokens * top_k / experts)`` (token,
expert) pairs per call, choice by choice. Every call then has fixed shapes and reads nothing on
the host, in any dtype, so the blocks are graphed whole. A pair past its expert's capacity is
dropped, and in calls with grad enabled a counter on the device counts it, inside graph replays
too. The counters are read before each eager optimizer step. With ``on_overflow="raise"`` (the
default) an overflow raises :class:`CapacityOverflow` before any parameter changes. With
``"drop"`` the dropped pairs are accepted and counted in :func:`capacity_overflows`. With
``"rerun"`` a step run through :meth:`CapacityMode.step` is abandoned there and run again eagerly
with the model's own experts. With several ranks, the checks agree across them (a drop on one
rank stops or re-runs the step on all). A captured step cannot read the counters: capturing any optimizer
step while such experts live (``graph_step``, ``GraphedOptimizer``) fails with that reason. Usage and
limits: docs/moe.md.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Optional

import torch

from ..core.process import current_process
from ..core.scope import inline_layers
from ..core.warn import warn
from . import integrations
from .collectives.agreement import StoreTally
from .collectives.watch import group_timeout
from .runtime import active_runtime

__all__ = ["capacity_experts", "capacity_overflows", "CapacityOverflow", "CapacityMode"]

ON_OVERFLOW = ("raise", "drop", "rerun")
_MODE = "_graphpp_capacity_mode"  # on the model: its CapacityMode


class CapacityOverflow(RuntimeError):
    """Tokens were dropped at an expert's capacity under ``on_overflow="raise"``; raised by the
    next optimizer step before it changes any parameter (the counters are reset)."""


class _Rerun(CapacityOverflow):
    """Raised by the optimizer hook inside :meth:`CapacityMode.step` of an ``on_overflow="rerun"``
    mode that dropped pairs: the step is abandoned before the optimizer changes anything, and run
    again."""


class _StepRun:
    """One :meth:`CapacityMode.step` call while its ``fn`` runs: the optimizers whose steps it
    reached, how many passed the check, and the overflow that abandons it (once set, every
    later optimizer step of the call raises it again, so that a caught overflow takes no step)."""

    def __init__(self, mode: "CapacityMode") -> None:
        self.mode = mode
        self.optimizers: list = []
        self.passed = 0
        self.pending: Any = None


class CapacityWatch:
    """The experts in capacity mode in this process, the optimizer hook that reads their
    counters, the :meth:`CapacityMode.step` running now, and the optimizers stepped inside such
    calls (whose gradients a re-run clears) (a part of the process's torch section)."""

    def __init__(self) -> None:
        self.modes: "weakref.WeakSet[CapacityMode]" = weakref.WeakSet()
        self.hook: Any = None
        self.stepping: Any = None  # a _StepRun
        self.optimizers: "weakref.WeakSet" = weakref.WeakSet()
        self.tallies: dict = {}  # ranks -> StoreTally: the checks' agreement across ranks


def _watch() -> CapacityWatch:
    return current_process().section("torch").part(CapacityWatch)


class CapacityMode:
    """What :func:`capacity_experts` returns: the experts modules in capacity mode, with
    :meth:`overflows` and :meth:`undo`. The model keeps it (and its copies keep theirs); it
    holds the model weakly."""

    def __init__(self, model: Any, states: list, before: Any, on_overflow: str, ranks: Optional[tuple] = None):
        self._model = weakref.ref(model)
        self.owner = type(model).__name__
        self.states, self.before, self.on_overflow = states, before, on_overflow
        self.ranks = ranks  # the ranks whose checks agree; None: every rank of the default group
        self.undone = False
        self.reruns = 0  # steps re-run by step() after an overflow
        self.rerun_dropped = 0  # the pairs their first runs dropped

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

    def step(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run one whole training step, ``fn(*args, **kwargs)``: its forwards and backwards, then
        its optimizer step. Under ``on_overflow="rerun"``, a step whose experts dropped a pair is
        abandoned at its optimizer step, before any parameter or optimizer state changes, and run
        again eagerly with the model's own experts (the implementation before the capacity mode)
        and every graphed layer running its plain call: that step computes what eager training
        without the capacity mode computes. Returns what ``fn`` returned (the run that counted).

        The re-run starts from the state the first run started from: the random number generators
        (CPU, and CUDA where it was initialised) are restored, and the gradients of the model's
        parameters and of the optimizers stepped inside ``step()`` calls are cleared. So ``fn``
        must run twice safely: it clears the gradients of everything it trains first
        (``optimizer.zero_grad()``), and takes its batch as an argument rather than drawing it.
        A ``GradScaler.step`` the first run raised through is forgotten, and an overflow ``fn``
        catches is raised again by every later optimizer step of the call, and re-runs the step
        when ``fn`` returns. :attr:`reruns` counts the steps re-run, :attr:`rerun_dropped` the
        pairs their first runs dropped (on every rank); the first re-run warns once. Under other
        ``on_overflow`` values this just calls ``fn``.

        With several ranks (``torch.distributed`` initialised), the ranks of the mode's group agree
        at each optimizer step: a pair dropped on any of them abandons the step on all, and every
        rank runs it again (data parallel replicas stay equal, and their collectives meet). So
        every rank of the group runs each step through its own model's ``step()``.

        Raises:
            RuntimeError: called inside another ``step()``, after :meth:`undo` or its model is
                gone; or after an ``fn`` that took no optimizer step (a re-run of one call of an
                accumulation window would lose the others' gradients).
        """
        watch = _watch()
        if watch.stepping is not None:
            raise RuntimeError(f"CapacityMode.step() of {self.owner} inside another step(); run each step once")
        model = self.model
        if model is None:
            raise RuntimeError(f"CapacityMode.step(): the {self.owner} this capacity mode was made for no longer exists")
        if self.undone:
            raise RuntimeError(f"CapacityMode.step(): {self.owner}'s capacity mode was undone")
        if self.on_overflow != "rerun":
            return fn(*args, **kwargs)
        rng = _rng_state()
        run = watch.stepping = _StepRun(self)
        try:
            result = fn(*args, **kwargs)
        except _Rerun as overflow:
            if overflow is not run.pending:
                raise
        finally:
            watch.stepping = None
        if run.pending is None:
            if not run.passed:
                dropped = sum(self.overflows(reset=True).values())  # nothing left for a later step to find
                raise RuntimeError(
                    f"CapacityMode.step(): the function took no optimizer step. step() runs one whole training step "
                    f"(its forwards, backwards and optimizer step), so that a step that dropped pairs can be run "
                    f"again; with gradient accumulation, run the whole window inside the function. (A GradScaler "
                    f"that skips a step for infinite gradients takes none: use on_overflow='raise' with it.) "
                    f"This call dropped {dropped} pairs; its counters are reset.")
            return result
        _forget_scaled(run.pending, run.optimizers)
        for p in [*model.parameters(), *(p for opt in list(watch.optimizers)
                                         for g in opt.param_groups for p in g["params"])]:
            p.grad = None
        _set_rng_state(rng)
        if not self.reruns:
            warn(f"{self.owner}: a step dropped (token, expert) pairs at the experts' capacity and is re-run eagerly "
                 f"with the model's own experts (on_overflow='rerun'); its graphs gain nothing there. "
                 f"CapacityMode.reruns counts such steps; raise capacity_factor to make them rare.")
        self.reruns += 1
        with integrations.capacity_suspended(model, self.before), inline_layers():
            return fn(*args, **kwargs)

    def undo(self) -> Any:
        """Give the model its experts implementation back; returns the model. A mode the model no
        longer holds (undone already, or replaced by a later ``capacity_experts``) changes nothing."""
        model = self.model
        if model is not None and model.__dict__.get(_MODE) is self:
            integrations.capacity_restore(model, self.before)
            model.__dict__.pop(_MODE, None)
        _watch().modes.discard(self)
        self.states, self.undone = [], True
        return model


def _watch_mode(mode: CapacityMode) -> None:
    watch = _watch()
    watch.modes.add(mode)
    if watch.hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        watch.hook = register_optimizer_step_pre_hook(_before_optimizer_step)


def capacity_experts(model: Any, capacity_factor: float = 1.25, *, on_overflow: str = "raise",
                     group: Any = None) -> CapacityMode:
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
            dispatches by ``experts_implementation``). With ranks that check (``"raise"`` or
            ``"rerun"``, ``torch.distributed`` initialised, a group of two ranks or more) it may
            hold none, as a dense pipeline stage does: its mode drops nothing and joins the group's
            checks, stopping or re-running the steps its peers stop or re-run.
        capacity_factor: slots per expert, as a multiple of an even share of the pairs.
            ``num_experts / top_k`` guarantees that nothing is dropped.
        on_overflow: ``"raise"``: the next optimizer step raises :class:`CapacityOverflow`
            before changing any parameter (its counters are read there: one device read per
            step, outside the graphs); ``"drop"``: dropped pairs are accepted, and
            :func:`capacity_overflows` counts them; ``"rerun"``: a step run through
            :meth:`CapacityMode.step` that dropped pairs is run again eagerly with the model's own
            experts (an optimizer step outside it raises as with ``"raise"``).
        group: with several ranks, the ranks whose checks agree (a ``torch.distributed`` process
            group; ``None``: every rank of the default group). Under ``"raise"`` and ``"rerun"``
            every optimizer step of every rank of the group tells the others what it dropped,
            through the default group's store: a pair dropped on one rank stops (or re-runs) the
            step on all of them; a step is re-run only where every rank can re-run it. Every
            rank of the group must be in capacity mode with the same ``on_overflow`` and take the
            same optimizer steps: a rank that takes no check (all its modes ``"drop"``, undone,
            or a ``GradScaler`` that skipped its step) makes the others raise after the default
            group's timeout.

    Returns:
        A :class:`CapacityMode`; its ``undo()`` restores the experts implementation.

    The counters count calls with grad enabled (training; evaluation and ``generate()`` are not
    checked). They are per process; the checks agree across the ranks of ``group``, and
    :func:`capacity_overflows` reads this rank's own. A block recomputed by gradient checkpointing
    counts its drops twice.

    Raises:
        TypeError: ``model`` holds no experts module the adapters know (and no group of ranks
            checks), or an experts module holds a config that is not the model's own (a submodule
            passed, a shared config).
        ValueError: a bad ``capacity_factor`` or ``on_overflow``, the model is in capacity mode
            already, this rank is not in ``group``, or another checked mode names other ranks.

    Warning:
        With ``"raise"``, the counters are read by an eager ``optimizer.step()``, which a graph
        cannot hold: capturing any optimizer step while they live (``graph_step``, ``GraphedOptimizer``)
        fails, naming this. Pass ``"drop"`` there and read :func:`capacity_overflows` after each
        step.
    """
    if (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float))
            or not math.isfinite(capacity_factor) or capacity_factor <= 0):
        raise ValueError(f"capacity_experts(): capacity_factor must be a finite number > 0, got {capacity_factor!r}")
    if on_overflow not in ON_OVERFLOW:
        raise ValueError(f"capacity_experts(): on_overflow must be one of {ON_OVERFLOW}, got {on_overflow!r}")
    if _MODE in model.__dict__:
        raise ValueError(f"capacity_experts(): {type(model).__name__} is in capacity mode already; undo() it first")
    ranks = None
    if group is not None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ValueError("capacity_experts(): group= names ranks of torch.distributed, which is not initialised; "
                             "call torch.distributed.init_process_group() first")
        ranks = tuple(sorted(torch.distributed.get_process_group_ranks(group)))
        if torch.distributed.get_rank() not in ranks:
            raise ValueError(f"capacity_experts(): this rank ({torch.distributed.get_rank()}) is not in group "
                             f"{list(ranks)}; pass a group this rank belongs to")
        if ranks == tuple(range(_world_size())):
            ranks = None  # every rank: the default
    if on_overflow != "drop":
        other = {mode.ranks for mode in _checked_modes()} - {ranks}
        if other:
            raise ValueError(
                f"capacity_experts(): {type(model).__name__}'s checks would agree over "
                f"{'every rank' if ranks is None else list(ranks)}, and another model's in this process over "
                f"{'every rank' if None in other else list(other.pop())}: the checks at each optimizer step "
                f"agree over one group; pass the same group= to every capacity_experts() call")
    done = integrations.capacity_dispatch(model, float(capacity_factor), on_overflow)
    if done is None:
        if on_overflow == "drop" or _world_size() < 2 or (ranks is not None and len(ranks) < 2):
            raise TypeError(
                f"capacity_experts(): {type(model).__name__} holds no mixture-of-experts experts module that "
                f"paddle_graphpp knows (transformers' experts modules dispatched by experts_implementation). "
                f"(With ranks that check their drops, under 'raise' or 'rerun', a model without experts, such as a "
                f"dense pipeline stage, joins their checks.)")
        done = [], None  # a rank without experts: it drops nothing, and stops or re-runs with its group
    states, before = done
    mode = CapacityMode(model, states, before, on_overflow, ranks)
    model.__dict__[_MODE] = mode  # the model keeps its mode alive; the watch follows it weakly
    _watch_mode(mode)
    return mode


def capacity_overflows(model: Any, reset: bool = False) -> dict:
    """``{experts module name: token slots dropped}`` of ``model`` in capacity mode, since the last
    reset (reads the device); ``{}`` when it is not in capacity mode."""
    mode = model.__dict__.get(_MODE)
    return {} if mode is None else mode.overflows(reset)


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    watch = _watch()
    run = watch.stepping
    if run is not None:
        run.optimizers.append(optimizer)
        watch.optimizers.add(optimizer)
        if run.pending is not None:  # the overflow was caught and the step tried again
            _leave_borrowed_pool()
            raise run.pending
    modes = _checked_modes()
    if not modes:
        return
    if active_runtime().is_capturing():
        refusal = checked_experts()
        if refusal is not None:
            raise RuntimeError(f"{refusal}, and this optimizer step is being captured: {UNCHECKED}")
        return
    dropped = {(mode, name): count for mode in modes for name, count in mode.overflows(reset=True).items() if count}
    culprits = {mode for mode, _ in dropped} or ({run.mode} if run is not None and run.mode in modes else set(modes))
    # this step can be re-run here: it runs in the step() of the one mode whose drops stop it, a 'rerun' one
    rerunnable = run is not None and culprits == {run.mode} and run.mode.on_overflow == "rerun"
    peers = _peers(modes, sum(dropped.values()), rerunnable)
    dropped_by_peers = {rank: n for rank, (n, _) in peers.items() if n}
    if not dropped and not dropped_by_peers:
        if run is not None:
            run.passed += 1
        return
    _leave_borrowed_pool()
    total = sum(dropped.values()) + sum(dropped_by_peers.values())
    if dropped:
        shown = ", ".join(f"{mode.owner} {name}: {count}" for (mode, name), count in list(dropped.items())[:4])
        shown += f" and {len(dropped) - 4} more" if len(dropped) > 4 else ""
        shown += f"; and on rank(s) {sorted(dropped_by_peers)}: {sum(dropped_by_peers.values())}" \
            if dropped_by_peers else ""
    else:
        shown = f"none on this rank; on rank(s) {sorted(dropped_by_peers)}, which this rank's step agrees with"
    what = (f"{total} (token, expert) pairs were dropped at their experts' capacity in training calls since the "
            f"last optimizer step ({shown}); this step was not taken, and the counters are reset.")
    unable = sorted(rank for rank, (_, can) in peers.items() if not can)
    if rerunnable and not unable:
        run.mode.rerun_dropped += total
        run.pending = _Rerun(what)
        raise run.pending
    if rerunnable:  # another rank of the group cannot re-run this step: no rank does
        raise CapacityOverflow(
            f"{what} Rank(s) {unable} of the group cannot re-run this step (on_overflow other than 'rerun' there, "
            f"or an optimizer step outside CapacityMode.step()), so no rank re-runs it: every rank of the group "
            f"must pass the same on_overflow to capacity_experts() and, under 'rerun', run each step through its "
            f"mode's step().")
    if any(mode.on_overflow == "rerun" for mode in culprits) and all(m.on_overflow == "rerun" for m in culprits):
        inside = (f" This step ran inside {run.mode.owner}'s CapacityMode.step(), and each model in 'rerun' mode "
                  f"re-runs only through its own (a copy of a model has its own mode: "
                  f"capacity_experts() it, or train it through its mode's step())." if run is not None else "")
        raise CapacityOverflow(
            f"{what} With on_overflow='rerun' a step is re-run only when it runs through the model's "
            f"CapacityMode.step(fn, ...) (what capacity_experts() returned): run each whole training step "
            f"there.{inside}")
    raise CapacityOverflow(
        f"{what} Raise capacity_factor (num_experts / top_k drops nothing), or pass on_overflow='drop' to "
        f"capacity_experts() to accept dropped tokens, or 'rerun' to re-run such steps eagerly.")


def _world_size() -> int:
    """The default group's ranks; 1 where ``torch.distributed`` is not initialised."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def _peers(modes: list, dropped: int, rerunnable: bool) -> dict:
    """``{rank: (pairs dropped, whether it can re-run this step)}`` of the other ranks of the
    modes' group, told through the process group's store
    (:class:`~paddle_graphpp.torch.collectives.agreement.StoreTally`): every rank of the group
    decides from the same answers, so all take, abandon or re-run the same steps. ``{}`` alone."""
    if _world_size() < 2:
        return {}
    # the modes' group (capacity_experts refuses a second group in one process), or every rank
    ranks = modes[0].ranks or tuple(range(_world_size()))
    if len(ranks) < 2:
        return {}
    watch = _watch()
    tally = watch.tallies.get(ranks)
    if tally is None:
        tally = watch.tallies[ranks] = StoreTally(
            list(ranks), group_timeout(torch.distributed.distributed_c10d._get_default_group()),
            f"the capacity mode's check of dropped pairs at an optimizer step ({modes[0].owner})")
    me = torch.distributed.get_rank()
    return {rank: (told[0], bool(told[1])) for rank, told in tally((dropped, rerunnable)).items() if rank != me}


UNCHECKED = ("its drop counters cannot be read inside a graph, and a replayed step would take dropped tokens "
             "unchecked. Pass on_overflow='drop' to capacity_experts() and read capacity_overflows(model) after "
             "each step, or keep this optimizer step eager.")


def _checked_modes() -> list:
    """The capacity modes whose counters every optimizer step reads (``"raise"``, ``"rerun"``, of
    a model still alive). Every step reads them all: an optimizer that steps none of a model's
    parameters (a head trained over frozen experts) still trains on what the experts computed."""
    return [mode for mode in list(_watch().modes) if mode.on_overflow != "drop" and mode.model is not None
            and not mode.undone]


def checked_experts() -> Optional[str]:
    """Why a captured optimizer step would leave overflows unchecked (experts in capacity mode whose
    counters every step must read: :func:`_checked_modes`); ``None`` if there are none. No device
    read: a capture and ``GraphedOptimizer`` ask it before capturing."""
    for mode in _checked_modes():
        more = f" and {len(mode.states) - 1} more" if len(mode.states) > 1 else ""
        what = f"{mode.states[0].name}{more}" if mode.states else "no experts: it joins its group's checks"
        return f"{mode.owner} is in capacity mode with on_overflow={mode.on_overflow!r} ({what})"
    return None


def _leave_borrowed_pool() -> None:
    """An optimizer step about to raise in its pre-hook: a pool lender's pre-hook that ran first
    may have routed allocations into a graph pool on its stream; leave them before raising."""
    runtime = active_runtime()
    end = getattr(runtime, "end_borrowed_work", None)
    if end is not None:
        end()


def _forget_scaled(overflow: BaseException, optimizers: list) -> None:
    """A ``torch.amp.GradScaler.step`` that the abandoned step raised through has unscaled the
    gradients and noted so for the optimizer; its ``update()`` never ran. Forget that note, so
    that the re-run's ``scaler.step`` unscales its own gradients (the scaler's per-optimizer
    state is private: ``_per_optimizer_states``, torch 2.11 to 2.13)."""
    tb = overflow.__traceback__
    while tb is not None:
        scaler = tb.tb_frame.f_locals.get("self")
        if isinstance(scaler, torch.amp.GradScaler):
            states = getattr(scaler, "_per_optimizer_states", None)
            for opt in optimizers:
                if states is not None:
                    states.pop(id(opt), None)
        tb = tb.tb_next


def _rng_state() -> tuple:
    """The CPU generator's state, and every CUDA device's where CUDA is initialised."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
