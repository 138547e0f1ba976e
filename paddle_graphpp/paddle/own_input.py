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
last, or where there are two terms in all. Which holds is read, not assumed: the block's first
training call runs eagerly with the router eager and unsplit, and hooks on the input's readers
record the order its backward runs them in; the router is graphed only once that order says the
split is exact, and otherwise stays eager, with one warning.
"""

from __future__ import annotations

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


class OwnInput:
    """``part`` (a sublayer of ``block``, graphed in place by ``graphed``) reading its own copy of
    ``block``'s input, judged on ``entry``'s first training call (``entry``: the pipeline entry
    holding ``block``, whose outputs the judgement walks back from). Made right after
    :func:`~.in_place.swap_in`; :meth:`remove` undoes it (the part's class is the caller's)."""

    def __init__(self, label: str, entry, block, part, graphed):
        self.label, self.part, self.graphed = label, part, graphed
        self.state = "probe"  # then "split" (graphed) or "eager" (judged inexact)
        self.why = ""  # why it stays eager
        self._probe = None  # the probe call's: {"input", "reads_input", "outputs"}
        self._ran = None  # the input's readers as the probe's backward runs them: [is the part's, ...]
        self._readers = 0
        self._copies = None
        ungraph_in_place([part])  # eager until judged
        self._handles = [block.register_forward_pre_hook(self._before_block),
                         part.register_forward_pre_hook(self._before_part),
                         part.register_forward_post_hook(self._after_part),
                         entry.register_forward_post_hook(self._after_entry)]

    def describe(self) -> str | None:
        """A line for the segmentation report while the part is not graphed; ``None`` once it is."""
        if self.state == "probe":
            return (f"{self.label}: eager until the backward of its layer's first training micro-batch shows the "
                    f"order its input's gradients are summed in")
        if self.state == "eager":
            return f"{self.label}: eager: {self.why}"
        return None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---------------------------------------------------------------- the hooks
    def _before_block(self, block, inputs):
        self._copies = None
        if self.state == "probe" and self._ran is not None and len(self._ran) == self._readers:
            self._judge()
        x = inputs[0] if inputs else None
        training = paddle.is_grad_enabled() and isinstance(x, paddle.Tensor) and not x.stop_gradient
        if not training:
            return None
        if self.state == "split":
            self._copies = _Split.apply(x)
            return (self._copies[0], *inputs[1:])
        if self.state == "probe" and self._probe is None:
            self._probe = {"input": x, "reads_input": False, "outputs": None}
        return None

    def _before_part(self, part, inputs):
        copies, self._copies = self._copies, None
        if copies is not None:
            if not inputs or inputs[0] is not copies[0]:
                raise RuntimeError(
                    f"{self.label}: it no longer reads its block's input (it did on the block's first training "
                    f"call), so its own copy cannot stand in for it; graph_pipeline(...).undo() and graph again")
            return (copies[1], *inputs[1:])
        probe = self._probe
        if probe is not None and probe["outputs"] is None and inputs:
            probe["reads_input"] = inputs[0] is probe["input"]
        return None

    def _after_part(self, part, inputs, outputs):
        probe = self._probe
        if probe is not None and probe["outputs"] is None:
            probe["outputs"] = outputs
        return None

    def _after_entry(self, entry, inputs, outputs):
        probe = self._probe
        if self.state != "probe" or probe is None or self._ran is not None or probe["outputs"] is None:
            return None
        why = self._watch(probe, outputs)
        if why is not None:
            self._give_up(why)
        self._probe = {"input": None, "reads_input": False, "outputs": ()}  # one probe
        return None

    # ---------------------------------------------------------------- the judgement
    def _watch(self, probe, outputs):
        """Hook the probe's input's readers so its backward records the order they run in; why the
        part cannot read a copy, if it cannot."""
        if not probe["reads_input"]:
            return "it reads something other than its block's input"
        producer = probe["input"].grad_fn
        if producer is None:
            return "its block's input has no gradient node of its own (a leaf tensor)"
        stop = producer.node_ptr()
        nodes = _reachable(_grad_nodes(outputs), stop)
        parts = _reachable(_grad_nodes(probe["outputs"]), stop)
        readers = [(node, sum(n.node_ptr() == stop for n in _next(node)))
                   for node in nodes.values() if any(n.node_ptr() == stop for n in _next(node))]
        own = [edges for node, edges in readers if node.node_ptr() in parts]
        if own != [1]:
            return "it reads its input more than once, or its gradient does not reach the layer's outputs"
        self._ran, self._readers = [], len(readers)
        for node, edges in readers:
            node._register_post_hook(self._recorder(node.node_ptr() in parts, edges))
        return None

    def _recorder(self, is_part: bool, edges: int):
        def record(grad_outputs, grad_inputs):
            self._ran.append((is_part, edges))
            return grad_outputs
        return record

    def _judge(self) -> None:
        """After the probe's backward: graph the part, reading its copy, if that sums as eagerly."""
        terms = sum(edges for _, edges in self._ran)
        if self._ran[-1][0] or terms <= 2:
            swap_in(self.part, self.graphed)
            self.state = "split"
        else:
            self._give_up(f"eager autograd adds its gradient to its input's before another reader's "
                          f"({terms} terms), which a graph of it cannot reproduce")

    def _give_up(self, why: str) -> None:
        self.state, self.why = "eager", why
        self.remove()
        warn(f"{self.label} stays eager: {why}; the rest of its layer stays graphed")
