"""The PyTorch side of a graphed call's autograd: its custom function, and the runtime's
gradient capabilities (split backward for zero-bubble schedules, accumulation inside graphs)."""

from __future__ import annotations

import functools
import sys
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ..core.engine import node_backward, node_forward
from ..core.process import current_process
from ..core.runtime import InGraphAccumulation, SplitBackward
from . import integrations
from . import split_backward as _split

__all__ = ["TorchGradients", "apply_graphed_function"]


class _GraphedFunction(torch.autograd.Function):
    """Autograd node of one graphed call (the logic is the core's)."""

    @staticmethod
    def forward(ctx, call, *tensors_and_params):
        return node_forward(ctx, call)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        # Zero-bubble schedules ask for the inputs' gradients first (torch.autograd.grad
        # w.r.t. the stage inputs) and for the parameters' later: the engine splits the backward
        # when autograd wants no parameter gradient from this node.
        stashed = getattr(ctx, "stashed_grads", None)
        if stashed is not None:  # see _weight_pass_hooks: it stashes in input passes only
            # the hook saw the gradients before autograd filled the missing ones with zeros
            grads, ctx.stashed_grads = tuple(s if s is not None else g for s, g in zip(stashed, grads)), None
            wanted = False
        else:
            wanted = _split.weights_wanted(ctx, len(ctx.call.shape.specs))
        return (None, *node_backward(ctx, grads, weights_wanted=wanted))


class WeightPassFacts:
    """What the installed torch's pipelining weight pass does, read once (a part of the
    process's torch section)."""

    def __init__(self) -> None:
        self.sums_output_grads: Optional[bool] = None  # None: not read yet


def _weight_pass_sums_output_grads() -> bool:
    """Does this torch's ``stage_backward_weight`` (torch.distributed.pipelining) sum the
    gradients a multi-output node received and send the sum to its first output? Torch up to
    2.11 does (pytorch/pytorch#170277): the sum fails when the outputs' shapes differ."""
    facts = current_process().section("torch").part(WeightPassFacts)
    if facts.sums_output_grads is None:
        try:
            import inspect

            from torch.distributed.pipelining import _backward

            facts.sums_output_grads = "sum(non_none_grads)" in inspect.getsource(_backward.stage_backward_weight)
        except Exception:  # noqa: BLE001 - no pipelining, or no source: nothing to work around
            facts.sums_output_grads = False
    return facts.sums_output_grads


# torch.distributed.pipelining's stage_backward_weight is the weight pass whose summing the hooks
# work around; without that module loaded, graphed calls skip them (host time on every call).
_PIPELINING = "torch.distributed.pipelining"


class _SumsToItself(torch.Tensor):
    """A gradient that adding zero leaves as it is. Torch 2.11's weight pass sums the gradients
    each node saw (``sum([g])``, that is ``0 + g``), which copies a gradient that comes alone: for
    an output head, the logits' gradient (hundreds of MiB at long sequences), allocated in
    the default cache beside the graphs' pool at every weight pass. A graphed layer's weight half
    never reads what that pass sends it, so the copy is memory for nothing."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __radd__(self, other):
        if isinstance(other, (int, float)) and not isinstance(other, bool) and other == 0:
            return self
        return super().__radd__(other)


def _weight_pass_hooks(outputs) -> None:
    """For a graphed call with parameters (a node without any is never a weight pass's
    junction), on a torch whose weight pass sums a node's output gradients: hand autograd's pre-hooks
    (the pipelining input pass saves what they see) only the first output's gradient, as an
    alias whose sum with zero is itself (:class:`_SumsToItself`), and the node the gradients it
    really received (stashed on its context). The node's weight half reads the gradients it
    kept from its input half, so what the weight pass sends it is never used: the sum must
    neither fail (outputs of different shapes, pytorch/pytorch#170277) nor copy.

    Only in an input pass (no parameter gradient wanted); a whole backward runs as it is. The
    node gets the very tensors autograd gave it, not the alias: the engine knows a
    gradient one graph hands another by the tensor object (a link, read in place); handing
    the node a new object would make every such gradient a buffer of its own."""
    tensors = outputs if isinstance(outputs, tuple) else (outputs,)
    node = next((o.grad_fn for o in tensors if isinstance(o, torch.Tensor) and o.grad_fn is not None), None)
    if node is None:
        return

    def hide(grad_outputs):
        present = [i for i, g in enumerate(grad_outputs) if g is not None]
        if not present or (len(present) == 1 and isinstance(grad_outputs[present[0]], _SumsToItself)):
            return None  # nothing, or the weight pass handing back what this hook gave
        if _split.weights_wanted(node, len(node.call.shape.specs)):
            return None  # a whole backward: no input pass saves these for a weight pass
        node.stashed_grads = tuple(grad_outputs)  # the node is the custom function's ctx
        alias = torch.Tensor._make_subclass(_SumsToItself, grad_outputs[present[0]], False)
        return tuple(alias if i == present[0] else None for i in range(len(grad_outputs)))

    node.register_prehook(hide)


def apply_graphed_function(call, tensors, params) -> tuple:
    """``call.forward()`` inside the custom autograd function (see GraphRuntime.apply_graphed_function)."""
    outputs = _GraphedFunction.apply(call, *tensors, *params)
    if params and _PIPELINING in sys.modules:  # what follows serves its schedules only (host time per call)
        if _weight_pass_sums_output_grads():  # only its weight pass sums
            _weight_pass_hooks(outputs)
        # A zero-bubble input pass (torch.distributed.pipelining's stage_backward_input)
        # detaches the stage's outputs and keeps only Python handles of the nodes its weight
        # pass restarts at; a custom function's handle does not keep its node alive, so the
        # weight pass would find it freed (torch 2.11: "_input_metadata is invalid"). The node
        # of a view of an output (a C++ node, whose handle owns it) holds this node until the
        # engine ends the call's backward; the view itself is dropped, so the output's memory
        # is not held with it.
        first = next((o for o in (outputs if isinstance(outputs, tuple) else (outputs,))
                      if isinstance(o, torch.Tensor) and o.requires_grad), None)
        if first is not None:
            call.anchor = first.view_as(first).grad_fn
    return outputs


class TorchGradients(SplitBackward, InGraphAccumulation):
    """The runtime's gradient capabilities (mixed into :class:`~paddle_graphpp.torch.runtime.TorchRuntime`)."""

    def backward_to_grads(self, outputs, grad_outputs, inputs, aliases, params) -> list:
        # As autograd's accumulation into .grad, one alias at a time: its gradient is adopted
        # by the parameter (none yet) or added into it, and dropped.
        def moved(i, alias):
            grad, alias.grad = alias.grad, None
            param = params[i]
            if param.grad is None:
                param.grad = grad
            else:
                with torch.no_grad():
                    param.grad.add_(grad)

        return _backward_hooked(outputs, grad_outputs, inputs, aliases, moved)

    def backward_into(self, outputs, grad_outputs, inputs, params, buffers, *, accumulate, retain_graph=False):
        # Each parameter alias accumulates its gradient as soon as autograd produces it: into
        # its buffer, preset as the alias's .grad (accumulate, a buffer of the alias's dtype), or
        # through a hook that adds (a buffer of another dtype: a library's fp32 main_grad, added
        # into as its own hook adds) or copies it over, and drops it. Either way one parameter
        # gradient is alive at a time.
        used = [False] * len(params)
        preset = [b if accumulate and b.dtype == p.dtype else None for p, b in zip(params, buffers)]

        def moved(i, alias):
            used[i] = True
            if preset[i] is None:
                if accumulate:
                    buffers[i].add_(alias.grad)
                else:
                    buffers[i].copy_(alias.grad)
                alias.grad = None

        grads = _backward_hooked(outputs, grad_outputs, inputs, params, moved,
                                 preset=preset if accumulate else None, retain_graph=retain_graph)
        return grads, used

    def backward_input(self, outputs, grad_outputs, inputs, params):
        input_grads, state = _split.backward_input(outputs, grad_outputs, inputs, params)
        return input_grads, [None] * len(params), state  # the weight half yields every parameter

    def backward_weight(self, state, params):
        return _split.backward_weight(state, params)

    def weight_pass_refills_grad(self) -> bool:
        return _split.in_pipelining_weight_pass()

    refilling_weight_pass = "torch.distributed.pipelining's stage_backward_weight"

    def zero_many(self, tensors) -> None:
        if tensors:
            with torch.no_grad():
                torch._foreach_zero_(list(tensors))

    def grad_of(self, param):
        return param.grad

    def set_grad(self, param, grad) -> None:
        param.grad = grad

    def hooked_buffer(self, param):
        return integrations.hooked_buffer(param)

    def zero_grad_like(self, param):
        # One zero per dtype and device, expanded: autograd's accumulation makes it a fresh tensor
        # of the parameter's layout, one parameter at a time. A one-element parameter could adopt
        # the expanded view itself (sharing the cached zero): it gets a zero of its own.
        if param.numel() == 1:
            return torch.zeros_like(param)
        cache = self.__dict__.setdefault("_zeros", {})
        key = (param.dtype, param.device)
        zeros = cache.get(key)
        if zeros is None:
            zeros = cache[key] = torch.zeros((), dtype=param.dtype, device=param.device)
        return zeros.expand(param.shape)

    def params_with_grad_hooks(self, params) -> list:
        # DistributedDataParallel's reducer hooks each parameter's gradient accumulator in C++,
        # invisible from Python: inside its forward, every parameter counts as hooked.
        if _inside_ddp_forward():
            return list(range(len(params)))
        return [i for i, p in enumerate(params)
                if getattr(p, "_post_accumulate_grad_hooks", None) or getattr(p, "_backward_hooks", None)
                or integrations.accumulation_hooked(p)]


def _backward_hooked(outputs, grad_outputs, inputs, aliases, on_grad, *, preset=None, retain_graph=False) -> list:
    """``torch.autograd.backward`` of ``outputs`` into ``inputs`` and ``aliases``, calling
    ``on_grad(i, alias)`` as autograd accumulates each alias's gradient (``preset``: the
    ``.grad`` each alias starts with, else none). Returns the inputs' gradients; leaves no
    ``.grad`` on inputs or aliases."""
    handles = []
    for i, alias in enumerate(aliases):
        alias.grad = None if preset is None else preset[i]
        handles.append(alias.register_post_accumulate_grad_hook(functools.partial(on_grad, i)))
    for x in inputs:
        x.grad = None
    try:
        torch.autograd.backward(list(outputs), list(grad_outputs), retain_graph=retain_graph,
                                inputs=[*inputs, *aliases])
    finally:
        for h in handles:
            h.remove()
        for alias in aliases:
            alias.grad = None
    grads = [x.grad for x in inputs]
    for x in inputs:
        x.grad = None
    return grads


def _inside_ddp_forward() -> bool:
    """True inside the forward of a ``DistributedDataParallel`` module (C++ reducer)."""
    active = getattr(torch.nn.parallel.DistributedDataParallel, "_get_active_ddp_module", None)
    return active is not None and active() is not None
