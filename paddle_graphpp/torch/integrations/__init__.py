"""What the PyTorch front doors know about other libraries: one :class:`Adapter` per library,
consulted through this module only.

* :mod:`.transformers`: Hugging Face decoder blocks (key/value caches, recorded outputs, gradient
  checkpointing), the model's mask functions computed outside the graphs, the whole-step guard
  against masks built inside a capture.
* :mod:`.fsdp`: FSDP2 (``fully_shard``): refused layouts, unsharded storage kept resident, captures
  in the unsharded view.
* :mod:`.megatron`: Megatron-Core's CUDA RNG tracker and its ``DistributedDataParallel``'s
  gradient hooks.

Contract: generic modules import this package, never an adapter module. The adapters are
imported (by name, :data:`ADAPTER_MODULES`) the first time graphing asks for them, and kept in the
process's torch section. They are consulted when graphing starts (building a graphed block, its
first call, each capture, undo), never on a graphed call's path: what a call needs is bound at
build time (:func:`call_checks`, :func:`recomputes`). No adapter imports its library: each reads
it from ``sys.modules``. Private APIs a library forces on us stay in its adapter, with the versions
they were checked on.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, ContextManager, Optional

from ...core.process import current_process
from ...core.segment import Parts

__all__ = ["Adapter", "ExpertsCapacity", "OutsideCalls", "Parts", "RngTracker", "ADAPTER_MODULES", "PREPARED",
           "adapters", "check_block", "check_wrapped", "refuse_in_whole_graph", "aux_loss_capture_problem", "graph_parts", "capacity_dispatch",
           "capacity_restore", "capacity_suspended", "call_checks", "recomputes", "capture_hint", "outside_calls", "prepare",
           "capture_view", "release", "capture_guard", "rng_trackers", "accumulation_hooked", "hooked_buffer"]

#: The adapter modules, each defining ``ADAPTER`` (an :class:`Adapter`), in the order consulted.
ADAPTER_MODULES = ("paddle_graphpp.torch.integrations.transformers", "paddle_graphpp.torch.integrations.fsdp",
                   "paddle_graphpp.torch.integrations.megatron")
#: Key in a graphed module's ``__dict__`` once :func:`prepare` ran (its first graphed call).
PREPARED = "_graphpp_prepared"


@dataclass(frozen=True)
class RngTracker:
    """A library's RNG tracker as a capture sees it.

    Attributes:
        name: the library and tracker, for messages.
        states: ``() -> ({name: generator} of graph-safe states, [names of states that are not])``;
            both empty when the library is not loaded or its tracker not set up.
        fix: what to call so that every state is graph-safe.
    """

    name: str
    states: Callable[[], tuple]
    fix: str


class OutsideCalls:
    """Calls a model's own forward makes that a graph must not capture: run eagerly once
    (:meth:`recording`), their results handed back by value inside the graph (:meth:`replaying`).
    This base computes nothing outside."""

    names: tuple = ()

    def recording(self, into: list) -> ContextManager:
        """Context: the calls run and append ``(name, result)`` to ``into``."""
        return contextlib.nullcontext()

    def replaying(self, recorded: list) -> ContextManager:
        """Context: the calls hand back ``recorded``'s results in order.

        Raises (on entering or inside): ``RuntimeError`` when the forward asks for other calls
        than were recorded."""
        return contextlib.nullcontext()


class ExpertsCapacity:
    """The capacity mode of one experts module (:func:`paddle_graphpp.torch.capacity_experts`):
    each expert takes at most :meth:`slots` token slots per call; :attr:`dropped` counts, on the
    module's device, the slots dropped in calls with grad enabled since it was last read (it is
    added to inside graphs). The counter is a buffer of the module (``buffer``, not saved), so it
    moves with the module."""

    def __init__(self, name: str, factor: float, on_overflow: str, module: Any, buffer: str):
        self.name, self.factor, self.on_overflow = name, factor, on_overflow
        self.module, self.buffer = module, buffer

    @property
    def dropped(self) -> Any:
        return getattr(self.module, self.buffer)

    def slots(self, pairs: int, experts: int) -> int:
        """Slots per expert for ``pairs`` (token, expert) pairs over ``experts`` experts."""
        return max(1, math.ceil(self.factor * pairs / experts))


@dataclass(frozen=True)
class Adapter:
    """One outside library as the front doors see it. Every method has a no-op default; an
    adapter overrides what its library needs. A refusal raises (``TypeError``/``ValueError``)
    naming the block and the fix; nothing else here may raise. An adapter holds no state (a
    frozen dataclass without fields): what it keeps, it keeps on the modules it is handed."""

    name: ClassVar[str] = "adapter"

    # -- build time: graph_layers, CUDAGraphedModule, graph_model, causal_lm_stage
    def check_block(self, name: str, layer: Any, *, check_config: bool) -> None:
        """Refuse a block graphed in place; ``check_config``: also its model's config."""

    def check_wrapped(self, name: str, module: Any) -> None:
        """Refuse a module wrapped in ``CUDAGraphedModule``."""

    def refuse_in_whole_graph(self, name: str, layer: Any, door: str) -> None:
        """Refuse a block inside one graph of a whole model or stage (``door``: the front door)."""

    def aux_loss_capture_problem(self, model: Any) -> Optional[str]:
        """Why the auxiliary loss ``model``'s own forward adds when asked for its router outputs
        (a mixture of experts' load-balancing loss) cannot be captured; ``None``: it can, or the
        model has none of this library's."""
        return None

    def graph_parts(self, name: str, layer: Any, failed: Optional[str] = None) -> Optional[Parts]:
        """For a block a capture cannot hold whole (a mixture of experts' host-reading dispatch):
        the :class:`Parts` to graph around what cannot be captured; ``None``: graph it whole.
        ``failed``: why its whole capture failed, where it was expected to capture (the parts
        are then asked for anyway, with that reason)."""
        return None

    def capacity_dispatch(self, model: Any, factor: float, on_overflow: str) -> Optional[tuple]:
        """Make ``model``'s routed experts dispatch at a fixed capacity: each experts module this
        library owns gets an :class:`ExpertsCapacity` and a sync-free dispatch that uses it.
        Returns ``(its ExpertsCapacity objects, what :meth:`capacity_restore` takes to undo it)``;
        ``None``: no experts module of this library in ``model``."""
        return None

    def capacity_restore(self, model: Any, before: Any) -> bool:
        """Undo :meth:`capacity_dispatch` on ``model`` (``before``: what it returned); whether this
        library's experts were in capacity mode there."""
        return False

    def capacity_suspended(self, model: Any, before: Any) -> Optional[ContextManager]:
        """A context inside which ``model``'s experts in capacity mode dispatch as they did before
        it (``before``: what :meth:`capacity_dispatch` returned), counting nothing; ``None``: no
        experts of this library in capacity mode there."""
        return None

    def call_check(self, name: str, layer: Any) -> Optional[Callable[[tuple, dict], None]]:
        """A check of each training call's ``(args, kwargs)`` for a block this library owns, or
        ``None`` (not its block): bound once, when the block is graphed."""
        return None

    def recomputes(self, layer: Any) -> Optional[Callable[[], bool]]:
        """For a block whose checkpointing this library switches: whether it is on now (read per
        call, as it may be switched after graphing); ``None`` otherwise. Bound once."""
        return None

    def outside_calls(self, owner: str, models: tuple) -> Optional[OutsideCalls]:
        """The calls of ``models``' forward to compute outside a whole-model or stage graph, or
        ``None`` (this library does not define them)."""
        return None

    def capture_hint(self, name: str, layer: Any) -> Optional[Callable[[BaseException], Optional[str]]]:
        """For a block whose capture this library can explain: what to say when a capture of it
        fails (given the error; ``None``: nothing to add), bound once; ``None`` otherwise."""
        return None

    # -- first call, each capture, undo
    def prepare(self, block: Any, name: str) -> None:
        """At a graphed module's first call (the library may wrap it after graphing)."""

    def capture_view(self, block: Any, name: str) -> Optional[ContextManager]:
        """Entered around each capture of ``block`` (what must stay resident), or ``None``."""
        return None

    def release(self, block: Any) -> None:
        """At undo: give back what :meth:`prepare` and the captures kept."""

    # -- whole-step captures and the runtime
    def capture_guard(self, owner: str) -> Optional[ContextManager]:
        """Entered around a whole-step capture (``owner`` names it), or ``None``."""
        return None

    def rng_trackers(self) -> tuple:
        """The library's :class:`RngTracker` objects, registered with every capture."""
        return ()

    def accumulation_hooked(self, param: Any) -> bool:
        """Whether the library hooks ``param``'s gradient accumulation where autograd shows no hook."""
        return False

    def hooked_buffer(self, param: Any) -> Any:
        """The buffer the library's accumulation hook adds ``param``'s gradient into, if it keeps one."""
        return None


class Registered:
    """The adapters of this process, imported the first time they are asked for (a part of the
    process's torch section)."""

    def __init__(self) -> None:
        self.adapters: tuple = tuple(importlib.import_module(m).ADAPTER for m in ADAPTER_MODULES)


def adapters() -> tuple:
    """Every registered :class:`Adapter` (the adapter modules are imported on the first call)."""
    return current_process().section("torch").part(Registered).adapters


def check_block(name: str, layer: Any, *, check_config: bool) -> None:
    """Every adapter's :meth:`Adapter.check_block`."""
    for adapter in adapters():
        adapter.check_block(name, layer, check_config=check_config)


def check_wrapped(name: str, module: Any) -> None:
    """Every adapter's :meth:`Adapter.check_wrapped`."""
    for adapter in adapters():
        adapter.check_wrapped(name, module)


def refuse_in_whole_graph(name: str, layer: Any, door: str) -> None:
    """Every adapter's :meth:`Adapter.refuse_in_whole_graph`."""
    for adapter in adapters():
        adapter.refuse_in_whole_graph(name, layer, door)


def aux_loss_capture_problem(model: Any) -> Optional[str]:
    """The first adapter's :meth:`Adapter.aux_loss_capture_problem` of ``model`` that is not ``None``."""
    for adapter in adapters():
        why = adapter.aux_loss_capture_problem(model)
        if why is not None:
            return why
    return None


def graph_parts(name: str, layer: Any, failed: Optional[str] = None) -> Optional[Parts]:
    """The first adapter's :meth:`Adapter.graph_parts` of ``layer`` that is not ``None``."""
    for adapter in adapters():
        parts = adapter.graph_parts(name, layer, failed)
        if parts is not None:
            return parts
    return None


def capacity_dispatch(model: Any, factor: float, on_overflow: str) -> Optional[tuple]:
    """The first adapter's :meth:`Adapter.capacity_dispatch` of ``model`` that is not ``None``."""
    for adapter in adapters():
        done = adapter.capacity_dispatch(model, factor, on_overflow)
        if done is not None:
            return done
    return None


def capacity_restore(model: Any, before: Any) -> None:
    """Every adapter's :meth:`Adapter.capacity_restore`, until one undid it."""
    for adapter in adapters():
        if adapter.capacity_restore(model, before):
            return


@contextlib.contextmanager
def capacity_suspended(model: Any, before: Any):
    """Inside, ``model``'s experts in capacity mode dispatch as before it (the first adapter that
    has them; see :meth:`Adapter.capacity_suspended`)."""
    for adapter in adapters():
        suspended = adapter.capacity_suspended(model, before)
        if suspended is not None:
            with suspended:
                yield
            return
    yield


def call_checks(name: str, layer: Any) -> tuple:
    """The per-call checks of ``layer`` (possibly none), bound now."""
    return tuple(c for c in (a.call_check(name, layer) for a in adapters()) if c is not None)


def recomputes(layer: Any) -> Optional[Callable[[], bool]]:
    """Whether a library's checkpointing is on for ``layer`` (a predicate bound now), or ``None``
    when no library switches it."""
    found = [p for p in (a.recomputes(layer) for a in adapters()) if p is not None]
    if len(found) <= 1:
        return found[0] if found else None
    return lambda: any(p() for p in found)


def capture_hint(name: str, layer: Any) -> Optional[Callable[[BaseException], Optional[str]]]:
    """What the adapters say when a capture of ``layer`` fails (the first that says something),
    bound now; ``None`` when no adapter explains this block."""
    found = [h for h in (a.capture_hint(name, layer) for a in adapters()) if h is not None]
    if not found:
        return None
    return lambda error: next((text for text in (h(error) for h in found) if text), None)


def outside_calls(owner: str, *models: Any) -> OutsideCalls:
    """The calls of ``models``' forward computed outside graphs: those of the first adapter that
    defines them (the library the models come from), else none."""
    for adapter in adapters():
        calls = adapter.outside_calls(owner, models)
        if calls is not None:
            return calls
    return OutsideCalls()


def prepare(block: Any, name: str) -> None:
    """Every adapter's :meth:`Adapter.prepare`, then ``block`` marked :data:`PREPARED` (callers
    test the mark, so this runs once per block until :func:`release`)."""
    for adapter in adapters():
        adapter.prepare(block, name)
    block.__dict__[PREPARED] = True


@contextlib.contextmanager
def capture_view(block: Any, name: str):
    """Every adapter's :meth:`Adapter.capture_view` of ``block``, entered in order."""
    with contextlib.ExitStack() as stack:
        for adapter in adapters():
            view = adapter.capture_view(block, name)
            if view is not None:
                stack.enter_context(view)
        yield


def release(block: Any) -> None:
    """Every adapter's :meth:`Adapter.release`; ``block`` is prepared again at its next call."""
    for adapter in adapters():
        adapter.release(block)
    block.__dict__.pop(PREPARED, None)


@contextlib.contextmanager
def capture_guard(owner: str):
    """Every adapter's :meth:`Adapter.capture_guard`, around a whole-step capture."""
    with contextlib.ExitStack() as stack:
        for adapter in adapters():
            guard = adapter.capture_guard(owner)
            if guard is not None:
                stack.enter_context(guard)
        yield


def rng_trackers() -> tuple:
    """Every adapter's :class:`RngTracker` objects."""
    return tuple(t for a in adapters() for t in a.rng_trackers())


def accumulation_hooked(param: Any) -> bool:
    """Whether any adapter's library hooks ``param``'s gradient accumulation."""
    return any(a.accumulation_hooked(param) for a in adapters())


def hooked_buffer(param: Any) -> Any:
    """The buffer an adapter's library adds ``param``'s gradient into from its accumulation hook
    (Megatron-Core's ``main_grad``), or ``None``."""
    return next((b for b in (a.hooked_buffer(param) for a in adapters()) if b is not None), None)
