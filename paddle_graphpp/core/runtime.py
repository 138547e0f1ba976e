"""The runtime seam: everything the engine needs from a framework, and nothing more.

The core never imports a framework. Each framework has one package of adapters, named in
:data:`FRAMEWORKS`: its ``runtime`` module implements :class:`GraphRuntime` (and imports the
framework), its ``optim`` module holds the graph-safe optimizer steps, and its ``allocator``
module the stream-ordered allocator switch (which must work before the framework is
imported, so that module imports no framework at import time).

Which framework an object belongs to is decided in one place, :func:`framework_of`, from
the module its type (or a base class) is defined in; :func:`runtime_for` turns that into the
runtime, :func:`get_runtime` loads a runtime by name, :func:`framework_module` any other part
of a framework's package. Nothing here imports a framework until one of these is called.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, ContextManager, Hashable, Iterator, Optional, Sequence

__all__ = [
    "FRAMEWORKS",
    "GraphRuntime",
    "TensorSpec",
    "available_runtimes",
    "framework_module",
    "framework_of",
    "get_runtime",
    "runtime_for",
]

#: Framework name (the top-level module of its types) -> the package of its adapters. The
#: order is the order in which a switch that touches every framework applies them.
FRAMEWORKS: dict[str, str] = {
    "paddle": "paddle_graphpp.paddle",
    "torch": "paddle_graphpp.torch",
}
_INSTALL = {"paddle": "paddlepaddle-gpu (or paddlepaddle for CPU)", "torch": "torch"}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a captured graph assumes of one tensor input: a replay needs the same spec."""

    shape: tuple
    dtype: str
    device: str
    requires_grad: bool

    def describe(self) -> str:
        grad = ", requires grad" if self.requires_grad else ""
        return f"shape {list(self.shape)}, {self.dtype} on {self.device}{grad}"



class GraphRuntime(abc.ABC):
    """Adapter from the framework-neutral engine to one framework.

    Members, by concern (each documented with its contract below):

    * tensors: :meth:`is_tensor`, :meth:`spec`, :meth:`alias_key`, :meth:`static_like`,
      :meth:`static_buffers`, :meth:`copy_many`,
      :meth:`clone_many`, :meth:`detach`;
    * framework state: :meth:`graphs_unavailable_reason`, :meth:`mode_key`, :meth:`mode_context`,
      :meth:`state_slots`, :meth:`storage_addresses` (the replay-time check of
      :mod:`paddle_graphpp.core.state`), :meth:`submodules`;
    * autograd: :meth:`grad_enabled`, :meth:`enable_grad`, :meth:`call_with_param_aliases`,
      :meth:`autograd_grad`, :meth:`backward_into`, :meth:`apply_graphed_function`,
      :meth:`leaves_without_grad`,
      :attr:`adopts_held_gradients`;
    * split backward for zero-bubble schedules (only where :attr:`splits_backward`):
      :meth:`backward_input`, :meth:`backward_weight`;
    * gradient accumulation inside graphs (only where :attr:`accumulates_grads_in_graph`):
      :meth:`add_many`, :meth:`zero_many`, :meth:`grad_of`, :meth:`set_grad`,
      :meth:`params_with_grad_hooks`;
    * graphs: :meth:`create_graph`, :meth:`new_pool`, :meth:`capture_to_graph`,
      :meth:`capture_failure_hint`, :meth:`replay_graph`, :meth:`is_capturing`;
    * memory: :meth:`memory_stats`, :meth:`async_allocator_active`, :meth:`release_cached_memory`,
      :meth:`lend_pool`.

    A runtime is stateless apart from per-process handles (the capture stream); one instance
    serves every graphed layer of a process.
    """

    #: short framework name, used in messages and as the key of :data:`FRAMEWORKS`
    name: str = "abstract"

    # ----------------------------------------------------------------- tensors
    @abc.abstractmethod
    def is_tensor(self, obj: Any) -> bool:
        """True for the framework's tensor type."""

    @abc.abstractmethod
    def spec(self, tensor: Any) -> TensorSpec:
        """Shape, dtype, device and whether autograd tracks it."""

    @abc.abstractmethod
    def alias_key(self, tensor: Any) -> Hashable:
        """Equal for two tensors exactly when they hold the same elements at the same
        addresses (address, shape, strides, dtype, device): one is the other's alias."""

    @abc.abstractmethod
    def static_like(self, tensor: Any) -> Any:
        """A new, uninitialised tensor with the same shape, dtype and device, not tracked by autograd."""

    @abc.abstractmethod
    def static_buffers(self, specs: Sequence[TensorSpec]) -> list:
        """New uninitialised tensors, one per spec (shape, dtype, device), not tracked by
        autograd. Allocated together (one block per device where the framework allows), so
        that buffers living as long as the graphs do not pin pieces of many cached blocks."""

    @abc.abstractmethod
    def copy_many(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        """Copy each ``srcs[i]`` into ``dsts[i]`` in place, on the current stream, capturable, in as
        few kernel launches as the framework allows; a pair that already shares memory is skipped."""

    @abc.abstractmethod
    def clone_many(self, tensors: Sequence[Any]) -> list:
        """Fresh copies of ``tensors`` (new memory), in as few kernel launches as the framework allows."""

    @abc.abstractmethod
    def detach(self, tensor: Any, requires_grad: bool = False) -> Any:
        """An alias of ``tensor`` cut from autograd, tracked again (as a new leaf) if ``requires_grad``."""

    def release_to_pool(self, tensor: Any) -> None:
        """During capture: ``tensor`` (a graph's output in the pool) keeps its address, shape
        and dtype but no longer owns its memory, which the allocator may give to graphs captured
        after this point (everyone who holds the tensor object keeps a valid alias of that
        address). A runtime that cannot keeps it owned (the default): correct, without the saving."""

    def memory_watches(self, tensors: Sequence[Any], others: Sequence[Any]) -> Optional[list]:
        """Recording: per tensor (an eager call's outputs), a function that tells whether anyone
        still uses its memory (any tensor over it, autograd's saved ones included), or ``None``
        when the tensors share memory with each other or with ``others`` (the call's inputs and
        parameters) or the runtime cannot tell. Default: ``None`` (outputs stay their
        positions' for good)."""
        return None

    def weak_alias(self, tensor: Any) -> Optional[Any]:
        """A new tensor object over ``tensor``'s memory (shape, strides, dtype) that does not own
        it, or ``None`` where the runtime cannot make one (default)."""
        return None

    def move_to_copies(self, tensors: Sequence[Any]) -> bool:
        """Give each tensor (an output handed out earlier, whose graph buffer the next replay
        overwrites) its current values in new memory of its own, the tensor objects staying
        the same. False where the framework cannot (the engine then warns)."""
        return False

    # --------------------------------------------------------- framework state
    @abc.abstractmethod
    def graphs_unavailable_reason(self, tensors: Sequence[Any]) -> Optional[str]:
        """``None`` when these tensors (possibly none) can go through a CUDA graph, else why not.

        Typical reasons: a CPU build of the framework, no visible GPU, a CPU tensor.
        """

    @abc.abstractmethod
    def mode_key(self) -> Any:
        """A hashable summary of the framework state a capture bakes in (mixed precision);
        ``None`` for the plain state. Called on every graphed call: keep it cheap."""

    @abc.abstractmethod
    def mode_context(self, key: Any) -> ContextManager:
        """Context that re-enters the state ``key`` (a :meth:`mode_key` value) describes, so a
        call recorded under it can be captured later; inside it, ``mode_key() == key``."""

    def state_slots(self, layer: Any) -> list:
        """Where ``layer``'s parameters and buffers live, for the replay-time check that they
        still hold the tensors a capture read (:class:`paddle_graphpp.core.state.StateWatch`):
        ``(holder, key, name)`` triples, ``holder[key]`` being the tensor and ``name`` saying
        which it is (``"parameter 'fc.weight'"``). Default: nothing is checked."""
        return []

    def submodules(self, model: Any) -> list:
        """Every module (layer) of ``model``, ``model`` included: where
        :func:`paddle_graphpp.reset_graphs` looks for graphed layers. Default: ``[model]``."""
        return [model]

    def storage_addresses(self, tensors: Sequence[Any]) -> list:
        """The device address of each tensor's first element (called at every check: keep it
        to one attribute read per tensor)."""
        return [self.alias_key(t)[0] for t in tensors]

    # ---------------------------------------------------------------- autograd
    @abc.abstractmethod
    def grad_enabled(self) -> bool:
        """True when autograd records operations (outside ``no_grad``)."""

    @abc.abstractmethod
    def enable_grad(self) -> ContextManager:
        """Context in which autograd records, even inside a custom function's forward."""

    @abc.abstractmethod
    def call_with_param_aliases(self, fn: Any, params: Sequence[Any], args: tuple, kwargs: dict) -> tuple:
        """Call ``fn(*args, **kwargs)`` with ``params`` replaced by fresh autograd leaves.

        Returns ``(result, aliases)``: ``aliases[i]`` shares memory with ``params[i]``, so graphs
        read the real weights, but the engine's inner autograd graphs differentiate against the
        aliases. The user's parameters (their hooks, their gradient accumulators, the stream
        these were created on) are touched only by the outer autograd node. A framework without
        a functional call may return the parameters themselves as their aliases.
        """

    @abc.abstractmethod
    def autograd_grad(self, outputs: Sequence[Any], grad_outputs: Sequence[Any],
                      inputs: Sequence[Any], retain_graph: bool = False) -> list:
        """Gradients of ``outputs`` w.r.t. ``inputs`` (``None`` where unused); frees the autograd
        graph's saved tensors unless ``retain_graph``."""

    def backward_to_grads(self, outputs: Sequence[Any], grad_outputs: Sequence[Any], inputs: Sequence[Any],
                          aliases: Sequence[Any], params: Sequence[Any]) -> list:
        """Eager backward of ``outputs`` that adds the gradient of each parameter alias in
        ``aliases`` into its parameter's (``params``) gradient, as autograd's accumulation
        would without hooks (an unset gradient takes the new one); returns the gradients of
        ``inputs``. Runtimes that can move each gradient as autograd produces it override this;
        the default computes them all, then adds."""
        got = self.autograd_grad(outputs, grad_outputs, list(inputs) + list(aliases))
        for param, grad in zip(params, got[len(inputs):]):
            if grad is None:
                continue
            current = self.grad_of(param)
            if current is None:
                self.set_grad(param, grad)
            else:
                self.add_many([current], [grad])
        return got[:len(inputs)]

    def backward_into(self, outputs: Sequence[Any], grad_outputs: Sequence[Any], inputs: Sequence[Any],
                      params: Sequence[Any], buffers: Sequence[Any], *, accumulate: bool,
                      retain_graph: bool = False) -> tuple:
        """Backward of ``outputs``: returns ``(input_grads, used)``, the gradients w.r.t.
        ``inputs`` (``None`` where unused) and, per parameter, whether it got a gradient; the
        gradient of ``params[i]`` goes into ``buffers[i]``, added when ``accumulate``, else
        copied (an unused parameter's buffer is left alone). Runs inside a capture. This
        default holds every parameter gradient until the end; a runtime that can move each
        into its buffer as soon as autograd produces it should, so the graph's pool never
        holds them all at once."""
        got = self.autograd_grad(outputs, grad_outputs, [*inputs, *params], retain_graph=retain_graph)
        n = len(inputs)
        used = [g is not None for g in got[n:]]
        pairs = [(b, g) for b, g in zip(buffers, got[n:]) if g is not None]
        if pairs:
            (self.add_many if accumulate else self.copy_many)([b for b, _ in pairs], [g for _, g in pairs])
        return got[:n], used

    @abc.abstractmethod
    def apply_graphed_function(self, call: Any, tensors: Sequence[Any], params: Sequence[Any]) -> tuple:
        """Run ``call.forward()`` inside the framework's custom autograd function.

        ``call.forward()`` returns the flat list of output tensors and sets
        ``call.differentiable`` (one bool per output). The function's backward passes the
        incoming gradients of the differentiable outputs to ``call.backward(grads)``, which
        returns one gradient (or ``None``) per entry of ``tensors + params``.
        Returns the output tensors as a tuple.
        """

    @abc.abstractmethod
    def leaves_without_grad(self, tensors: Sequence[Any]) -> list:
        """Indices of the leaves requiring grad whose ``.grad`` is still unset."""

    #: Backward graph replays so far that added parameter gradients into ``.grad`` inside the
    #: graph (counted by the engine). A replay's writes do not bump tensors' version counters,
    #: so code that skips work on gradients nobody wrote (``GraphedOptimizer.zero_grad``)
    #: compares this count as well.
    graph_grad_writes: int = 0

    #: Set by a framework's capture-agreement helper (torch: ``agree_on_captures``): called at the
    #: end of every batch of captures with whether an error of this process's captures is about
    #: to reach the user; returns the ranks of the agreement group whose captures failed so
    #: (empty: none), or raises :class:`~paddle_graphpp.CaptureError` when the peers do not
    #: answer in time. ``None``: each process decides alone.
    capture_agreement: Optional[Callable[[bool], list]] = None

    #: True when autograd may make a tensor that others still hold a leaf's ``.grad`` (Paddle
    #: shares it); False when it copies any gradient it does not own outright (PyTorch).
    adopts_held_gradients: bool = True

    # ------------------------------------------------ split backward (zero bubble)
    #: True when the runtime implements :meth:`backward_input` and :meth:`backward_weight`, and
    #: its custom function tells the engine whether a backward asks for parameter gradients
    #: (``call.backward(grads, weights_wanted=...)``).
    splits_backward: bool = False

    def backward_input(self, outputs: Sequence[Any], grad_outputs: Sequence[Any], inputs: Sequence[Any],
                       params: Sequence[Any]) -> tuple:
        """The input-gradient half of a backward: returns ``(input_grads, param_grads, state)``:
        the gradients w.r.t. ``inputs`` (``None`` where unused); per parameter, a gradient this
        half already produced (``None`` for most: a runtime whose weight half computes every
        parameter gradient returns all ``None``), handed to autograd with the input gradients;
        and what :meth:`backward_weight` needs to produce the remaining parameter gradients
        later (the autograd graph is kept). A runtime that accumulates gradients inside graphs
        (:attr:`accumulates_grads_in_graph`) returns no parameter gradient here. Runs inside a
        capture."""
        raise NotImplementedError(f"{self.name} runtime: backward_input")

    def weight_pass_refills_grad(self) -> bool:
        """Does the weight pass running now put each parameter gradient it gets into
        ``.grad`` (assigning it where ``.grad`` is unset)? Only then may a layer that
        accumulates inside its graphs hand it the whole sum with ``.grad`` unset."""
        return False

    #: The weight pass :meth:`weight_pass_refills_grad` recognises, named in errors.
    refilling_weight_pass: str = "the framework's pipeline weight pass"

    def backward_weight(self, state: Any, params: Sequence[Any]) -> Iterator[tuple]:
        """The weight-gradient half: yields ``(indices, gradients)`` of ``params``, a few at a
        time (the caller moves each batch into its buffers before asking for the next), for
        every parameter whose gradient it produces (a parameter never yielded gets none from
        this half); then releases ``state``. Runs inside a capture."""
        raise NotImplementedError(f"{self.name} runtime: backward_weight")

    # ------------------------------------------- gradient accumulation in graphs
    #: True when the runtime implements :meth:`add_many`, :meth:`grad_of`, :meth:`set_grad`,
    #: :meth:`zero_many` and :meth:`params_with_grad_hooks` (``accumulate_grads=True``).
    accumulates_grads_in_graph: bool = False

    def add_many(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        """``dst += src`` for each pair, in place, capturable."""
        raise NotImplementedError(f"{self.name} runtime: add_many")

    def zero_many(self, tensors: Sequence[Any]) -> None:
        """Zero each tensor in place (addresses unchanged), capturable."""
        raise NotImplementedError(f"{self.name} runtime: zero_many")

    def grad_of(self, param: Any) -> Any:
        """``param``'s accumulated gradient (its ``.grad``), or ``None``."""
        raise NotImplementedError(f"{self.name} runtime: grad_of")

    def set_grad(self, param: Any, grad: Any) -> None:
        """Make ``grad`` (the tensor itself, not a copy) the accumulated gradient of ``param``."""
        raise NotImplementedError(f"{self.name} runtime: set_grad")

    def params_with_grad_hooks(self, params: Sequence[Any]) -> list:
        """Indices of ``params`` whose gradient accumulation runs hooks (those must keep going
        through the framework's accumulation). May answer for every parameter when hooks are
        installed where they cannot be seen (a data-parallel wrapper's reducer)."""
        raise NotImplementedError(f"{self.name} runtime: params_with_grad_hooks")

    # --------------------------------------------------------- graph operations
    @abc.abstractmethod
    def create_graph(self) -> Any:
        """A new, empty graph object."""

    @abc.abstractmethod
    def new_pool(self) -> Any:
        """A handle to a new private memory pool that graphs can share."""

    @abc.abstractmethod
    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None,
                         generators: Sequence[Any] = ()) -> ContextManager:
        """Capture the work issued inside the context into ``graph``.

        Capture runs on ``stream`` (the runtime's capture stream when ``None``), allocates from
        ``pool``, registers the default RNG generator, ``generators`` and those of RNG trackers
        the runtime recognises (so each replay draws fresh numbers from them), and uses the
        thread-local capture mode so other threads (NCCL watchdogs) are unaffected. When the
        body raises, the context ends the broken capture itself (the stream, the pool
        redirection and the RNG bookkeeping can be used again; ``graph`` is left empty) and
        re-raises the body's exception.
        """

    def capture_failure_hint(self, error: BaseException, generators: Sequence[Any]) -> Optional[str]:
        """What to do about a capture that failed with ``error`` when the runtime knows the
        cause (an unregistered RNG generator, say); ``None`` for the engine's general hint.
        ``generators``: those the layer registered."""
        return None

    @abc.abstractmethod
    def replay_graph(self, graph: Any) -> None:
        """Launch a captured graph on the current stream."""

    @abc.abstractmethod
    def is_capturing(self) -> bool:
        """True when the current stream is capturing a graph."""

    # ------------------------------------------------------------------ memory
    @abc.abstractmethod
    def memory_stats(self, pools: Optional[Sequence[Any]] = None) -> dict:
        """``{"reserved_bytes": int, "allocated_bytes": int}``: with ``pools=None``, for the current
        device; with a sequence of pool handles, held by those pools together (a runtime that
        cannot attribute memory to pools says so in its docstring). Zeros without a device."""

    @abc.abstractmethod
    def async_allocator_active(self) -> bool:
        """True when the framework allocates with the stream-ordered allocator (cudaMallocAsync):
        graph pools are then ignored. Imports the framework. Raises
        :class:`paddle_graphpp.allocator.AllocatorSwitchError` on a half-switch (the switch was
        asked for, but this framework's allocator was set up before it)."""

    @abc.abstractmethod
    def release_cached_memory(self) -> None:
        """Return cached, unused device memory to the driver (before a batch of captures, and
        after a failed one)."""

    def release_pool(self, pool: Any) -> None:
        """``pool`` holds no graph and never will (every capture into it failed): give its
        memory back to the driver now. Called between captures, never inside one. Default:
        nothing (the pool keeps what it cached)."""

    def defer_capture(self) -> Optional[str]:
        """Asked before a recorded episode is captured: a reason to wait (logged once) drops the
        recording and records the next episode instead (asked again then; the core stops asking
        after ``capture.MAX_DEFERRED_EPISODES`` in a row); ``None`` lets the capture go. For
        runtimes whose pools are better sized or placed after some eager event, such as an
        optimizer's first step. Default: never wait."""
        return None

    def prepare_pool(self, pool: Any) -> int:
        """Before the first capture into the shared ``pool``: give it, as free memory, what the
        eager work that borrows it (:meth:`lend_pool`) will need, so that the graphs' scratch
        and that work share it instead of the pool being cut to the activations' sizes alone.
        Returns the bytes reserved. Default: nothing (0)."""
        return 0

    def lend_pool(self, pool: Any, is_idle: Callable[[], bool], on_leak: Callable[[], None]) -> None:
        """Let eager work that runs while ``is_idle()`` (no micro-batch in flight, so every
        activation in ``pool`` is dead) take its temporaries from ``pool``'s free memory,
        instead of memory of its own; it must free them before the next replay. If such work
        leaves memory allocated in ``pool``, call ``on_leak()`` (the core then drops the pool's
        graphs) and stop lending. Default: lend nothing. PyTorch lends to optimizer steps."""


# ------------------------------------------------------------------ the table
_LOADED: dict[str, GraphRuntime] = {}
_EXTRA: dict[str, Callable[[], GraphRuntime]] = {}


def framework_of(obj: Any) -> Optional[str]:
    """The name (a key of :data:`FRAMEWORKS`) of the framework ``obj`` belongs to, or ``None``.

    Decided from the top-level module of ``obj``'s type, or of the first base class defined in a
    framework (a user's ``torch.nn.Module`` subclass belongs to torch). Works for tensors,
    modules and layers, optimizers and graph objects; imports nothing.
    """
    cls = type(obj)
    root = cls.__module__.partition(".")[0]
    if root in FRAMEWORKS:
        return root
    for base in cls.__mro__[1:]:
        root = base.__module__.partition(".")[0]
        if root in FRAMEWORKS:
            return root
    return None


def runtime_for(obj: Any) -> GraphRuntime:
    """The runtime of the framework ``obj`` belongs to (see :func:`framework_of`).

    Raises:
        TypeError: ``obj`` is not an object of a supported framework.
        ImportError: as :func:`get_runtime`.
    """
    name = framework_of(obj)
    if name is None:
        raise TypeError(f"paddle_graphpp: expected a torch or paddle object, got "
                        f"{type(obj).__module__}.{type(obj).__qualname__}")
    return get_runtime(name)


def framework_module(name: str, part: str) -> ModuleType:
    """Module ``part`` (``"runtime"``, ``"optim"``, ``"allocator"``) of framework ``name``'s package.

    Raises:
        ValueError: unknown framework name.
        ImportError: the framework is not installed; the message says what to install.
    """
    if name not in FRAMEWORKS:
        raise ValueError(f"unknown framework {name!r}; choose one of {sorted(FRAMEWORKS)}")
    try:
        return importlib.import_module(f"{FRAMEWORKS[name]}.{part}")
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        raise ImportError(f"paddle_graphpp: the {name} support needs {name}, which is not installed; "
                          f"install {_INSTALL[name]}") from exc


def available_runtimes() -> list[str]:
    """Names :func:`get_runtime` accepts."""
    return sorted(set(FRAMEWORKS) | set(_EXTRA))


def register_runtime(name: str, factory: Callable[[], GraphRuntime]) -> None:
    """Serve ``factory()`` as the runtime ``name`` (used by tests to plug in a fake graph runtime)."""
    _EXTRA[name] = factory
    _LOADED.pop(name, None)


def unregister_runtime(name: str) -> None:
    """Undo :func:`register_runtime`: ``name`` loads its real adapter again on next use."""
    _EXTRA.pop(name, None)
    _LOADED.pop(name, None)


def get_runtime(name: str) -> GraphRuntime:
    """The runtime for framework ``name``, imported on first use.

    Raises:
        ValueError: unknown name.
        ImportError: the framework is not installed; the message says what to install.
    """
    if name in _LOADED:
        return _LOADED[name]
    if name in _EXTRA:
        runtime = _EXTRA[name]()
    elif name in FRAMEWORKS:
        runtime = framework_module(name, "runtime").RUNTIME
    else:
        raise ValueError(f"unknown runtime {name!r}; choose one of {available_runtimes()}")
    _LOADED[name] = runtime
    return runtime
