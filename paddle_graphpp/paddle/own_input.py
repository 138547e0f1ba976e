"""Parts graphed in place that read their own copies of their block's input: :class:`OwnInput`.

Paddle's eager backward adds up the gradient of a tensor read by several operations in the order
those readers run, and it runs a node once every node that hands it a gradient has run (a
first-in, first-out queue, ``egr::RunBackward``). A mixture of experts' router graphed in place is
one node where eager had a chain of operations (a linear layer, a sigmoid or softmax, a top-k, a
normalisation): it becomes ready sooner, so the mixture's input would get the router's gradient
earlier in the sum than eagerly, and differ in the last bits. A graphed shared expert is one node
in place of its projections: the same holds.

So each graphed part reads a copy of the mixture's input of its own, and the mixture's other
readers one more: one node (:class:`_Split`) adds the copies' gradients up in an order of its
own. That equals eager's sum where eager's terms, taken in the order it adds them, fall into the
copies' groups one after another, every group after the first a single term (a part reading the
input twice, as a shared expert's two projections do, sums its two inside its graph, in either
order alike). Which holds is read, not assumed: until one has had its backward, the block's
training calls run the parts eager and unsplit, with hooks on the input's readers that record the
order the backward runs them in; the largest set of parts for which the order says the copies
sum as eagerly is graphed, and any other part stays eager, with one warning. The judgement holds
for later calls where the input's readers are the same operations in each (PaddleFormers 1.2.0's
mixtures read it through one reshape for the experts, once in the router and once or twice in the
shared experts).
"""

from __future__ import annotations

import enum
import itertools

import paddle
from paddle.autograd import PyLayer

from ..core.warn import warn
from .in_place import swap_in, ungraph_in_place

__all__ = ["OwnInput"]


class _Split(PyLayer):
    """Copies of a block's input, one per reader group (the block's other readers first, then each
    graphed part's); the backward adds their gradients up in ``order`` (indices of the copies).
    Copies, not views: Paddle treats an output sharing its input's memory as the input changed in
    place."""

    @staticmethod
    def forward(ctx, x, order):
        ctx.order = order
        return tuple(x.clone() for _ in order)

    @staticmethod
    def backward(ctx, *grads):
        total = None
        for i in ctx.order:
            if grads[i] is not None:
                total = grads[i] if total is None else total + grads[i]
        return total


def _next(node):
    return [n for n in node.next_functions if n is not None]


def _reachable(starts, stops) -> dict:
    """``node_ptr() -> node`` of every node reached from ``starts`` without passing a node whose
    ``node_ptr()`` is in ``stops``."""
    found, stack = {}, list(starts)
    while stack:
        node = stack.pop()
        key = node.node_ptr()
        if key in found or key in stops:
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
    """Every part eager and reading the block's input, as in eager training, until a watched
    training call's backward has run and shown the order its input's gradients are summed in."""
    JUDGED = "judged"
    """The parts the order allows graphed, each reading its own copy (``OwnInput.graphed_parts``);
    the others eager for good (``OwnInput.eager_parts``, with why)."""


class _Watch:
    """One training call watched: its input, the block's outputs and each part's calls while it
    runs, then the order its backward runs the input's readers in, until it runs the input's
    producer (every reader's gradient is in by then)."""

    def __init__(self, x, parts: int):
        self.input, self.block_outputs = x, None
        self.calls = [0] * parts
        self.reads_input = [False] * parts
        self.outputs = [None] * parts
        self.other_inputs = [()] * parts  # node_ptr() of the gradient nodes of a part's other inputs
        self.ran = []  # (part index or None, edges to the input) per reader, as run
        self.complete = False

    def record(self, part, edges: int) -> None:
        if not self.complete:
            self.ran.append((part, edges))


def _groups(ran, chosen) -> list | None:
    """``[(group, terms), ...]``: the readers' gradients as eager adds them, run together by group
    (a chosen part's index; ``None`` for every other reader), where the copies of ``chosen`` sum as
    eagerly: some reader not chosen, each group in one run, a part's of at most two terms, every
    run after the first a single term. ``None`` where they do not."""
    runs = []
    for part, edges in ran:
        group = part if part in chosen else None
        if runs and runs[-1][0] == group:
            runs[-1][1] += edges
        else:
            runs.append([group, edges])
    groups = [group for group, _ in runs]
    if None not in groups:  # the other readers' copy would add a zero, which turns eager's -0.0 into +0.0
        return None
    if sum(terms for _, terms in runs) <= 2:
        return runs
    if len(set(groups)) != len(groups) or any(terms > 1 for _, terms in runs[1:]):
        return None
    if any(group is not None and terms > 2 for group, terms in runs):
        return None
    return runs


class OwnInput:
    """``parts`` (``(label, sublayer of block, its CUDAGraphedLayer)``, each graphed in place)
    reading their own copies of ``block``'s input, judged on ``entry``'s training calls
    (``entry``: the pipeline entry holding ``block``, whose outputs the judgement walks back
    from). Made right after :func:`~.in_place.swap_in`; :meth:`remove` undoes it (the parts'
    classes are the caller's)."""

    _KEPT = 8  # watches kept waiting for their backward (older ones are dropped)

    def __init__(self, entry, block, parts):
        self.parts = list(parts)
        self.state = Judgement.WATCHING
        self.graphed_parts = ()  # indices, once judged
        self.eager_parts = {}  # index -> why it stays eager
        self._order = ()  # the copies' gradients added in this order (copy 0: the block's other readers)
        self._active = True  # False: every hook does nothing (set inside hooks, where Paddle forbids removing them)
        self._call = None  # the watch of the call running now
        self._watched = []  # watches whose backward is still to run
        self._copies = None  # the call's copies: the block's, then one per graphed part
        ungraph_in_place([part for _, part, _ in self.parts])  # eager until judged
        self._handles = [block.register_forward_pre_hook(self._before_block, with_kwargs=True),
                         block.register_forward_post_hook(self._after_block),
                         entry.register_forward_post_hook(self._after_entry)]
        for i, (_, part, _) in enumerate(self.parts):
            self._handles += [part.register_forward_pre_hook(self._before_part(i), with_kwargs=True),
                              part.register_forward_post_hook(self._after_part(i))]

    def describe(self) -> list:
        """Lines for the segmentation report: each part not graphed, and why."""
        if self.state is Judgement.WATCHING:
            return [f"{label}: eager until the backward of a training micro-batch of its layer shows the order "
                    f"its input's gradients are summed in" for label, _, _ in self.parts]
        return [f"{self.parts[i][0]}: eager: {why}" for i, why in self.eager_parts.items()]

    def remove(self) -> None:
        """Take the hooks out (not from inside one of them: Paddle iterates them as it calls them)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._active = [], False
        self._watched, self._call, self._copies = [], None, None

    # ---------------------------------------------------------------- the hooks
    def _before_block(self, block, args, kwargs):
        if not self._active:
            return None
        self._copies = None
        if self.state is Judgement.WATCHING:
            done = next((watch for watch in self._watched if watch.complete), None)
            if done is not None:
                self._judge(done)
                if not self._active:
                    return None
        where, x = _first_tensor(args, kwargs)
        if not (paddle.is_grad_enabled() and x is not None and not x.stop_gradient):
            return None
        if self.state is Judgement.JUDGED:  # in training and evaluation alike
            self._copies = _Split.apply(x, self._order)
            return _replaced(args, kwargs, where, self._copies[0])
        if block.training:
            self._call = _Watch(x, len(self.parts))
        return None

    def _after_block(self, block, inputs, outputs):
        if self._active:
            self._copies = None  # a part's, if it was not called
            if self._call is not None and self._call.block_outputs is None:
                self._call.block_outputs = outputs
        return None

    def _before_part(self, i: int):
        def before(part, args, kwargs):
            if not self._active:
                return None
            where, x = _first_tensor(args, kwargs)
            graphed = i in self.graphed_parts
            if self._copies is not None and graphed:
                if x is not self._copies[0]:
                    raise RuntimeError(
                        f"{self.parts[i][0]}: it no longer reads its block's input (it did when judged), so its "
                        f"own copy cannot stand in for it; graph_pipeline(...).undo() and graph again")
                return _replaced(args, kwargs, where, self._copies[1 + self.graphed_parts.index(i)])
            if graphed and paddle.is_grad_enabled() and x is not None and not x.stop_gradient:
                raise RuntimeError(
                    f"{self.parts[i][0]}: called with a gradient-carrying input outside a call of its block, or "
                    f"its block's input was not found (its first tensor argument), so it cannot read its own "
                    f"copy and its input's gradient would be summed in another order than eagerly; call the "
                    f"block as its layer does, or graph_pipeline(...).undo()")
            watch = self._call
            if watch is not None:
                watch.calls[i] += 1
                if watch.calls[i] == 1:
                    watch.reads_input[i] = x is watch.input
                    others = ([*args[1:], *kwargs.values()] if where == 0 else
                              [*args, *(value for key, value in kwargs.items() if key != where)])
                    watch.other_inputs[i] = {node.node_ptr() for node in _grad_nodes(others)}
            return None
        return before

    def _after_part(self, i: int):
        def after(part, inputs, outputs):
            watch = self._call
            if self._active and watch is not None and watch.outputs[i] is None:
                watch.outputs[i] = outputs
            return None
        return after

    def _after_entry(self, entry, inputs, outputs):
        watch, self._call = self._call, None
        if not self._active or self.state is not Judgement.WATCHING or watch is None:
            return None
        if self._watch(watch, outputs):
            self._watched = [*self._watched[-(self._KEPT - 1):], watch]
        watch.input = watch.outputs = watch.block_outputs = None  # counts from here on, no tensors
        return None

    # ---------------------------------------------------------------- the judgement
    def _watch(self, watch, outputs) -> bool:
        """Hook the watched call's input's readers so its backward records the order they run in,
        each tagged with the part it belongs to, and its producer so it says when they all have;
        a part that cannot read a copy is given up. Whether anything is left to judge."""
        producer = watch.input.grad_fn
        if producer is None or watch.block_outputs is None:
            return self._give_up_all("its block's input has no gradient node, or its block did not return")
        stop = {producer.node_ptr()}
        readers = [(node, sum(n.node_ptr() in stop for n in _next(node)))
                   for node in _reachable(_grad_nodes(outputs), stop).values()
                   if any(n.node_ptr() in stop for n in _next(node))]
        in_block = _reachable(_grad_nodes(watch.block_outputs), stop)
        if any(node.node_ptr() not in in_block for node, _ in readers):
            return self._give_up_all("its block's input is read outside its block too")
        owner = {}
        for i in range(len(self.parts)):
            if i in self.eager_parts:
                continue
            if watch.calls[i] != 1 or not watch.reads_input[i] or watch.outputs[i] is None:
                self._give_up(i, "it is not called once per call of its block, on its block's input")
                continue
            mine = _reachable(_grad_nodes(watch.outputs[i]), stop | watch.other_inputs[i])
            theirs = [node.node_ptr() for node, _ in readers if node.node_ptr() in mine]
            if not theirs or any(key in owner for key in theirs):
                self._give_up(i, "its gradient does not reach the layer's outputs apart from the others'")
                continue
            owner.update((key, i) for key in theirs)
        if len(self.eager_parts) == len(self.parts):  # each given up above, with its reason
            return self._finish()
        for node, edges in readers:
            node._register_post_hook(self._recorder(watch, owner.get(node.node_ptr()), edges))
        producer._register_post_hook(self._completer(watch))
        return True

    @staticmethod
    def _recorder(watch, part, edges: int):
        def record(grad_outputs, grad_inputs):
            watch.record(part, edges)
            return grad_outputs
        return record

    @staticmethod
    def _completer(watch):
        def complete(grad_outputs, grad_inputs):
            watch.complete = True
            return grad_outputs
        return complete

    def _judge(self, watch) -> None:
        """After a watched call's backward: graph the largest set of parts whose copies sum as
        eagerly, each reading its own; the others stay eager."""
        self._watched = []
        candidates = [i for i in range(len(self.parts)) if i not in self.eager_parts]
        found = next(((chosen, runs) for size in range(len(candidates), 0, -1)
                      for chosen in itertools.combinations(candidates, size)
                      if (runs := _groups(watch.ran, chosen)) is not None), None)
        if found is not None:
            self._graph(*found)
        for i in candidates:
            if i not in self.graphed_parts:
                self._give_up(i, "eager autograd adds its gradient to its input's between other readers', in an "
                                 "order copies added up by one node cannot reproduce")
        self.state = Judgement.JUDGED
        if not self.graphed_parts:
            self._active = False

    def _graph(self, chosen, runs) -> None:
        self.graphed_parts = tuple(chosen)
        copy_of = {None: 0, **{part: 1 + k for k, part in enumerate(chosen)}}
        order = [copy_of[group] for group, _ in runs]
        self._order = tuple(order + [c for c in range(len(chosen) + 1) if c not in order])
        for i in chosen:
            _, part, graphed = self.parts[i]
            swap_in(part, graphed)

    def _give_up(self, i: int, why: str) -> None:
        self.eager_parts[i] = why
        warn(f"{self.parts[i][0]} stays eager: {why}; the rest of its layer stays graphed")

    def _give_up_all(self, why: str) -> bool:
        for i in range(len(self.parts)):
            if i not in self.eager_parts:
                self._give_up(i, why)
        return self._finish()

    def _finish(self) -> bool:
        """Judged with every part eager: the hooks go quiet. ``False``: nothing left to watch."""
        self.state, self._active = Judgement.JUDGED, False
        return False
