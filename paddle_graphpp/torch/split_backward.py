"""A backward in two halves, for zero-bubble pipeline schedules (PyTorch autograd).

:func:`backward_input` computes the gradients of a layer's inputs only and returns, with them, the
:class:`WeightState` the weight half needs; :func:`backward_weight`, run later, computes the
parameters' gradients, group by group, without computing anything twice. Both keep the autograd
graph (``retain_graph=True``), freed when the caller drops the outputs and the state after the
weight half. :func:`weights_wanted` and :func:`in_pipelining_weight_pass` tell a custom function's
backward which half autograd asks for. How the split works:
docs/pipelines.md#zero-bubble-schedules-pytorch.
"""

from __future__ import annotations

import sys
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["backward_input", "backward_weight", "weights_wanted", "in_pipelining_weight_pass"]


@dataclass(slots=True)
class _Group:
    params: list  # indices into the parameters
    junctions: list  # autograd nodes
    output_edges: list = field(default_factory=list)  # (GradientEdge, gradient) of weight-only outputs


@dataclass(slots=True)
class WeightState:
    """What the weight half needs: the groups and the gradients saved at their junctions."""

    groups: list
    saved: dict  # junction node -> tuple of the gradients it received in the input half
    n_params: int
    zeros_for: list  # parameters with no path to the outputs (their gradient is zero)
    params: list = field(default_factory=list)
    # Handles that own the outputs' autograd nodes (a view's node, see backward_input), so
    # the outputs themselves may go after the input half
    anchors: list = field(default_factory=list)


def _consumers(roots: Sequence[Any]) -> dict:
    """Every node reachable from ``roots`` -> the nodes that take its output (reverse edges)."""
    consumers: dict = defaultdict(list)
    seen = set(roots)
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            consumers[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    for root in roots:
        consumers.setdefault(root, [])
    return consumers


def _downstream(starts: Sequence[Any], consumers: dict) -> set:
    """The nodes whose output depends on one of ``starts`` (``starts`` included)."""
    seen = {n for n in starts if n in consumers}
    queue = deque(seen)
    while queue:
        for c in consumers[queue.popleft()]:
            if c not in seen:
                seen.add(c)
                queue.append(c)
    return seen


def _plan(outputs: Sequence[Any], grad_outputs: Sequence[Any], inputs: Sequence[Any],
          params: Sequence[Any]) -> tuple:
    """Groups of parameters with their junctions and weight-only outputs; unused parameters."""
    out_edges = [get_gradient_edge(o) for o in outputs]
    roots = list({e.node: None for e in out_edges})
    consumers = _consumers(roots)
    input_side = _downstream([get_gradient_edge(x).node for x in inputs], consumers)
    root_edges: dict = defaultdict(list)
    for edge, g in zip(out_edges, grad_outputs):
        if edge.node not in input_side:
            root_edges[edge.node].append((edge, g))
    owner: dict = {}  # junction or weight-only root node -> its group
    groups: list = []
    unused: list = []
    for i, p in enumerate(params):
        start = get_gradient_edge(p).node
        if start not in consumers:
            unused.append(i)
            continue
        junctions, reached = [], []
        seen = {start}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            if node in root_edges:
                reached.append(node)
            for c in consumers[node]:
                if c in seen:
                    continue
                seen.add(c)
                if c in input_side:
                    junctions.append(c)
                else:
                    queue.append(c)
        # Merge with every group that shares a junction or a weight-only output.
        merged = {id(owner[n]): owner[n] for n in junctions + reached if n in owner}
        group = _Group([i], list(junctions))
        group_roots = dict.fromkeys(reached)
        for other in merged.values():
            group.params += other.params
            group.junctions += [n for n in other.junctions if n not in group.junctions]
            group_roots.update(dict.fromkeys(e.node for e, _ in other.output_edges))
            groups.remove(other)
        group.output_edges = [pair for n in group_roots for pair in root_edges[n]]
        groups.append(group)
        for n in [*group.junctions, *group_roots]:
            owner[n] = group
    return groups, unused


def backward_input(outputs: Sequence[Any], grad_outputs: Sequence[Any], inputs: Sequence[Any],
                   params: Sequence[Any]) -> tuple:
    """The input half: ``(gradients of inputs, WeightState)``
    (docs/pipelines.md#zero-bubble-schedules-pytorch)."""
    groups, unused = _plan(outputs, grad_outputs, inputs, params)
    saved: dict = {}
    handles = []

    def keeper(node):
        def hook(grads):
            saved[node] = grads
        return hook

    for group in groups:
        for node in group.junctions:
            handles.append(node.register_prehook(keeper(node)))
    try:
        if inputs:
            grads = list(torch.autograd.grad(list(outputs), list(inputs), list(grad_outputs), retain_graph=True,
                                             allow_unused=True))
        else:
            grads = []
    finally:
        for h in handles:
            h.remove()
    # The junctions are kept as Python handles, and a custom function's handle does not keep
    # its node alive (torch <= 2.11): the graph above them must outlive the outputs, which the
    # caller drops after this half. A view's node (a C++ node: its handle owns it) holds an
    # output's node through its edge without holding the output's memory.
    with torch.enable_grad():
        anchors = [o.view_as(o).grad_fn for o in outputs if o.grad_fn is not None]
    return grads, WeightState(groups, saved, len(params), unused, list(params), anchors)


def backward_weight(state: WeightState, params: Sequence[Any]) -> Iterator[tuple]:
    """The weight half: yields ``(indices, gradients)`` group by group (a parameter with no
    path to the outputs gets zeros: the zero-bubble weight pass asks for every parameter of a
    layer). Clears ``state``."""
    try:
        for group in state.groups:
            edges, grads = [], []
            for node in group.junctions:
                got = state.saved.get(node)
                for k, g in enumerate(got or ()):
                    if g is not None:
                        edges.append(GradientEdge(node, k))
                        grads.append(g)
            for edge, g in group.output_edges:
                edges.append(edge)
                grads.append(g)
            targets = [params[i] for i in group.params]
            if not edges:
                yield group.params, [torch.zeros_like(p) for p in targets]
                continue
            handles = []
            if len(group.junctions) > 1:
                # A junction downstream of another would receive the other's gradient on top of
                # its own saved one: hand it exactly what it received in the input half.
                for node in group.junctions:
                    got = state.saved.get(node)
                    if got is not None:
                        handles.append(node.register_prehook(lambda _grads, got=got: got))
            try:
                got = torch.autograd.grad(edges, targets, grads, retain_graph=True, allow_unused=True)
            finally:
                for h in handles:
                    h.remove()
            yield group.params, [g if g is not None else torch.zeros_like(p) for g, p in zip(got, targets)]
        if state.zeros_for:
            yield list(state.zeros_for), [torch.zeros_like(params[i]) for i in state.zeros_for]
    finally:
        state.groups, state.saved, state.params, state.anchors = [], {}, [], []


def weights_wanted(ctx: Any, n_tensors: int) -> bool:
    """Inside a custom function's backward: does autograd want any gradient of the function's
    inputs after the first ``n_tensors`` (the parameters)? ``False`` under
    ``torch.autograd.grad`` w.r.t. the inputs only, the input pass of a zero-bubble schedule.

    One answer for all parameters, stopping at the first wanted one: a parameter whose
    gradient ``torch.autograd.grad`` captures (a weight pass's target) makes the check raise,
    at about 20 us a parameter, so asking every parameter would cost a stage's weight pass a
    millisecond or more. The pipelining weight pass asks for all of a node's parameters (they
    share the node, so they form one group), and any other weight pass of a layer accumulating
    in its graphs is refused (see the engine's ``_backward_weight``)."""
    edges = ctx.next_functions[n_tensors:]
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if not edges or will_execute is None:  # a torch that cannot tell: always the whole backward
        return True
    for node, _ in edges:
        if node is None:
            continue
        try:
            if will_execute(node):
                return True
        except RuntimeError:
            # Raised for a leaf whose gradient torch.autograd.grad captures: it is wanted.
            return True
    return False


def in_pipelining_weight_pass() -> bool:
    """Is a thread inside ``torch.distributed.pipelining``'s ``stage_backward_weight``?

    That weight pass puts each gradient it gets into ``.grad`` (assigned where ``.grad`` is
    unset, added otherwise), which lets a layer accumulating inside its graphs hand it the
    whole sum (see the engine's ``_hand_over``). Another weight pass may use the gradients
    otherwise. The backward of a CUDA graph task runs on autograd's device thread while the
    caller waits, so every thread's stack is searched (for the function's code object: no
    import order or rebinding of the name can hide it)."""
    try:
        from torch.distributed.pipelining import _backward
    except ImportError:
        return False
    target = getattr(getattr(_backward, "stage_backward_weight", None), "__code__", None)
    if target is None:
        return False
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code is target:
                return True
            frame = frame.f_back
    return False
