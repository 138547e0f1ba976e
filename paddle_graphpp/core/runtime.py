"""The runtime seam: everything the engine needs from a framework, and nothing more.

The core never imports a framework. A runtime is one small adapter module
(``paddle_graphpp.paddle.runtime`` or ``paddle_graphpp.torch.runtime``) that implements
:class:`GraphRuntime`; :func:`get_runtime` loads it lazily by name.

The methods are grouped by concern, in the spirit of an accelerator interface
(``create_graph / capture_to_graph / replay_graph``), widened only where graphed
training needs it: static copies, autograd, gradient hand-off and memory figures.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

__all__ = ["GraphRuntime", "TensorSpec", "get_runtime", "available_runtimes"]


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

    A runtime is stateless apart from per-process handles (the capture stream);
    one instance serves every graphed layer of a process.
    """

    #: short framework name, used in messages and the loader table
    name: str = "abstract"

    # ----------------------------------------------------------------- tensors
    @abc.abstractmethod
    def is_tensor(self, obj: Any) -> bool:
        """True for the framework's tensor type."""

    @abc.abstractmethod
    def spec(self, tensor: Any) -> TensorSpec:
        """Shape, dtype, device and whether autograd tracks it."""

    @abc.abstractmethod
    def graphs_unavailable_reason(self, tensors: Sequence[Any]) -> Optional[str]:
        """``None`` when these tensors can go through a CUDA graph, else why not.

        Typical reasons: a CPU build of the framework, no visible GPU, a CPU tensor.
        """

    @abc.abstractmethod
    def mode_key(self) -> Any:
        """A hashable summary of the framework state a capture bakes in (mixed precision)."""

    @abc.abstractmethod
    def static_like(self, tensor: Any) -> Any:
        """A new, uninitialised tensor with the same shape, dtype and device."""

    @abc.abstractmethod
    def copy_(self, dst: Any, src: Any) -> None:
        """Copy ``src`` into ``dst`` in place, on the current stream."""

    @abc.abstractmethod
    def copy_many(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        """``copy_`` for many pairs, in as few kernel launches as the framework allows."""

    @abc.abstractmethod
    def detach(self, tensor: Any, requires_grad: bool = False) -> Any:
        """An alias of ``tensor`` cut from autograd, tracked again if ``requires_grad``."""

    @abc.abstractmethod
    def clone_many(self, tensors: Sequence[Any]) -> list:
        """Fresh copies of ``tensors``, in as few kernel launches as the framework allows."""

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
        these were created on) are touched only by the outer autograd node.
        """

    @abc.abstractmethod
    def autograd_grad(self, outputs: Sequence[Any], grad_outputs: Sequence[Any],
                      inputs: Sequence[Any], retain_graph: bool = False) -> list:
        """Gradients of ``outputs`` w.r.t. ``inputs`` (``None`` where unused); frees the autograd
        graph's saved tensors unless ``retain_graph``."""

    #: True when autograd may make a tensor that others still hold a leaf's ``.grad`` (Paddle
    #: shares it); False when it copies any gradient it does not own outright (PyTorch).
    adopts_held_gradients: bool = True

    #: True when the runtime implements :meth:`add_many`, :meth:`grad_of`, :meth:`set_grad`,
    #: :meth:`zero_many` and :meth:`params_with_grad_hooks` (``accumulate_grads=True``).
    accumulates_grads_in_graph: bool = False

    def add_many(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        """``dst += src`` for each pair, capturable."""
        raise NotImplementedError(f"{self.name} runtime: add_many")

    def zero_many(self, tensors: Sequence[Any]) -> None:
        """Zero each tensor in place."""
        raise NotImplementedError(f"{self.name} runtime: zero_many")

    def grad_of(self, param: Any) -> Any:
        """``param``'s accumulated gradient, or ``None``."""
        raise NotImplementedError(f"{self.name} runtime: grad_of")

    def set_grad(self, param: Any, grad: Any) -> None:
        """Make ``grad`` the accumulated gradient of ``param``."""
        raise NotImplementedError(f"{self.name} runtime: set_grad")

    def params_with_grad_hooks(self, params: Sequence[Any]) -> list:
        """Indices of ``params`` whose gradient accumulation runs hooks (those must go through
        the framework's accumulation)."""
        raise NotImplementedError(f"{self.name} runtime: params_with_grad_hooks")

    @abc.abstractmethod
    def leaves_without_grad(self, tensors: Sequence[Any]) -> list:
        """Indices of the leaves requiring grad whose ``.grad`` is still unset."""

    @abc.abstractmethod
    def apply_graphed_function(self, call: Any, tensors: Sequence[Any], params: Sequence[Any]) -> tuple:
        """Run ``call.forward()`` inside the framework's custom autograd function.

        ``call.forward()`` returns the flat list of output tensors and sets
        ``call.differentiable`` (one bool per output). The function's backward passes the
        incoming gradients of the differentiable outputs to ``call.backward(grads)``, which
        returns one gradient (or ``None``) per entry of ``tensors + params``.
        Returns the output tensors as a tuple.
        """

    # --------------------------------------------------------- graph operations
    @abc.abstractmethod
    def create_graph(self) -> Any:
        """A new, empty graph object."""

    @abc.abstractmethod
    def new_pool(self) -> Any:
        """A handle to a new private memory pool that graphs can share."""

    @abc.abstractmethod
    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> ContextManager:
        """Capture the work issued inside the context into ``graph``.

        Capture runs on ``stream`` (the runtime's capture stream when ``None``),
        allocates from ``pool``, registers the default RNG generator, and uses the
        thread-local capture mode so other threads (NCCL watchdogs) are unaffected.
        """

    @abc.abstractmethod
    def replay_graph(self, graph: Any) -> None:
        """Launch a captured graph on the current stream."""

    @abc.abstractmethod
    def is_capturing(self) -> bool:
        """True when the current stream is capturing a graph."""

    @abc.abstractmethod
    def abort_capture(self) -> None:
        """End a capture that failed part-way, so the stream can be used again."""

    # ------------------------------------------------------------------ memory
    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for all work on the device."""

    @abc.abstractmethod
    def memory_stats(self) -> dict:
        """``{"reserved_bytes": int, "allocated_bytes": int}`` for the current device (zeros on CPU)."""

    @abc.abstractmethod
    def pool_memory(self, pools: Sequence[Any]) -> dict:
        """``{"reserved_bytes", "allocated_bytes"}`` held by the given graph pools together."""

    def async_allocator_active(self) -> bool:
        """True when the framework allocates with the stream-ordered allocator (cudaMallocAsync):
        graph pools are then ignored. Raises ``AllocatorSwitchError`` on a half-switch."""
        from ..allocator import async_allocator_active

        return async_allocator_active(self.name)

    @abc.abstractmethod
    def release_cached_memory(self) -> None:
        """Return cached, unused device memory to the driver (after a failed capture)."""



# Name -> module that defines ``RUNTIME`` (a GraphRuntime instance). Loaded on first use only.
_LOADERS: dict[str, str] = {
    "paddle": "paddle_graphpp.paddle.runtime",
    "torch": "paddle_graphpp.torch.runtime",
}
_LOADED: dict[str, GraphRuntime] = {}
_EXTRA: dict[str, Callable[[], GraphRuntime]] = {}


def available_runtimes() -> list[str]:
    """Names :func:`get_runtime` accepts."""
    return sorted(set(_LOADERS) | set(_EXTRA))


def register_runtime(name: str, factory: Callable[[], GraphRuntime]) -> None:
    """Add a runtime under ``name`` (used by tests to plug in a fake graph runtime)."""
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
    elif name in _LOADERS:
        runtime = importlib.import_module(_LOADERS[name]).RUNTIME
    else:
        raise ValueError(f"unknown runtime {name!r}; choose one of {available_runtimes()}")
    _LOADED[name] = runtime
    return runtime
