"""Capture a short kernel sequence once, replay it on later calls.

:func:`graph_process` is for code that launches many tiny kernels over tensors that stay at
the same addresses from call to call: optimizer steps, gradient norms and clipping, gradient
zeroing. The first call warms the function up, captures it into a CUDA graph and keeps the
graph; later calls replay it.

Compared with DeepSpeed's ``graph_process`` (which this mirrors), graphs are keyed by the
function's identity or an explicit ``key`` — never by ``__name__``, so two closures called
``step`` do not share a graph — and every call checks the arguments' tensor addresses,
shapes and dtypes: a call whose tensors moved is re-captured, never replayed into the old
graph.

Each cache slot keys its calls with :func:`~paddle_graphpp.core.lifecycle.signature_key` (by
address) and keeps its one signature in a :class:`~paddle_graphpp.core.lifecycle.Lifecycle`, the
lifecycle graphed layers and whole steps go through: the warmup and the capture are the first
call, and a failed capture is reported as theirs is.

The accelerator-style trio :func:`create_graph`, :func:`capture_to_graph` and
:func:`replay_graph` is exposed for code that manages its own graphs.

The framework is found from the tensor arguments (``torch.Tensor`` or ``paddle.Tensor``)
through :func:`paddle_graphpp.core.runtime.framework_of`; this module imports neither.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Hashable, Optional

from .core.errors import CaptureError
from .core.lifecycle import Lifecycle, signature_key
from .core.process import current_process
from .core.runtime import (FRAMEWORKS, GraphRuntime, framework_imported, framework_of, get_runtime,
                           sole_imported_framework)
from .core.tree import flatten

__all__ = ["graph_process", "create_graph", "capture_to_graph", "replay_graph", "clear_graph_cache",
           "forget_graph"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Entry:
    """One cache slot: its function's lifecycle (one signature at a time, captured in the call
    that first runs it: the warmup and the capture are one call), and what its graph hands back."""

    lifecycle: Lifecycle
    owner: Any  # weakref (or strong ref) to the function/bound instance the slot belongs to
    runtime: Optional[GraphRuntime]
    eager: bool = False  # graphs are unavailable for these tensors: the function runs eagerly
    output: Any = None

    @property
    def signature(self) -> Any:
        sigs = self.lifecycle.all()
        return sigs[0].key if sigs else None

    @property
    def graph(self) -> Any:
        """The slot's graph (``None`` while there is none)."""
        sigs = self.lifecycle.all()
        return sigs[0].graph if sigs else None


class GraphCache(dict):
    """slot -> :class:`_Entry`: the graphs :func:`graph_process` holds (a part of the process)."""

    def forget(self, slot: Hashable) -> bool:
        """Drop the graph held in ``slot``; returns whether one was held."""
        return self.pop(slot, None) is not None


def _cache() -> GraphCache:
    return current_process().part(GraphCache)


def graph_process(func: Callable, *args, replay_first_step: bool = False, key: Optional[Hashable] = None,
                  **kwargs) -> Any:
    """Run ``func(*args, **kwargs)`` through a cached CUDA graph.

    First call for a cache slot: ``func`` runs once eagerly as warmup (on the current stream),
    is captured into a new graph, and then either the graph is replayed
    (``replay_first_step=True``) or the warmup's results are kept (``False``: tensor outputs
    of the warmup are copied into the graph's output tensors, and ``func``'s device work has
    run exactly once). Later calls replay the graph and return the same output objects.

    Args:
        func: the function to capture. Its device work must depend only on tensors whose
            addresses stay fixed between calls, and on Python values that do not change.
        *args, **kwargs: passed to ``func``. Tensors (also inside lists, tuples and dicts)
            decide the framework and form the cache signature together with the other
            leaves (Python scalars by value, other objects by identity).
        replay_first_step: on the first call, replay the fresh graph (``func``'s device work
            then runs twice: warmup and replay) instead of keeping the warmup's results.
            Use ``True`` only for functions that are safe to run twice, such as pure
            functions of their inputs.
        key: cache slot. Default: the function's identity (a bound method: its instance and
            function). Calls with the same key and a different function re-capture.

    Returns:
        ``func``'s return value from the capture. Its tensors are the graph's static output
        buffers: the next replay overwrites them; clone what must outlive the next call.

    Raises:
        CaptureError: ``func`` could not be captured; the usual cause is a host
            synchronisation inside it (``.item()``, ``.cpu()``, printing a tensor, a Python
            ``if`` on a tensor value). Nothing is cached, so the next call tries again.

    Warnings:
        * Without CUDA (a CPU build, CPU tensors, no GPU) ``func`` simply runs, every call.
        * Python side effects of ``func`` (counters, appends) happen at warmup and capture
          only, never on replay. Values read on the host at capture are frozen into the graph.
        * A signature change (new address, shape, dtype, or scalar value) re-captures and
          logs a warning; a function whose arguments change every call gains nothing.
        * Inside an ongoing capture, ``func`` runs directly and becomes part of that capture.
    """
    leaves, spec = flatten((args, kwargs))
    runtime = _runtime_of_leaves(leaves)
    if runtime is None or runtime.is_capturing():
        return func(*args, **kwargs)
    slot = ("key", key) if key is not None else _identity_slot(func)
    signature, tensor_index, _ = signature_key(runtime, leaves, spec, context=(id(getattr(func, "__func__", func)),),
                                               by_address=True)
    entry = _cache().get(slot)
    if entry is not None:
        same_owner = _owner_is(entry, func)
        if same_owner and entry.signature == signature:
            if entry.eager:
                return func(*args, **kwargs)
            runtime.replay_graph(entry.graph)
            entry.lifecycle.replays += 1
            return entry.output
        change = (_describe_change(entry.signature, signature) if same_owner
                  else "the slot holds the graph of another function")
        logger.warning("graph_process(%s): %s; re-capturing", _name(func), change)
        _cache().pop(slot, None)
        entry = None  # drop the old graph (and its pool) before capturing the new one
    tensors = [leaves[i] for i in tensor_index]
    life = Lifecycle(f"graph_process({_name(func)})", max_signatures=1, num_warmup_steps=1, fallback="error",
                     noun="the function")
    sig = life.add(signature, None)
    reason = runtime.graphs_unavailable_reason(tensors) if tensors else _no_tensor_reason(runtime)
    if reason is not None:
        _store(slot, func, key, _Entry(life, None, runtime, eager=True))
        return func(*args, **kwargs)
    life.leave_warmup(sig, in_step=True)  # the warmup and the capture are this one call
    sig.graph, output = _warmup_and_capture(runtime, life, signature, func, args, kwargs, replay_first_step)
    life.captures += 1
    life.replays += replay_first_step
    _store(slot, func, key, _Entry(life, None, runtime, output=output))
    return output


def clear_graph_cache() -> None:
    """Forget every graph :func:`graph_process` holds (their memory goes with them)."""
    _cache().clear()


def forget_graph(func: Callable, *, key: Optional[Hashable] = None) -> bool:
    """Forget the graph :func:`graph_process` holds for ``func`` (the slot it called
    ``graph_process(func, ...)`` with: ``key``, or by default the function's identity); its memory
    goes with it and the next call captures anew. Returns whether a graph was held."""
    if key is not None:
        return _cache().forget(("key", key))
    slot = _identity_slot(func)
    entry = _cache().get(slot)
    return entry is not None and _owner_is(entry, func) and _cache().forget(slot)


# ------------------------------------------------------------------ the trio
def create_graph(*, framework: Optional[str] = None) -> Any:
    """A new, empty graph of the framework in use.

    Args:
        framework: ``"torch"`` or ``"paddle"``. Needed only when both frameworks are imported.

    Raises:
        RuntimeError: no framework is imported, or both are and ``framework`` is not given.
    """
    return _runtime_named(framework).create_graph()


def capture_to_graph(graph: Any, pool: Any = None, stream: Any = None, *,
                     framework: Optional[str] = None) -> ContextManager:
    """Context manager: the device work issued inside it is captured into ``graph``.

    Args:
        graph: from :func:`create_graph`.
        pool: a memory-pool handle shared with other graphs, or ``None`` for a private pool.
            Graphs that share a pool must be replayed in the order they were captured.
        stream: capture stream; ``None`` uses the runtime's capture stream.
        framework: as in :func:`create_graph`; by default the graph's own framework.

    Work inside the context is recorded, not executed: replay the graph to run it.
    """
    return _runtime_of_graph(graph, framework).capture_to_graph(graph, pool=pool, stream=stream)


def replay_graph(graph: Any, *, framework: Optional[str] = None) -> None:
    """Launch a captured ``graph`` on the current stream."""
    _runtime_of_graph(graph, framework).replay_graph(graph)


# --------------------------------------------------------------- capturing
def _warmup_and_capture(runtime: GraphRuntime, life: Lifecycle, signature: Any, func, args, kwargs,
                        replay_first_step: bool):
    # Warmup: lazy state (optimizer moments, library handles) is created outside the graph.
    warm = func(*args, **kwargs)
    graph = runtime.create_graph()
    try:
        with runtime.capture_to_graph(graph):  # ends a failed capture itself
            output = func(*args, **kwargs)
    except Exception as exc:
        raise life.capture_failed(signature, "the function", exc, hint=(
            "A captured function must not synchronise with the host: no .item()/.cpu()/.numpy(), no "
            "printing of tensors, no Python branch on a tensor value, no new shapes. Remove the sync, or "
            "call the function directly instead of through graph_process.")) from exc
    # Keep the results of one run: replay the graph, or carry the warmup's over.
    if replay_first_step:
        runtime.replay_graph(graph)
    else:
        _copy_outputs(runtime, warm, output)
    return graph, output


def _copy_outputs(runtime: GraphRuntime, warm, static) -> None:
    dsts, srcs = [], []
    for src, dst in zip(flatten(warm)[0], flatten(static)[0]):
        if runtime.is_tensor(dst) and runtime.is_tensor(src) and dst is not src:
            dsts.append(dst)
            srcs.append(src)
    if dsts:
        runtime.copy_many(dsts, srcs)


# ---------------------------------------------------------------- the cache
def _identity_slot(func) -> tuple:
    owner = getattr(func, "__self__", None)
    target = getattr(func, "__func__", None)
    if owner is not None and target is not None:  # bound method: a new object on each access
        return ("method", id(owner), id(target))
    return ("function", id(func))


def _anchor(func):
    owner = getattr(func, "__self__", None)
    return owner if owner is not None and getattr(func, "__func__", None) is not None else func


def _store(slot, func, key, entry: _Entry) -> None:
    anchor = _anchor(func)
    try:
        entry.owner = weakref.ref(anchor)
        if key is None:  # the slot is the anchor's id: forget the graph when the anchor dies
            weakref.finalize(anchor, _evict, slot, entry)
    except TypeError:  # not weak-referenceable: hold it, so its id cannot be reused
        entry.owner = anchor
    _cache()[slot] = entry


def _evict(slot, entry) -> None:
    cache = _cache()
    if cache.get(slot) is entry:
        del cache[slot]


def _owner_is(entry: _Entry, func) -> bool:
    owner = entry.owner() if isinstance(entry.owner, weakref.ref) else entry.owner
    return owner is _anchor(func)


def _describe_change(old: tuple, new: tuple) -> str:
    """What differs between two keys of :func:`~paddle_graphpp.core.lifecycle.signature_key`
    ``(tensors by address, other leaves, structure, function)``."""
    (old_tensors, old_values, old_spec, old_fn), (new_tensors, new_values, new_spec, new_fn) = old, new
    if old_fn != new_fn:
        return "the function differs from the captured one"
    if old_spec != new_spec or len(old_tensors) != len(new_tensors):
        return (f"the arguments hold {len(new_tensors)} tensors in another structure; the graph was captured "
                f"with {len(old_tensors)}")
    for index, (a, b) in enumerate(zip(old_tensors, new_tensors)):
        if a != b:
            what = [name for name, x, y in zip(("address", "shape", "dtype"), a, b) if x != y]
            return (f"tensor argument {index} changed its {' and '.join(what)} "
                    f"(address {a[0]:#x}, shape {list(a[1])}, {a[2]} -> "
                    f"address {b[0]:#x}, shape {list(b[1])}, {b[2]})")
    for index, (a, b) in enumerate(zip(old_values, new_values)):
        if a != b:
            return f"argument value {index} changed from {_short(a)} to {_short(b)}"
    return "the arguments changed"


def _short(value) -> str:
    kind, x = value
    return repr(x) if kind in ("NoneType", "bool", "int", "float", "str", "bytes") else f"another {kind}"


# -------------------------------------------------------- runtime detection
def _runtime_of_leaves(leaves: list) -> Optional[GraphRuntime]:
    for leaf in leaves:
        name = framework_of(leaf)
        if name is not None:
            runtime = get_runtime(name)
            if runtime.is_tensor(leaf):
                return runtime
    return _imported_runtime()


def _imported_runtime() -> Optional[GraphRuntime]:
    # No tensor argument: the one framework that is imported, if exactly one is.
    name = sole_imported_framework()
    return get_runtime(name) if name is not None else None


def _no_tensor_reason(runtime: GraphRuntime) -> Optional[str]:
    # A function without tensor arguments can still be graphed where the device is a GPU.
    return runtime.graphs_unavailable_reason([])


def _runtime_named(framework: Optional[str]) -> GraphRuntime:
    if framework is not None:
        return get_runtime(framework)
    runtime = _imported_runtime()
    if runtime is None:
        imported = [name for name in FRAMEWORKS if framework_imported(name)]
        state = "both paddle and torch are imported" if imported else "neither paddle nor torch is imported"
        raise RuntimeError(f"paddle_graphpp graph API: cannot tell the framework ({state}); "
                           "pass framework='torch' or framework='paddle'.")
    return runtime


def _runtime_of_graph(graph, framework: Optional[str]) -> GraphRuntime:
    if framework is None:
        framework = framework_of(graph)
    return _runtime_named(framework)


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
