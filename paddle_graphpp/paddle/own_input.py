"""A part graphed in place that reads its own copy of its block's input: :class:`OwnInput`.

Paddle's eager backward adds up the gradient of a tensor read by several operations in the order
those readers run, and it runs a node once every node that hands it a gradient has run (a
first-in, first-out queue, ``egr::RunBackward``). A mixture of experts' router graphed in place is
one node where eager had a chain of operations (a linear layer, a sigmoid or softmax, a top-k, a
normalisation): it becomes ready sooner, so the mixture's input would get the router's gradient
earlier in the sum than eagerly, and differ in the last bits.

So the router reads a copy of the mixture's input of its own, and the mixture's other readers
another: one node (:class:`_Split`) hands back the other readers' gradient, summed by Paddle in
eager's order, plus the router's, last. That equals eager's sum where eager adds the router's
last, or where there are two terms in all. Which holds is read, not assumed: until one of them has
had its backward, the block's training calls run the router eager and unsplit, with hooks on the
input's readers that record the order the backward runs them in; the router is graphed once that
order says the split is exact, and otherwise stays eager, with one warning. The judgement holds
for later calls where the input's readers are the same operations in each (PaddleFormers 1.2.0's
mixtures read it through one reshape for the experts, once in the router and once or twice in the
shared experts).
"""

from __future__ import annotations

import enum

import paddle
from paddle.autograd import PyLayer

from ..core.warn import warn
from .in_place import swap_in, ungraph_in_place

__all__ = ["OwnInput"]


class _Split(PyLayer):
    """Two copies of a block's input (the block's, the part's); the backward adds the part's
    gradient to the block's. Copies, not views: Paddle treats an output sharing its input's memory
    as the input changed in place."""

    @staticmethod
    def forward(ctx, x):
        return x.clone(), x.clone()

    @staticmethod
    def backward(ctx, block_grad, part_grad):
        if block_grad is None or part_grad is None:
            return part_grad if block_grad is None else block_grad
        return block_grad + part_grad


def _next(node):
    return [n for n in node.next_functions if n is not None]


def _reachable(starts, stop) -> dict:
    """``node_ptr() -> node`` of every node reached from ``starts`` without passing ``stop``."""
    found, stack = {}, list(starts)
    while stack:
        node = stack.pop()
        key = node.node_ptr()
        if key in found or key == stop:
            continue
        found[key] = node
        stack.extend(_next(node))
    return found


def _grad_nodes(obj) -> list:
    """The gradient nodes of the tensors in ``obj`` (a tensor, or a tuple / list of them)."""
    items = obj if isinstance(obj, (tuple, list)) else (obj,)
    return [t.grad_fn for t in items
            if isinstance(t, paddle.Tensor) and not t.stop_gradient and t.grad_fn is not None]


def _first_tensor(args, kwargs):
    """``(position or keyword, tensor)`` of a call's first tensor argument, or ``(None, None)``."""
    if args:
        return (0, args[0]) if isinstance(args[0], paddle.Tensor) else (None, None)
    for key, value in kwargs.items():
        if isinstance(value, paddle.Tensor):
            return key, value
    return None, None


def _replaced(args, kwargs, where, value):
    if where == 0:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, where: value}


class Judgement(enum.Enum):
    """Where an :class:`OwnInput` stands."""

    WATCHING = "watching"
    """Eager and reading the block's input, as in eager training, until a watched training call's
    backward has run and shown the order its input's gradients are summed in."""
    SPLIT = "split"
    """Graphed, reading its own copy: the order showed that the copy sums as eagerly."""
    EAGER = "eager"
    """Eager for good (``OwnInput.why``)."""


class _Watch:
    """One training call watched: its input and the part's outputs while it runs, then the order
    its backward runs the input's readers in."""

    def __init__(self, x):
        self.input, self.reads_input, self.outputs = x, False, None
        self.ran, self.readers = [], 0  # (is the part's, edges to the input) per reader, as run

    @property
    def complete(self) -> bool:
        return self.readers > 0 and len(self.ran) == self.readers


class OwnInput:
    """``part`` (a sublayer of ``block``, graphed in place by ``graphed``) reading its own copy of
    ``block``'s input, judged on ``entry``'s training calls (``entry``: the pipeline entry holding
    ``block``, whose outputs the judgement walks back from). Made right after
    :func:`~.in_place.swap_in`; :meth:`remove` undoes it (the part's class is the caller's)."""

    def __init__(self, label: str, entry, block, part, graphed):
        self.label, self.block, self.part, self.graphed = label, block, part, graphed
        self.state = Judgement.WATCHING
        self.why = ""  # why it stays eager
        self._call = None  # the watch of the call running now
        self._watched = []  # watches whose backward is still to run
        self._copies = None
        ungraph_in_place([part])  # eager until judged
        self._handles = [block.register_forward_pre_hook(self._before_block, with_kwargs=True),
                         block.register_forward_post_hook(self._after_block),
                         part.register_forward_pre_hook(self._before_part, with_kwargs=True),
                         part.register_forward_post_hook(self._after_part),
                         entry.register_forward_post_hook(self._after_entry)]

    def describe(self) -> str | None:
        """A line for the segmentation report while the part is not graphed; ``None`` once it is."""
        if self.state is Judgement.WATCHING:
            return (f"{self.label}: eager until the backward of a training micro-batch of its layer shows the "
                    f"order its input's gradients are summed in")
        if self.state is Judgement.EAGER:
            return f"{self.label}: eager: {self.why}"
        return None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._watched, self._call, self._copies = [], [], None, None

    # ---------------------------------------------------------------- the hooks
    def _before_block(self, block, args, kwargs):
        self._copies = None
        if self.state is Judgement.WATCHING:
            done = next((watch for watch in self._watched if watch.complete), None)
            if done is not None:
                self._judge(done)
        where, x = _first_tensor(args, kwargs)
        if not (block.training and paddle.is_grad_enabled() and x is not None and not x.stop_gradient):
            return None
        if self.state is Judgement.SPLIT:
            self._copies = _Split.apply(x)
            return _replaced(args, kwargs, where, self._copies[0])
        if self.state is Judgement.WATCHING:
            self._call = _Watch(x)
        return None

    def _after_block(self, block, inputs, outputs):
        self._copies = None  # the part's, if it was not called
        return None

    def _before_part(self, part, args, kwargs):
        copies, self._copies = self._copies, None
        where, x = _first_tensor(args, kwargs)
        if copies is not None:
            if x is not copies[0]:
                raise RuntimeError(
                    f"{self.label}: it no longer reads its block's input (it did when judged), so its own copy "
                    f"cannot stand in for it; graph_pipeline(...).undo() and graph again")
            return _replaced(args, kwargs, where, copies[1])
        if self.state is Judgement.SPLIT and paddle.is_grad_enabled() and x is not None and not x.stop_gradient:
            raise RuntimeError(
                f"{self.label}: called with a gradient-carrying input outside a training call of its block, or "
                f"its block's input was not found (its first tensor argument), so it cannot read its own copy and "
                f"its input's gradient would be summed in another order than eagerly; call the block as its "
                f"layer does, or graph_pipeline(...).undo()")
        watch = self._call
        if watch is not None and watch.outputs is None:
            watch.reads_input = x is watch.input
        return None

    def _after_part(self, part, inputs, outputs):
        watch = self._call
        if watch is not None and watch.outputs is None:
            watch.outputs = outputs
        return None

    def _after_entry(self, entry, inputs, outputs):
        watch, self._call = self._call, None
        if self.state is not Judgement.WATCHING or watch is None or watch.outputs is None:
            return None
        why = self._watch(watch, outputs)
        watch.input = watch.outputs = None  # counts from here on, no tensors
        if why is not None:
            self._give_up(why)
        else:
            self._watched.append(watch)
        return None

    # ---------------------------------------------------------------- the judgement
    def _watch(self, watch, outputs):
        """Hook the watched call's input's readers so its backward records the order they run in; why
        the part cannot read a copy, if it cannot."""
        if not watch.reads_input:
            return "it reads something other than its block's input"
        producer = watch.input.grad_fn
        if producer is None:
            return "its block's input has no gradient node of its own (a leaf tensor)"
        stop = producer.node_ptr()
        nodes = _reachable(_grad_nodes(outputs), stop)
        parts = _reachable(_grad_nodes(watch.outputs), stop)
        readers = [(node, sum(n.node_ptr() == stop for n in _next(node)))
                   for node in nodes.values() if any(n.node_ptr() == stop for n in _next(node))]
        own = [edges for node, edges in readers if node.node_ptr() in parts]
        if own != [1]:
            return "it reads its input more than once, or its gradient does not reach the layer's outputs"
        watch.readers = len(readers)
        for node, edges in readers:
            node._register_post_hook(self._recorder(watch, node.node_ptr() in parts, edges))
        return None

    @staticmethod
    def _recorder(watch, is_part: bool, edges: int):
        def record(grad_outputs, grad_inputs):
            watch.ran.append((is_part, edges))
            return grad_outputs
        return record

    def _judge(self, watch) -> None:
        """After a watched call's backward: graph the part, reading its copy, if that sums as eagerly."""
        self._watched = []
        terms = sum(edges for _, edges in watch.ran)
        if watch.ran[-1][0] or terms <= 2:
            swap_in(self.part, self.graphed)
            self.state = Judgement.SPLIT
        else:
            self._give_up(f"eager autograd adds its gradient to its input's before another reader's "
                          f"({terms} terms), which a graph of it cannot reproduce")

    def _give_up(self, why: str) -> None:
        self.state, self.why = Judgement.EAGER, why
        self.remove()
        warn(f"{self.label} stays eager: {why}; the rest of its layer stays graphed")
