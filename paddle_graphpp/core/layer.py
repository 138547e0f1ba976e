"""One graphed layer as the engine's parts see it: what it is, fixed when its engine is made.

:class:`Layer` is the narrow view each part of a :class:`~paddle_graphpp.core.engine.GraphedCallable`
is given at construction (its name, wrapped call, runtime, options, the process's services); a
front door's additions come in :class:`EngineHooks`, given then too and never assigned later.
:class:`GradBuffers` holds the layer's parameter-gradient buffers, which its captures write and
its backward replays hand out.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

from .errors import SignatureError, StateReplacedError
from .grad_owners import GradPath
from .records import Outputs
from .tree import flatten

__all__ = ["EngineHooks", "hooks_for", "Layer", "GradBuffers"]


@dataclass(frozen=True, slots=True)
class EngineHooks:
    """What a front door adds to a layer's engine, given when the engine is made."""

    #: Entered around each capture of the layer: the layer as its graphs read it (a front door
    #: gives one where the layer's parameters are swapped out between calls, as FSDP2 does).
    capture_view: Callable[[], ContextManager] = contextlib.nullcontext
    #: Whether a call recomputes its forward in the backward (activation checkpointing), read per
    #: call; ``None``: the ``recompute`` option.
    recomputes: Optional[Callable[[], bool]] = None
    #: What to say when a capture of the layer fails, given the error (``None``: nothing to add;
    #: the runtime's hint and the general one follow). A front door gives one where a library
    #: explains the layer's failure better than the runtime can.
    capture_hint: Optional[Callable[[BaseException], Optional[str]]] = None
    #: Another way on when a capture of the layer fails, given the error: what the front door
    #: will do instead (said in one warning; the layer runs eagerly until the front door
    #: replaces it), or ``None`` when it has none (then the ``fallback`` option decides). A
    #: front door gives one where it can graph the layer differently and exactly (a mixture of
    #: experts' block graphed around its experts).
    another_way: Optional[Callable[[BaseException], Optional[str]]] = None
    #: The layer's parameters whose gradient autograd also gets from outside the layer in the same
    #: backward (another module's parameter a front door registers as the layer's, as the
    #: embedding's weight handed to an output layer), read when a signature leaves warmup. Graphs
    #: that hold one leave accumulation to autograd, which sums every part of a gradient before
    #: adding it to ``.grad``, as eagerly.
    summed_outside: Callable[[], Sequence[Any]] = tuple


def hooks_for(wrapped: Any, name: str, options: Any, default: EngineHooks) -> EngineHooks:
    """The hooks of the engine that graphs ``wrapped``: what ``wrapped.graph_engine_hooks(name,
    options)`` returns where a front door's wrapper defines it (it runs in place of a block and
    knows how that block is viewed and recomputed), else ``default``."""
    make = getattr(wrapped, "graph_engine_hooks", None)
    return make(name, options) if make is not None else default


@dataclass(frozen=True, slots=True)
class Layer:
    """What one graphed layer is: ``name`` (in messages), its wrapped call ``fn``, its runtime
    and that runtime's capabilities (``caps``), its ``options`` and memory mode, ``params()``
    (its trainable parameters, read while a signature warms up), its ``hooks``, and
    ``process()``, the process's services (renewed with its memory plan)."""

    name: str
    fn: Callable
    runtime: Any
    caps: Any
    options: Any
    memory_mode: Any
    params: Callable[[], list]
    hooks: EngineHooks
    process: Callable[[], Any]

    def generators(self) -> tuple:
        """The generators named by the ``generators`` option, read at each capture."""
        chosen = self.options.generators
        if chosen is None:
            return ()
        return tuple(chosen() if callable(chosen) else chosen)

    def outputs_of(self, result: Any) -> tuple:
        """The output structure of ``result`` and its tensors."""
        rt = self.runtime
        leaves, spec = flatten(result)
        index = tuple(i for i, x in enumerate(leaves) if rt.is_tensor(x))
        if not index:
            raise SignatureError(f"{self.name}: the wrapped layer returned no tensor; a graphed layer "
                                 f"must return at least one tensor.")
        tensors = [leaves[i] for i in index]
        shape = Outputs(tuple(None if i in index else x for i, x in enumerate(leaves)), spec, index,
                        tuple(rt.spec(t).requires_grad for t in tensors))
        return shape, tensors


class GradBuffers:
    """A layer's parameter-gradient buffers (made at its first capture, or the library's own
    that its accumulation hooks add into: :meth:`follow`) and the buffers a split backward's
    weight half writes without accumulation."""

    def __init__(self, runtime: Any):
        self.runtime = runtime
        self.params: Optional[list] = None
        self.weights: Optional[list] = None
        #: Where the graphs of the layer's signatures past warmup put parameter gradients (they
        #: share these buffers, so all put them in one place); ``None`` before the first.
        self.path: Optional[GradPath] = None
        self._checked: Any = None  # the episode the hooked buffers were last found unchanged in
        self._addresses: list = []  # where the hooked buffers were when the graphs began adding into them

    @property
    def hooked(self) -> bool:
        """The graphs add into the buffers a library's accumulation hooks add into (Megatron-Core's
        ``main_grad``) and hand autograd zeros, so that the hooks still run."""
        return self.path is GradPath.HOOKED

    def follow(self, path: GradPath, params: Sequence[Any]) -> None:
        """A signature leaves warmup putting gradients on ``path``: with :attr:`GradPath.HOOKED`
        the graphs add them into the parameters' library's own buffers
        (``InGraphAccumulation.hooked_buffer``)."""
        if path is GradPath.HOOKED and not self.hooked:
            self.params, self._checked = [self.runtime.hooked_buffer(p) for p in params], None
            self._addresses = self.runtime.storage_addresses(self.params)
        self.path = path

    def check_hooked(self, params: Sequence[Any], episode: Any, name: str) -> None:
        """Raise :class:`~paddle_graphpp.StateReplacedError` when a parameter's library buffer is
        no longer the one the graphs add into (checked once per episode)."""
        if self._checked == episode:
            return
        rt = self.runtime
        now = rt.storage_addresses(self.params)
        for i, (p, b, at, was) in enumerate(zip(params, self.params, now, self._addresses)):
            if rt.hooked_buffer(p) is not b or at != was:
                raise StateReplacedError(
                    f"{name}: the buffer that parameter {i}'s accumulation hook adds its gradient into "
                    f"(Megatron-Core's main_grad) was replaced or moved (an offload to the host and back) since the "
                    f"layer's CUDA graphs were captured to add into it. Call paddle_graphpp.reset_graphs(model) after "
                    f"rebuilding the data-parallel wrapper or moving its gradient buffers.")
        self._checked = episode

    def for_params(self, params: Sequence[Any]) -> list:
        """The parameter-gradient buffers, one per parameter of ``params``."""
        if self.params is None or len(self.params) != len(params):
            self.params = [self.runtime.static_like(p) for p in params]
        return self.params

    def for_weights(self, params: Sequence[Any]) -> list:
        """The weight half's buffers, one per parameter of ``params``."""
        if self.weights is None or len(self.weights) != len(params):
            self.weights = [self.runtime.static_like(p) for p in params]
        return self.weights

    def reset(self) -> None:
        self.params = self.weights = None
        self.path, self._checked, self._addresses = None, None, []
