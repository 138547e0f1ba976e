"""The runtime seam: what the engine needs from a framework, as one required protocol and a few
optional capabilities.

:class:`GraphRuntime` is what every runtime must do (each member with its contract, some with a
default a runtime may override). Everything else is a capability a runtime declares by deriving
from its protocol (:class:`StateSlots`, :class:`GradientOps`, ... :class:`Recompute`) and
implementing all of it; :func:`capabilities` finds them once per runtime, and the engine asks that
record, never a runtime for what it did not declare. :func:`framework_of` alone decides which
framework an object belongs to; :func:`runtime_for`, :func:`get_runtime` and
:func:`framework_module` load a framework's adapters (named in :data:`FRAMEWORKS`) on first use,
and nothing here imports a framework before: an unknown name raises ``ValueError``, a framework
not installed ``ImportError`` saying what to install. The design:
docs/architecture.md#the-runtime-seam.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import sys
import weakref
from dataclasses import dataclass
from types import MappingProxyType, ModuleType
from typing import Any, Callable, ContextManager, Hashable, Iterator, Mapping, NamedTuple, Optional, Sequence

from .process import current_process

__all__ = [
    "FRAMEWORKS",
    "GraphRuntime",
    "TensorSpec",
    "StateSlots",
    "GradientOps",
    "AutocastModes",
    "SplitBackward",
    "InGraphAccumulation",
    "OutputRelease",
    "PoolLending",
    "StreamOrderedAllocator",
    "MemoryTelemetry",
    "CaptureHints",
    "ModelTree",
    "ReplayEvents",
    "Recompute",
    "RngMirror",
    "Capabilities",
    "capabilities",
    "clone_many",
    "backward_into",
    "available_runtimes",
    "framework_module",
    "framework_imported",
    "framework_of",
    "get_runtime",
    "sole_imported_framework",
    "runtime_for",
]

#: Framework name (the top-level module of its types) -> the package of its adapters. The
#: order is the order in which a switch that touches every framework applies them.
FRAMEWORKS: Mapping[str, str] = MappingProxyType({
    "paddle": "paddle_graphpp.paddle",
    "torch": "paddle_graphpp.torch",
})
_INSTALL = MappingProxyType({"paddle": "paddlepaddle-gpu (or paddlepaddle for CPU)", "torch": "torch"})


class TensorSpec(NamedTuple):
    """What a captured graph assumes of one tensor input: a replay needs the same spec. (A
    named tuple: every graphed call makes one per input tensor and hashes them.)"""

    shape: tuple
    dtype: str
    device: str
    requires_grad: bool

    def describe(self) -> str:
        grad = ", requires grad" if self.requires_grad else ""
        return f"shape {list(self.shape)}, {self.dtype} on {self.device}{grad}"


class GraphRuntime(abc.ABC):
    """Adapter from the framework-neutral engine to one framework: what every runtime does.

    Required members, by concern (15; each documented with its contract below):

    * identity: :attr:`name`;
    * tensors: :meth:`is_tensor`, :meth:`spec`, :meth:`alias_key`, :meth:`static_buffers`,
      :meth:`copy_many`, :meth:`detach`;
    * framework state: :meth:`graphs_unavailable_reason`;
    * autograd: :meth:`grad_enabled`, :meth:`enable_grad`, :meth:`autograd_grad`,
      :meth:`apply_graphed_function`;
    * graphs: :meth:`create_graph`, :meth:`capture_to_graph`, :meth:`is_capturing`.

    With a default a runtime may override: :attr:`adopts_held_gradients`, :meth:`static_like`,
    :meth:`call_with_param_aliases`, :meth:`replay_graph`, :meth:`new_pool`,
    :meth:`release_cached_memory`.

    What a runtime may do besides is a capability (the module docstring). A runtime holds no
    state the engine reads or writes (counters belong to the process, see
    :mod:`paddle_graphpp.core.capture`), apart from per-process handles (the capture stream);
    one instance serves every graphed layer of a process.
    """

    #: short framework name, used in messages and as the key of :data:`FRAMEWORKS`
    name: str = "abstract"

    #: True when autograd may make a tensor that others still hold a leaf's ``.grad`` (Paddle
    #: shares it; the engine then hands such leaves copies, which needs :class:`GradientOps`);
    #: False when it copies any gradient it does not own outright (PyTorch).
    adopts_held_gradients: bool = True

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

    def static_like(self, tensor: Any) -> Any:
        """A new, uninitialised tensor with the same shape, dtype and device, not tracked by
        autograd. Default: one of :meth:`static_buffers`."""
        return self.static_buffers([self.spec(tensor)])[0]

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
    def detach(self, tensor: Any, requires_grad: bool = False) -> Any:
        """An alias of ``tensor`` cut from autograd, tracked again (as a new leaf) if ``requires_grad``."""

    # --------------------------------------------------------- framework state
    @abc.abstractmethod
    def graphs_unavailable_reason(self, tensors: Sequence[Any]) -> Optional[str]:
        """``None`` when these tensors (possibly none) can go through a CUDA graph, else why not.

        Typical reasons: a CPU build of the framework, no visible GPU, a CPU tensor.
        """


    # ---------------------------------------------------------------- autograd
    @abc.abstractmethod
    def grad_enabled(self) -> bool:
        """True when autograd records operations (outside ``no_grad``)."""

    @abc.abstractmethod
    def enable_grad(self) -> ContextManager:
        """Context in which autograd records, even inside a custom function's forward."""

    def call_with_param_aliases(self, fn: Any, params: Sequence[Any], args: tuple, kwargs: dict) -> tuple:
        """Call ``fn(*args, **kwargs)`` with ``params`` replaced by fresh autograd leaves.

        Returns ``(result, aliases)``: ``aliases[i]`` shares memory with ``params[i]``, so graphs
        read the real weights, but the engine's inner autograd graphs differentiate against the
        aliases. The user's parameters (their hooks, their gradient accumulators, the stream
        these were created on) are touched only by the outer autograd node. Default, for a
        framework without a functional call over a layer's parameters (Paddle): the parameters
        themselves are their aliases, and the inner graphs differentiate against them (their
        hooks fire at capture too).
        """
        return fn(*args, **kwargs), list(params)

    @abc.abstractmethod
    def autograd_grad(self, outputs: Sequence[Any], grad_outputs: Sequence[Any],
                      inputs: Sequence[Any], retain_graph: bool = False) -> list:
        """Gradients of ``outputs`` w.r.t. ``inputs`` (``None`` where unused); frees the autograd
        graph's saved tensors unless ``retain_graph``."""

    @abc.abstractmethod
    def apply_graphed_function(self, call: Any, tensors: Sequence[Any], params: Sequence[Any]) -> tuple:
        """Run ``call.forward()`` inside the framework's custom autograd function.

        ``call.forward()`` returns the flat list of output tensors and sets
        ``call.differentiable`` (one bool per output). The function's backward passes the
        incoming gradients of the differentiable outputs to ``call.backward(grads)``, which
        returns one gradient (or ``None``) per entry of ``tensors + params``. A runtime with
        :class:`SplitBackward` passes ``weights_wanted=False`` when autograd asks for no
        parameter gradient. Returns the output tensors as a tuple.
        """

    # --------------------------------------------------------- graph operations
    @abc.abstractmethod
    def create_graph(self) -> Any:
        """A new, empty graph object."""

    def new_pool(self, shared: bool = False) -> Any:
        """A handle to a new private memory pool that graphs can share. Default ``None``: graphs
        allocate from the framework's default pool (a framework without private pools).
        ``shared``: graphs captured back to back will share it (a generation's pool), not one
        graph alone (``per_graph``); a runtime may lay the pool out for that."""
        return None

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

    def replay_graph(self, graph: Any) -> None:
        """Launch a captured graph on the current stream. Default: ``graph.replay()`` (the graph
        objects of PyTorch and Paddle)."""
        graph.replay()

    @abc.abstractmethod
    def is_capturing(self) -> bool:
        """True when the current stream is capturing a graph."""

    # ------------------------------------------------------------------ memory
    def release_cached_memory(self) -> None:
        """Return cached, unused device memory to the driver (before a batch of captures, and
        after a failed one). Default: nothing is cached."""


# ------------------------------------------------------------------ capabilities
class StateSlots(abc.ABC):
    """The replay-time check that a layer's parameters and buffers are still the tensors (and
    addresses) its graphs read (:mod:`paddle_graphpp.core.state`); without it nothing is checked."""

    @abc.abstractmethod
    def state_slots(self, layer: Any) -> list:
        """Where ``layer``'s parameters and buffers live, for the replay-time check that they
        still hold the tensors a capture read (:class:`paddle_graphpp.core.state.StateWatch`):
        ``(holder, key, name)`` triples, ``holder[key]`` being the tensor and ``name`` saying
        which it is (``"parameter 'fc.weight'"``); ``[]`` checks nothing."""

    @abc.abstractmethod
    def storage_addresses(self, tensors: Sequence[Any]) -> list:
        """The device address of each tensor's first element (called at every check: keep it
        to one attribute read per tensor)."""


class GradientOps(abc.ABC):
    """Gradient arithmetic the engine needs where it moves parameter gradients itself: split
    backwards, accumulation inside graphs, and autograd that adopts held gradients
    (:attr:`GraphRuntime.adopts_held_gradients`)."""

    @abc.abstractmethod
    def add_many(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        """``dst += src`` for each pair, in place, capturable."""

    @abc.abstractmethod
    def leaves_without_grad(self, tensors: Sequence[Any]) -> list:
        """Indices of the leaves requiring grad whose ``.grad`` is still unset."""


class AutocastModes(abc.ABC):
    """Mixed-precision state that a capture bakes in (without it: one plain state)."""

    @abc.abstractmethod
    def mode_key(self) -> Any:
        """A hashable summary of the framework state a capture bakes in (mixed precision);
        ``None`` for the plain state. Called on every graphed call: keep it cheap."""

    @abc.abstractmethod
    def mode_context(self, key: Any) -> ContextManager:
        """Context that re-enters the state ``key`` (a :meth:`mode_key` value) describes, so a
        call recorded under it can be captured later; inside it, ``mode_key() == key``."""


class SplitBackward(GradientOps):
    """Backwards in two halves, as zero-bubble schedules run them: the runtime's custom function
    tells the engine whether a backward asks for parameter gradients
    (``call.backward(grads, weights_wanted=...)``)."""

    #: The weight pass :meth:`weight_pass_refills_grad` recognises, named in errors.
    refilling_weight_pass: str = "the framework's pipeline weight pass"

    @abc.abstractmethod
    def backward_input(self, outputs: Sequence[Any], grad_outputs: Sequence[Any], inputs: Sequence[Any],
                       params: Sequence[Any]) -> tuple:
        """The input-gradient half of a backward: returns ``(input_grads, param_grads, state)``:
        the gradients w.r.t. ``inputs`` (``None`` where unused); per parameter, a gradient this
        half already produced (``None`` for most: a runtime whose weight half computes every
        parameter gradient returns all ``None``), handed to autograd with the input gradients;
        and what :meth:`backward_weight` needs to produce the remaining parameter gradients
        later (the autograd graph is kept). A runtime with :class:`InGraphAccumulation`
        returns no parameter gradient here. Runs inside a capture."""

    @abc.abstractmethod
    def backward_weight(self, state: Any, params: Sequence[Any]) -> Iterator[tuple]:
        """The weight-gradient half: yields ``(indices, gradients)`` of ``params``, a few at a
        time (the caller moves each batch into its buffers before asking for the next), for
        every parameter whose gradient it produces (a parameter never yielded gets none from
        this half); then releases ``state``. Runs inside a capture."""

    @abc.abstractmethod
    def weight_pass_refills_grad(self) -> bool:
        """Does the weight pass running now put each parameter gradient it gets into
        ``.grad`` (assigning it where ``.grad`` is unset)? Only then may a layer that
        accumulates inside its graphs hand it the whole sum with ``.grad`` unset."""


class InGraphAccumulation(GradientOps):
    """Parameter gradients added into ``.grad`` inside backward graphs (``accumulate_grads``)."""

    @abc.abstractmethod
    def zero_many(self, tensors: Sequence[Any]) -> None:
        """Zero each tensor in place (addresses unchanged), capturable."""

    @abc.abstractmethod
    def grad_of(self, param: Any) -> Any:
        """``param``'s accumulated gradient (its ``.grad``), or ``None``."""

    @abc.abstractmethod
    def set_grad(self, param: Any, grad: Any) -> None:
        """Make ``grad`` (the tensor itself, not a copy) the accumulated gradient of ``param``."""

    @abc.abstractmethod
    def params_with_grad_hooks(self, params: Sequence[Any]) -> list:
        """Indices of ``params`` whose gradient accumulation runs hooks (those must keep going
        through the framework's accumulation). May answer for every parameter when hooks are
        installed where they cannot be seen (a data-parallel wrapper's reducer)."""

    def hooked_buffer(self, param: Any) -> Any:
        """The buffer that ``param``'s accumulation hook adds its gradient into, where the library
        that hooks it keeps one of its own (Megatron-Core's ``main_grad``): graphs may add the
        gradient there themselves, as the hook would, and hand autograd :meth:`zero_grad_like`
        so that the hook still runs (adding nothing). ``None`` where there is none."""
        return None

    def zero_grad_like(self, param: Any) -> Any:
        """A gradient of zeros for ``param``, handed to autograd where the graph already added
        the gradient into :meth:`hooked_buffer` (needed only where that can be other than ``None``)."""
        raise NotImplementedError(f"{type(self).__name__} has no hooked buffers")

    @abc.abstractmethod
    def backward_to_grads(self, outputs: Sequence[Any], grad_outputs: Sequence[Any], inputs: Sequence[Any],
                          aliases: Sequence[Any], params: Sequence[Any]) -> list:
        """Eager backward of ``outputs`` that adds the gradient of each parameter alias in
        ``aliases`` into its parameter's (``params``) gradient as autograd produces it (an unset
        gradient takes the new one); returns the gradients of ``inputs``."""

    @abc.abstractmethod
    def backward_into(self, outputs: Sequence[Any], grad_outputs: Sequence[Any], inputs: Sequence[Any],
                      params: Sequence[Any], buffers: Sequence[Any], *, accumulate: bool,
                      retain_graph: bool = False) -> tuple:
        """As :func:`backward_into` (the module function), moving each parameter gradient into
        its buffer as soon as autograd produces it, so the graph's pool never holds them all."""


class OutputRelease(abc.ABC):
    """Outputs that the recorded step freed within the step give their memory back to the pool
    at the same point of the capture order, and what replays handed out is watched per memory
    (not per tensor object): whatever still uses an output's memory when a later replay is about
    to overwrite it keeps its values, or, where the runtime cannot move it, raises when read."""

    @abc.abstractmethod
    def memory_watches(self, tensors: Sequence[Any], others: Sequence[Any]) -> Optional[list]:
        """Recording: per tensor (an eager call's outputs), a function that tells whether anyone
        still uses its memory (any tensor over it, autograd's saved ones included), or ``None``
        when the tensors share memory with each other or with ``others`` (the call's inputs and
        parameters) or the runtime cannot tell."""

    @abc.abstractmethod
    def release_to_pool(self, tensor: Any) -> None:
        """During capture: ``tensor`` (a graph's output in the pool) keeps its address, shape
        and dtype but no longer owns its memory, which the allocator may give to graphs captured
        after this point (everyone who holds the tensor object keeps a valid alias)."""

    @abc.abstractmethod
    def weak_alias(self, tensor: Any) -> Optional[Any]:
        """A new tensor object over ``tensor``'s memory (shape, strides, dtype) that does not own
        it, or ``None`` where it cannot make one for this tensor."""

    @abc.abstractmethod
    def hand_out(self, tensors: Sequence[Any]) -> tuple[list, list]:
        """After a replay: aliases of its output buffers ``tensors`` for the caller, and per alias
        a *watch*, a function that returns ``None`` once nothing uses the alias's memory any more
        (neither the alias nor any tensor made from it without a copy: a detached alias, a slice,
        a view, one autograd saved), else a handle for :meth:`move_to_copies`. Neither the
        watches nor the runtime hold the aliases."""

    @abc.abstractmethod
    def move_to_copies(self, held: Sequence[Any], overwritten: str) -> None:
        """Before a replay overwrites the memory of outputs handed out earlier: every tensor over
        the memory that ``held`` (what watches returned) stands for gets its current values in
        new memory of its own, the tensor objects staying the same. Where the runtime cannot do
        that for every such tensor, the handed-out alias itself keeps its values and the others
        raise an error with the message ``overwritten`` when read (never silently read the new
        values)."""


class PoolLending(abc.ABC):
    """Eager work between steps (optimizer steps) borrows the graphs' shared pool."""

    @abc.abstractmethod
    def defer_capture(self) -> Optional[str]:
        """Asked before a recorded episode is captured: a reason to wait (logged once) drops the
        recording and records the next episode instead (asked again then; the core stops asking
        after ``capture.MAX_DEFERRED_EPISODES`` in a row); ``None`` lets the capture go."""

    @abc.abstractmethod
    def prepare_pool(self, pool: Any) -> int:
        """Before the first capture into the shared ``pool``: give it, as free memory, what the
        eager work that borrows it (:meth:`lend_pool`) will need. Returns the bytes reserved."""

    @abc.abstractmethod
    def lend_pool(self, pool: Any, is_idle: Callable[[], bool], on_leak: Callable[[], None]) -> None:
        """Let eager work that runs while ``is_idle()`` (no micro-batch in flight, so every
        activation in ``pool`` is dead) take its temporaries from ``pool``'s free memory; it
        must free them before the next replay. If such work leaves memory allocated in
        ``pool``, call ``on_leak()`` (the core then drops the pool's graphs) and stop lending."""

    @abc.abstractmethod
    def release_pool(self, pool: Any) -> None:
        """``pool`` holds no graph and never will (every capture into it failed): give its
        memory back to the driver, at the latest at the next :meth:`release_cached_memory`,
        which the core calls right after (once the caller dropped its own reference). Called
        between captures, never inside one."""

    def end_borrowed_work(self) -> None:
        """Borrowed work that raised (an optimizer step) may have left its allocations routed
        into a pool: end that now. Called at every graphed call (before a batch of captures can
        start) and by :func:`paddle_graphpp.drop_in_flight`. Default: nothing borrows across calls."""


class StreamOrderedAllocator(abc.ABC):
    """The framework may allocate with the stream-ordered allocator (cudaMallocAsync)."""

    @abc.abstractmethod
    def async_allocator_active(self) -> bool:
        """True when the framework allocates with the stream-ordered allocator: graph pools are
        then ignored. Raises :class:`paddle_graphpp.allocator.AllocatorSwitchError` on a
        half-switch (asked for, but this framework's allocator was set up before it)."""


class MemoryTelemetry(abc.ABC):
    """Device and pool memory figures for :func:`paddle_graphpp.memory_report`."""

    @abc.abstractmethod
    def memory_stats(self, pools: Optional[Sequence[Any]] = None) -> dict:
        """``{"reserved_bytes": int, "allocated_bytes": int}``: with ``pools=None``, for the current
        device; with a sequence of pool handles, held by those pools together. Zeros without a device."""


class CaptureHints(abc.ABC):
    """Causes of failed captures the runtime can name (an unregistered RNG generator, say)."""

    @abc.abstractmethod
    def capture_failure_hint(self, error: BaseException, generators: Sequence[Any]) -> Optional[str]:
        """What to do about a capture that failed with ``error`` when the runtime knows the
        cause; ``None`` for the engine's general hint. ``generators``: those the layer registered."""

    def is_capture_failure(self, error: BaseException) -> bool:
        """Whether ``error``, raised inside a capture, is the framework's or the device's (a
        failure of the capture) rather than the layer's own code. The framework's errors are
        ``RuntimeError`` unless the runtime says otherwise (a runtime without this capability
        is read the same way)."""
        return isinstance(error, RuntimeError)


class ModelTree(abc.ABC):
    """Models made of modules (layers) that :func:`paddle_graphpp.reset_graphs` can walk."""

    @abc.abstractmethod
    def submodules(self, model: Any) -> list:
        """Every module (layer) of ``model``, ``model`` included."""


class ReplayEvents(abc.ABC):
    """Replays the host can follow (:mod:`paddle_graphpp.core.watchdog`), communicators it can
    abort, and capture failures published to the other ranks."""

    @abc.abstractmethod
    def event_recorder(self) -> Optional[Callable[[], Any]]:
        """For the work launched so far on the current stream: a function that records an event
        after it on that stream and returns the event (called at once, or later from the
        watchdog's thread), or ``None`` where there is nothing to follow (no device)."""

    @abc.abstractmethod
    def event_done(self, event: Any) -> bool:
        """Whether the work before ``event`` completed. Called from the watchdog's thread."""

    @abc.abstractmethod
    def default_replay_timeout(self) -> Optional[float]:
        """The replay timeout when none is configured: the process group's timeout where a group
        of more than one rank exists, else ``None`` (no watchdog)."""

    @abc.abstractmethod
    def abort_collectives(self, reason: str) -> Optional[str]:
        """Abort this process's communicators, so kernels waiting on a dead peer return; what was
        aborted, or ``None``. Called from the watchdog's thread."""

    @abc.abstractmethod
    def publish_capture_failure(self, text: str) -> None:
        """Tell the other ranks that a capture of this rank failed (``text`` says which)."""

    @abc.abstractmethod
    def peer_capture_failure(self) -> Optional[str]:
        """A capture failure another rank published, or ``None`` (one lookup, which may cross the
        network: the watchdog's thread asks about once a second)."""


class Recompute(abc.ABC):
    """Layers that recompute their forward inside the backward (``recompute=True``: activation
    checkpointing). The forward graph keeps no activations; the backward graph runs the forward
    again over the static inputs, then its backward. Its random draws must repeat the forward
    graph's: the backward graph draws from *mirrors* of the generators the forward draws from,
    set before each backward replay to where the forward's replay read them."""

    @abc.abstractmethod
    def no_grad(self) -> ContextManager:
        """Autograd off (the recomputing layer's forward graph records no autograd graph)."""

    @abc.abstractmethod
    def call_checkpointed(self, fn: Any, params: Sequence[Any], args: tuple, kwargs: dict) -> tuple:
        """:meth:`GraphRuntime.call_with_param_aliases` under the framework's own activation
        checkpointing (the eager runs of a recomputing layer: warmup, recording, fallback): its
        autograd graph keeps the inputs only and recomputes the rest in the backward."""

    @abc.abstractmethod
    def rng_mirror(self, generators: Sequence[Any]) -> "RngMirror":
        """The mirrors of the default generator and ``generators`` (those the layer registers)."""


class RngMirror(abc.ABC):
    """One recomputing layer's random-number mirrors (see :class:`Recompute`)."""

    @abc.abstractmethod
    def swapped(self) -> ContextManager:
        """Around a backward capture: the generators draw from (and the graph registers) the mirrors."""

    @abc.abstractmethod
    def note(self) -> Any:
        """Right before a forward replay: where the generators stand (what the forward draws from)."""

    @abc.abstractmethod
    def restore(self, noted: Any) -> None:
        """Right before the matching backward replay: set the mirrors to ``noted``."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """The optional capabilities of one runtime: each field is the runtime itself where it
    declares that capability, else ``None``."""

    state: Optional[StateSlots]
    gradients: Optional[GradientOps]
    modes: Optional[AutocastModes]
    split: Optional[SplitBackward]
    accumulation: Optional[InGraphAccumulation]
    release: Optional[OutputRelease]
    lending: Optional[PoolLending]
    stream_ordered: Optional[StreamOrderedAllocator]
    telemetry: Optional[MemoryTelemetry]
    hints: Optional[CaptureHints]
    tree: Optional[ModelTree]
    events: Optional[ReplayEvents]
    recomputation: Optional[Recompute]

    def mode_key(self) -> Any:
        return self.modes.mode_key() if self.modes is not None else None

    def mode_context(self, key: Any) -> ContextManager:
        if self.modes is None:
            return contextlib.nullcontext()
        return self.modes.mode_context(key)


_FIELDS = MappingProxyType({
    "state": StateSlots, "gradients": GradientOps, "modes": AutocastModes, "split": SplitBackward,
    "accumulation": InGraphAccumulation, "release": OutputRelease, "lending": PoolLending,
    "stream_ordered": StreamOrderedAllocator, "telemetry": MemoryTelemetry, "hints": CaptureHints, "tree": ModelTree,
    "events": ReplayEvents, "recomputation": Recompute})


class RuntimeTable:
    """The runtimes of this process (a part of :class:`~paddle_graphpp.core.process.GraphProcess`)."""

    def __init__(self):
        #: name -> the runtime :func:`get_runtime` serves (loaded on first use).
        self.loaded: dict[str, GraphRuntime] = {}
        #: name -> factory of a runtime served in place of the framework's (:func:`register_runtime`).
        self.registered: dict[str, Callable[[], GraphRuntime]] = {}
        #: runtime object -> the capabilities it declares (found once, by :func:`capabilities`).
        self.capabilities: "weakref.WeakKeyDictionary[GraphRuntime, Capabilities]" = weakref.WeakKeyDictionary()


def runtime_table() -> RuntimeTable:
    """This process's :class:`RuntimeTable`."""
    return current_process().part(RuntimeTable)


def capabilities(runtime: GraphRuntime) -> Capabilities:
    """The capabilities ``runtime`` declares (found once per runtime object).

    Raises:
        TypeError: ``runtime`` says its autograd adopts held gradients but lacks
            :class:`GradientOps`, which the engine needs to hand such leaves copies.
    """
    table = runtime_table().capabilities
    found = table.get(runtime)
    if found is None:
        found = Capabilities(
            **{field: runtime if isinstance(runtime, proto) else None for field, proto in _FIELDS.items()})
        if runtime.adopts_held_gradients and found.gradients is None:
            raise TypeError(f"the {runtime.name} runtime sets adopts_held_gradients but does not declare "
                            f"GradientOps: derive it from paddle_graphpp.core.runtime.GradientOps (add_many, "
                            f"leaves_without_grad), or set adopts_held_gradients = False")
        table[runtime] = found
    return found


# ------------------------------------------------------------------ helpers
def clone_many(runtime: GraphRuntime, tensors: Sequence[Any]) -> list:
    """Fresh copies of ``tensors`` (new memory), in one batched copy."""
    outs = [runtime.static_like(t) for t in tensors]
    runtime.copy_many(outs, tensors)
    return outs


def backward_into(runtime: GraphRuntime, outputs: Sequence[Any], grad_outputs: Sequence[Any],
                  inputs: Sequence[Any], params: Sequence[Any], buffers: Sequence[Any], *, accumulate: bool,
                  retain_graph: bool = False) -> tuple:
    """Backward of ``outputs``: returns ``(input_grads, used)``, the gradients w.r.t. ``inputs``
    (``None`` where unused) and, per parameter, whether it got a gradient; the gradient of
    ``params[i]`` goes into ``buffers[i]``, added when ``accumulate``, else copied (an unused
    parameter's buffer is left alone). Runs inside a capture. A runtime with
    :class:`InGraphAccumulation` moves each gradient as autograd produces it; otherwise every
    parameter gradient is held until the end."""
    accumulation = capabilities(runtime).accumulation
    if accumulation is not None:
        return accumulation.backward_into(outputs, grad_outputs, inputs, params, buffers, accumulate=accumulate,
                                          retain_graph=retain_graph)
    got = runtime.autograd_grad(outputs, grad_outputs, [*inputs, *params], retain_graph=retain_graph)
    n = len(inputs)
    used = [g is not None for g in got[n:]]
    pairs = [(b, g) for b, g in zip(buffers, got[n:]) if g is not None]
    if pairs:
        (runtime.add_many if accumulate else runtime.copy_many)([b for b, _ in pairs], [g for _, g in pairs])
    return got[:n], used


# ------------------------------------------------------------------ the table
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


def framework_imported(name: str) -> bool:
    """Whether framework ``name`` is imported already (asks ``sys.modules``; imports nothing)."""
    return name in sys.modules


def sole_imported_framework() -> Optional[str]:
    """For a call that carries no framework object (``create_graph()``, a function without tensor
    arguments): the one framework imported so far, or ``None`` when none or both are."""
    imported = [name for name in FRAMEWORKS if framework_imported(name)]
    return imported[0] if len(imported) == 1 else None


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
    """Module ``part`` (``"runtime"``, ``"optim"``, ``"memory.allocator"``) of framework ``name``'s package.

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
    return sorted(set(FRAMEWORKS) | set(runtime_table().registered))


def register_runtime(name: str, factory: Callable[[], GraphRuntime]) -> None:
    """Serve ``factory()`` as the runtime ``name`` (used by tests to plug in a fake graph runtime)."""
    table = runtime_table()
    table.registered[name] = factory
    table.loaded.pop(name, None)


def unregister_runtime(name: str) -> None:
    """Undo :func:`register_runtime`: ``name`` loads its real adapter again on next use."""
    table = runtime_table()
    table.registered.pop(name, None)
    table.loaded.pop(name, None)


def get_runtime(name: str) -> GraphRuntime:
    """The runtime for framework ``name``, imported on first use.

    Raises:
        ValueError: unknown name.
        ImportError: the framework is not installed; the message says what to install.
    """
    table = runtime_table()
    if name in table.loaded:
        return table.loaded[name]
    if name in table.registered:
        runtime = table.registered[name]()
    elif name in FRAMEWORKS:
        runtime = framework_module(name, "runtime").RUNTIME
    else:
        raise ValueError(f"unknown runtime {name!r}; choose one of {available_runtimes()}")
    table.loaded[name] = runtime
    return runtime
