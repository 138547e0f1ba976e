"""A tiny framework of its own, over numpy, and a fake graph runtime for it: the engine's
bookkeeping tested with neither torch nor paddle installed.

The framework is just enough for the engine: a :class:`Tensor` (numpy array, ``requires_grad``,
``.grad``, an address), a handful of differentiable operations, reverse-mode autograd
(:func:`backward` accumulates into leaves' ``.grad``, :func:`grad` returns gradients), a
:class:`Module` with parameters and a :class:`Linear` layer.

Autograd in short: each operation that sees a tensor requiring grad (with grad mode on) gives
its result a node holding its inputs and a backward function. A pass runs the nodes that lead
to the wanted tensors, in reverse topological order; a node's outputs that got no gradient get
zeros. A gradient reaching a tensor through one edge is passed on as the same object (so the
engine can recognise a gradient one graphed layer hands another). A leaf with no ``.grad``
adopts the gradient it receives when nothing else got that tensor in the pass (else a copy);
one with a ``.grad`` adds into it in place. Without ``retain_graph`` a pass frees the nodes it ran.

The runtimes (:class:`PlainRuntime`, :class:`NoFrameworkRuntime`) use the fake graph semantics
of ``unittests/fake_graphs.py``: "capture" runs the body eagerly and marks the graph captured,
"replay" only counts; values after a replay are stale. Bookkeeping only: what is captured,
replayed, in which order, with which buffers, and which errors. Nothing here imports torch or
paddle (``test_core_nofw.py`` checks it).
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from typing import Any, Optional, Sequence

import numpy as np

from fake_graphs import FakeGraphs
from paddle_graphpp.core.engine import EngineOptions, GraphedCallable, node_backward, node_forward
from paddle_graphpp.core.runtime import (GradientOps, GraphRuntime, InGraphAccumulation, PoolLending, SplitBackward,
                                         StateSlots, TensorSpec)
from paddle_graphpp.core.state import module_state_slots

__all__ = ["Tensor", "Parameter", "Module", "Linear", "ones", "randn", "manual_seed",
           "no_grad", "enable_grad", "is_grad_enabled", "backward", "grad", "weight_pass", "on_backward",
           "PlainRuntime", "NoFrameworkRuntime", "LendingRuntime", "Graphed"]

DTYPE = np.float32
_ALIGN = 512  # bytes between buffers carved from one block


# ------------------------------------------------------------------ grad mode and randomness
class _Mode:
    grad_enabled = True
    weight_pass = False  # inside weight_pass(): a weight pass that puts gradients back into .grad


_rng = np.random.default_rng(0)


def manual_seed(seed: int) -> None:
    global _rng
    _rng = np.random.default_rng(seed)


@contextlib.contextmanager
def _grad_mode(enabled: bool):
    before, _Mode.grad_enabled = _Mode.grad_enabled, enabled
    try:
        yield
    finally:
        _Mode.grad_enabled = before


def no_grad():
    return _grad_mode(False)


def enable_grad():
    return _grad_mode(True)


def is_grad_enabled() -> bool:
    return _Mode.grad_enabled


# ------------------------------------------------------------------ tensors
class Tensor:
    """A numpy array with autograd attributes. ``grad_fn`` is the node that made it (``None``
    for a leaf), ``output_nr`` which of that node's outputs it is."""

    def __init__(self, array, requires_grad: bool = False):
        self.array = np.asarray(array)
        self.requires_grad = bool(requires_grad)
        self.grad: Optional[Tensor] = None
        self.grad_fn: Optional[Node] = None
        self.output_nr = 0
        self.post_accumulate_grad_hooks: list = []

    # description
    shape = property(lambda self: tuple(self.array.shape))
    dtype = property(lambda self: str(self.array.dtype))
    device = "cpu"
    is_leaf = property(lambda self: self.grad_fn is None)

    def __repr__(self) -> str:
        return f"nofw.Tensor({self.array!r}, requires_grad={self.requires_grad})"

    def data_ptr(self) -> int:
        """The address of the first element."""
        return self.array.__array_interface__["data"][0]

    def storage_ptr(self) -> int:
        """The address of the block this tensor's memory belongs to (the base of its views)."""
        base = self.array
        while isinstance(base.base, np.ndarray):
            base = base.base
        return base.__array_interface__["data"][0]

    def detach(self) -> "Tensor":
        return Tensor(self.array)

    def numpy(self) -> np.ndarray:
        return self.array.copy()

    def register_post_accumulate_grad_hook(self, hook) -> None:
        """``hook(tensor)`` after a backward pass accumulated into this leaf's ``.grad``."""
        self.post_accumulate_grad_hooks.append(hook)

    # operations
    def __add__(self, other):
        other = _as_tensor(other)
        a, b = self.shape, other.shape
        return _op(self.array + other.array, (self, other), lambda g: (_unbroadcast(g, a), _unbroadcast(g, b)))

    __radd__ = __add__

    def __sub__(self, other):
        return self + (-_as_tensor(other))

    def __neg__(self):
        return _op(-self.array, (self,), lambda g: (-g,))

    def __mul__(self, other):
        other = _as_tensor(other)
        x, y = self.array, other.array
        return _op(x * y, (self, other), lambda g: (_unbroadcast(g * y, x.shape), _unbroadcast(g * x, y.shape)))

    __rmul__ = __mul__

    def __matmul__(self, other):
        x, w = self.array, other.array
        return _op(x @ w, (self, other), lambda g: (g @ w.T, x.T @ g))

    def tanh(self):
        y = np.tanh(self.array)
        return _op(y, (self,), lambda g: (g * (1 - y * y),))

    def sum(self):
        shape = self.array.shape
        return _op(self.array.sum(), (self,), lambda g: (np.broadcast_to(g, shape).copy(),))

    def mean(self):
        shape, n = self.array.shape, self.array.size
        return _op(self.array.mean(), (self,), lambda g: (np.broadcast_to(g / n, shape).copy(),))

    def square(self):
        return self * self


class Parameter(Tensor):
    def __init__(self, array):
        super().__init__(np.asarray(array, dtype=DTYPE), requires_grad=True)


def ones(*shape, requires_grad: bool = False) -> Tensor:
    return Tensor(np.ones(shape, dtype=DTYPE), requires_grad=requires_grad)


def randn(*shape, requires_grad: bool = False) -> Tensor:
    return Tensor(_rng.standard_normal(shape).astype(DTYPE), requires_grad=requires_grad)


def _as_tensor(x) -> Tensor:
    return x if isinstance(x, Tensor) else Tensor(np.asarray(x, dtype=DTYPE))


def _unbroadcast(g: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum ``g`` over the dimensions broadcasting added to ``shape``."""
    while g.ndim > len(shape):
        g = g.sum(axis=0)
    for axis, n in enumerate(shape):
        if n == 1 and g.shape[axis] != 1:
            g = g.sum(axis=axis, keepdims=True)
    return g


# ------------------------------------------------------------------ autograd
class Node:
    """One operation of the autograd graph: its inputs and how to take their gradients."""

    def __init__(self, inputs: Sequence[Tensor], shapes: Sequence[tuple]):
        self.inputs = tuple(inputs)
        self.shapes = tuple(shapes)  # of its outputs, for the zeros an output without gradient gets
        self.freed = False

    def apply(self, grads: list, needs: list) -> list:
        """One gradient (or ``None``) per input, from one gradient per output."""
        raise NotImplementedError

    def release(self) -> None:
        self.freed = True


class _OpNode(Node):
    def __init__(self, inputs, shape, backward_fn):
        super().__init__(inputs, [shape])
        self.backward_fn = backward_fn

    def apply(self, grads, needs):
        got = self.backward_fn(grads[0].array)
        # copies: an operation may hand one array to two inputs, and a leaf may adopt what it gets
        return [Tensor(np.array(g, dtype=DTYPE)) if n else None for g, n in zip(got, needs)]

    def release(self):
        super().release()
        self.backward_fn = None  # the arrays it saved


def _op(array, inputs, backward_fn) -> Tensor:
    out = Tensor(np.asarray(array, dtype=DTYPE))
    if _Mode.grad_enabled and any(t.requires_grad for t in inputs):
        out.requires_grad = True
        out.grad_fn = _OpNode(inputs, out.shape, backward_fn)
    return out


def _sum(grads: list) -> Tensor:
    """One tensor for several gradients of one place; a single one is passed on as it is."""
    if len(grads) == 1:
        return grads[0]
    return Tensor(np.sum([g.array for g in grads], axis=0).astype(DTYPE))


class _Pass:
    """One backward pass (see :func:`_run`). A class, not closures: closures that call each
    other form reference cycles, which would keep the pass's tensors until a garbage collection."""

    def __init__(self, wrt: Optional[Sequence[Tensor]], accumulate: bool):
        self.wanted = None if wrt is None else {id(t): i for i, t in enumerate(wrt)}
        self.accumulate = accumulate
        self.results: list = [[] for _ in (wrt or ())]
        self.leaves: dict = {}  # id(leaf) -> (leaf, [gradients])
        self.delivered: Counter = Counter()  # id(gradient) -> places it went to
        self.memo: dict = {}  # node -> does it lead to a wanted tensor
        self.pending: dict = {}  # node -> per output, the gradients it received

    def leads(self, t: Optional[Tensor]) -> bool:
        if t is None or not t.requires_grad:
            return False
        if self.wanted is not None and id(t) in self.wanted:
            return True
        if t.grad_fn is not None:
            return self.needed(t.grad_fn)
        return self.wanted is None and self.accumulate

    def needed(self, node: Node) -> bool:
        if node not in self.memo:
            self.memo[node] = False  # (a graph has no cycles; this guards the recursion anyway)
            self.memo[node] = any(self.leads(t) for t in node.inputs)
        return self.memo[node]

    def order(self, roots: Sequence[Tensor]) -> list:
        """The nodes to run, each after every node that feeds it gradients (reversed post-order
        of a depth-first walk)."""
        post, seen = [], set()
        for root in roots:
            if root.grad_fn is None or root.grad_fn in seen or not self.needed(root.grad_fn):
                continue
            seen.add(root.grad_fn)
            stack = [(root.grad_fn, iter(root.grad_fn.inputs))]
            while stack:
                node, rest = stack[-1]
                nxt = next((t.grad_fn for t in rest if t is not None and t.grad_fn is not None
                            and t.grad_fn not in seen and self.needed(t.grad_fn)), None)
                if nxt is None:
                    stack.pop()
                    post.append(node)
                else:
                    seen.add(nxt)
                    stack.append((nxt, iter(nxt.inputs)))
        return post[::-1]

    def deliver(self, t: Tensor, g: Optional[Tensor]) -> None:
        if g is None or not self.leads(t):
            return
        self.delivered[id(g)] += 1
        wanted = self.wanted
        if wanted is not None and id(t) in wanted:
            if self.accumulate:
                self.leaves.setdefault(id(t), (t, []))[1].append(g)
            else:
                self.results[wanted[id(t)]].append(g)
            if t.grad_fn is None or not self.needed(t.grad_fn):
                return
        if t.grad_fn is not None:
            self.pending.setdefault(t.grad_fn, [[] for _ in t.grad_fn.shapes])[t.output_nr].append(g)
        elif wanted is None:
            self.leaves.setdefault(id(t), (t, []))[1].append(g)

    def run(self, roots, root_grads, retain_graph: bool) -> None:
        order = self.order(roots)
        for root, g in zip(roots, root_grads):
            if g is None:
                if root.array.size != 1:
                    raise RuntimeError("grad can be implicitly created only for scalar outputs")
                g = Tensor(np.ones(root.shape, dtype=DTYPE))
            self.delivered[id(g)] += 1  # the caller's: never adopted by a leaf
            self.deliver(root, g)
        for node in order:
            got = self.pending.pop(node, None)
            if got is None:
                continue
            if node.freed:
                raise RuntimeError("Trying to backward through the graph a second time; pass retain_graph=True "
                                   "to the first backward")
            grads = [_sum(gs) if gs else Tensor(np.zeros(shape, dtype=DTYPE)) for gs, shape in zip(got, node.shapes)]
            needs = [self.leads(t) for t in node.inputs]
            out = node.apply(grads, needs)
            if not retain_graph:
                node.release()
            for t, g, need in zip(node.inputs, out, needs):
                if need:
                    self.deliver(t, g)

    def into_leaves(self) -> None:
        for leaf, gs in self.leaves.values():
            total = _sum(gs)
            if leaf.grad is None:
                adopt = len(gs) == 1 and self.delivered[id(total)] == 1
                leaf.grad = total if adopt else Tensor(total.array.copy())
            else:
                leaf.grad.array += total.array
            for hook in leaf.post_accumulate_grad_hooks:
                hook(leaf)


def _run(roots: Sequence[Tensor], root_grads: Sequence[Optional[Tensor]], wrt: Optional[Sequence[Tensor]], *,
         accumulate: bool, retain_graph: bool) -> Optional[list]:
    """One backward pass from ``roots``. ``wrt``: the tensors wanted (``None``: every leaf that
    requires grad). ``accumulate``: into the wanted leaves' ``.grad`` (returns ``None``), else
    the wanted tensors' gradients are returned. Leaves' ``.grad`` change only once the whole
    pass has run (a pass that raises changes none)."""
    work = _Pass(wrt, accumulate)
    with no_grad():
        work.run(roots, root_grads, retain_graph)
    if not accumulate:
        return [_sum(gs) if gs else None for gs in work.results]
    work.into_leaves()
    return None


def _listed(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def backward(tensors, grad_tensors=None, *, inputs=None, retain_graph: bool = False) -> None:
    """Accumulate the gradients of ``tensors`` into the ``.grad`` of every leaf (or of ``inputs``)."""
    tensors = _listed(tensors)
    grads = _listed(grad_tensors) if grad_tensors is not None else [None] * len(tensors)
    _run(tensors, grads, None if inputs is None else _listed(inputs), accumulate=True, retain_graph=retain_graph)


def grad(outputs, inputs, grad_outputs=None, *, retain_graph: bool = False) -> list:
    """The gradients of ``outputs`` w.r.t. ``inputs`` (``None`` where unused), as torch.autograd.grad
    with ``allow_unused=True``."""
    outputs = _listed(outputs)
    grads = _listed(grad_outputs) if grad_outputs is not None else [None] * len(outputs)
    return _run(outputs, grads, _listed(inputs), accumulate=False, retain_graph=retain_graph)


def weight_pass(loss, params) -> None:
    """A zero-bubble schedule's weight pass (after an input pass ``backward(loss, inputs=[x],
    retain_graph=True)``): the parameters' gradients of ``loss``, put into their ``.grad``."""
    before, _Mode.weight_pass = _Mode.weight_pass, True
    try:
        backward(loss, inputs=list(params))
    finally:
        _Mode.weight_pass = before


class _HookNode(Node):
    def __init__(self, x, callback):
        super().__init__([x], [x.shape])
        self.callback = callback

    def apply(self, grads, needs):
        self.callback()
        return [grads[0]]


def on_backward(x: Tensor, callback) -> Tensor:
    """``x`` itself, whose backward calls ``callback()`` first (a test's stand-in for work
    that fails only in some backwards)."""
    out = Tensor(x.array)
    if _Mode.grad_enabled and x.requires_grad:
        out.requires_grad, out.grad_fn = True, _HookNode(x, callback)
    return out


# ------------------------------------------------------------------ modules
class Module:
    """Parameters and submodules in ``_parameters`` / ``_modules`` dicts (what the engine's state
    check reads), ``training`` mode, ``forward``."""

    def __init__(self):
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        for table in (self._parameters, self._modules):
            table.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name):
        for table in ("_parameters", "_modules"):
            found = self.__dict__.get(table, {})
            if name in found:
                return found[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def named_modules(self, prefix: str = ""):
        yield prefix, self
        for name, sub in self._modules.items():
            yield from sub.named_modules(f"{prefix}.{name}" if prefix else name)

    def parameters(self) -> list:
        seen, out = set(), []
        for _, module in self.named_modules():
            for p in module._parameters.values():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def train(self, mode: bool = True) -> "Module":
        for _, module in self.named_modules():
            object.__setattr__(module, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None


class Linear(Module):
    """``x @ weight + bias`` (``weight`` is ``in x out``)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = Parameter(randn(n_in, n_out).array / math.sqrt(n_in))
        self.bias = Parameter(np.zeros(n_out, dtype=DTYPE))

    def forward(self, x):
        return x @ self.weight + self.bias


# ------------------------------------------------------------------ the runtime
class _GraphedNode(Node):
    """The autograd node of one graphed call (the custom function; the logic is the core's)."""

    def __init__(self, inputs):
        super().__init__(inputs, [])
        self.frozen: list = []

    def mark_non_differentiable(self, *tensors) -> None:
        self.frozen.extend(tensors)

    def apply(self, grads, needs):
        n = len(self.call.shape.specs)
        # Asking for no parameter gradient (an input pass) runs the input half of a split backward.
        return node_backward(self, grads, weights_wanted=any(needs[n:]))

    def release(self):
        pass  # the call stays: a second backward must reach the engine's FIFO check and fail there


class PlainRuntime(FakeGraphs, GraphRuntime, StateSlots, GradientOps):
    """The required protocol over :class:`Tensor`, with fake graphs, and the two capabilities
    every runtime of a real framework has: the state check and gradient operations (the latter
    needed since its autograd adopts held gradients)."""

    name = "nofw"
    # A leaf adopts a gradient it is handed alone (see the module docstring): the engine hands
    # copies where the tensor is one of its own buffers.
    adopts_held_gradients = True

    def __init__(self):
        super().__init__()
        self.generators_registered: list = []  # per capture: the generators it was asked to register
        self.captured: list = []  # graphs, in the order their captures ended
        self.replayed: list = []  # graphs, in the order they were replayed

    # tensors
    def is_tensor(self, obj) -> bool:
        return isinstance(obj, Tensor)

    def spec(self, tensor) -> TensorSpec:
        return TensorSpec(tensor.shape, tensor.dtype, tensor.device, tensor.requires_grad)

    def alias_key(self, tensor):
        return (tensor.data_ptr(), tensor.shape, tensor.array.strides, tensor.dtype, tensor.device)

    def static_like(self, tensor):
        return Tensor(np.zeros_like(tensor.array))  # zeros: stale replays compute on finite values

    def static_buffers(self, specs) -> list:
        sizes = [math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in specs]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        block = np.zeros(max(total, 1), dtype=np.uint8)
        return [Tensor(block[start:start + n].view(s.dtype).reshape(s.shape))
                for s, start, n in zip(specs, offsets, sizes)]

    def copy_many(self, dsts, srcs) -> None:
        for d, s in zip(dsts, srcs):
            if d.data_ptr() != s.data_ptr():
                np.copyto(d.array, s.array)

    def add_many(self, dsts, srcs) -> None:
        for d, s in zip(dsts, srcs):
            d.array += s.array

    def detach(self, tensor, requires_grad: bool = False):
        return Tensor(tensor.array, requires_grad=requires_grad)

    # framework state
    def state_slots(self, layer) -> list:
        return module_state_slots(layer.named_modules()) if isinstance(layer, Module) else []

    def storage_addresses(self, tensors) -> list:
        return [t.data_ptr() for t in tensors]

    # autograd
    def grad_enabled(self) -> bool:
        return is_grad_enabled()

    def enable_grad(self):
        return enable_grad()

    def call_with_param_aliases(self, fn, params, args, kwargs):
        if not params or not isinstance(fn, Module):
            return fn(*args, **kwargs), list(params)
        aliases = {id(p): Tensor(p.array, requires_grad=True) for p in params}
        swapped = [(m._parameters, k, p) for _, m in fn.named_modules() for k, p in m._parameters.items()
                   if id(p) in aliases]
        for holder, k, p in swapped:
            holder[k] = aliases[id(p)]
        try:
            return fn(*args, **kwargs), [aliases[id(p)] for p in params]
        finally:
            for holder, k, p in swapped:
                holder[k] = p

    def autograd_grad(self, outputs, grad_outputs, inputs, retain_graph: bool = False) -> list:
        if not inputs:
            return []
        return grad(list(outputs), list(inputs), list(grad_outputs), retain_graph=retain_graph)

    def apply_graphed_function(self, call, tensors, params) -> tuple:
        node = _GraphedNode([*tensors, *params])
        with no_grad():  # as a custom function's forward: the engine enables grad where it records
            outputs = node_forward(node, call)
        node.shapes = tuple(o.shape for o in outputs)
        tracked = any(t.requires_grad for t in node.inputs)
        for i, o in enumerate(outputs):
            # the outputs are the engine's own new tensor objects: they become the node's outputs
            if tracked and not any(o is f for f in node.frozen):
                o.requires_grad, o.grad_fn, o.output_nr = True, node, i
        return outputs

    def leaves_without_grad(self, tensors) -> list:
        return [i for i, t in enumerate(tensors) if t.requires_grad and t.is_leaf and t.grad is None]

    # graph operations
    @contextlib.contextmanager
    def capture_to_graph(self, graph, pool=None, stream=None, generators=()):
        self.generators_registered.append(tuple(generators))
        with super().capture_to_graph(graph, pool, stream, generators):
            yield graph
        self.captured.append(graph)

    def replay_graph(self, graph) -> None:
        super().replay_graph(graph)
        self.replayed.append(graph)


class NoFrameworkRuntime(PlainRuntime, SplitBackward, InGraphAccumulation):
    """:class:`PlainRuntime` with split backwards (zero-bubble schedules) and gradient
    accumulation inside graphs, the capabilities PyTorch's runtime has."""

    refilling_weight_pass = "nofw.weight_pass"

    # split backward: the input half keeps the outputs and their gradients; the weight half
    # differentiates them again w.r.t. the parameters (a fake: it recomputes, bookkeeping only)
    def backward_input(self, outputs, grad_outputs, inputs, params):
        got = grad(list(outputs), list(inputs), list(grad_outputs), retain_graph=True) if inputs else []
        return got, [None] * len(params), (list(outputs), list(grad_outputs))

    def backward_weight(self, state, params):
        outputs, grads = state
        got = grad(outputs, list(params), grads)
        del state, outputs, grads
        for i, g in enumerate(got):  # one parameter at a time, as the caller moves each batch
            if g is not None:
                yield [i], [g]

    def weight_pass_refills_grad(self) -> bool:
        return _Mode.weight_pass

    # accumulation inside graphs
    def zero_many(self, tensors) -> None:
        for t in tensors:
            t.array[...] = 0

    def grad_of(self, param):
        return param.grad

    def set_grad(self, param, grad_) -> None:
        param.grad = grad_

    def params_with_grad_hooks(self, params) -> list:
        return [i for i, p in enumerate(params) if p.post_accumulate_grad_hooks]

    def backward_to_grads(self, outputs, grad_outputs, inputs, aliases, params) -> list:
        got = grad(list(outputs), [*inputs, *aliases], list(grad_outputs))
        n = len(inputs)
        for p, g in zip(params, got[n:]):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.array += g.array
        return got[:n]

    def backward_into(self, outputs, grad_outputs, inputs, params, buffers, *, accumulate, retain_graph=False):
        got = grad(list(outputs), [*inputs, *params], list(grad_outputs), retain_graph=retain_graph)
        n = len(inputs)
        used = [g is not None for g in got[n:]]
        pairs = [(b, g) for b, g in zip(buffers, got[n:]) if g is not None]
        (self.add_many if accumulate else self.copy_many)([b for b, _ in pairs], [g for _, g in pairs])
        return got[:n], used


class LendingRuntime(NoFrameworkRuntime, PoolLending):
    """:class:`NoFrameworkRuntime` that lends its pool to eager work between steps and asks the
    engine to wait before capturing as long as ``waits`` (reasons, then ``None``) says so."""

    def __init__(self, waits=()):
        super().__init__()
        self.waits = iter(waits)
        self.lent: list = []  # pools lent, in order
        self.prepared: list = []  # pools prepared before their first capture

    def defer_capture(self) -> Optional[str]:
        return next(self.waits, None)

    def prepare_pool(self, pool) -> int:
        self.prepared.append(pool)
        return 0

    def lend_pool(self, pool, is_idle, on_leak) -> None:
        self.lent.append(pool)

    def release_pool(self, pool) -> None:
        pass


class Graphed(Module):
    """The shape of a framework's graphed layer class over a runtime of the test's choosing:
    ``module`` behind a :class:`~paddle_graphpp.core.engine.GraphedCallable`."""

    def __init__(self, module: Module, runtime: GraphRuntime, **opts: Any):
        super().__init__()
        self.module = module
        self.engine = GraphedCallable(module, runtime, module.parameters, name=f"test:{type(module).__name__}",
                                      options=EngineOptions(**opts))

    def forward(self, *args, **kwargs):
        return self.engine(args, kwargs)


def step(layer, order: str = "f1 b1", shape: tuple = (2, 4)) -> dict:
    """Run an order like 'f1 f2 b1 b2' (forwards and backwards of numbered micro-batches) through
    ``layer``; an output is dropped once its backward ran, as pipeline schedules do. Returns the
    outputs whose backward did not run."""
    outs = {}
    for tok in order.split():
        n = int(tok[1:])
        if tok[0] == "f":
            outs[n] = layer(randn(*shape, requires_grad=True))
        else:
            backward(outs.pop(n).sum())
    return outs
