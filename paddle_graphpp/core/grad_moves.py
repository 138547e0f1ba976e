"""Moving gradients between graph buffers, ``.grad`` and autograd, as a graphed backward hands them on.

A backward graph writes gradients into static buffers that its next replay overwrites; what the
engine hands to autograd, or binds as ``.grad``, must not become a tensor the next replay changes
under its owner. :class:`GradientMoves` holds those rules: copies where a leaf could adopt a held
buffer (:meth:`GradientMoves.hand_off`), buffers bound as ``.grad`` before a graph adds into them
(:meth:`GradientMoves.bind_grads`), sums handed whole to a zero-bubble weight pass
(:meth:`GradientMoves.hand_over`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .runtime import GraphRuntime, InGraphAccumulation, clone_many

__all__ = ["GradientMoves"]


class GradientMoves:
    """The gradient moves of one runtime (``accumulation``: its
    :class:`~paddle_graphpp.core.runtime.InGraphAccumulation`, needed by the moves into ``.grad``)."""

    def __init__(self, runtime: GraphRuntime, accumulation: Optional[InGraphAccumulation]):
        self.rt = runtime
        self.accumulation = accumulation

    def add_into_grads(self, params: Sequence[Any], grads: Sequence[Any]) -> None:
        """``.grad += grad`` for each parameter; an unset ``.grad`` adopts the gradient."""
        acc = self.accumulation
        dst, src = [], []
        for p, g in zip(params, grads):
            have = acc.grad_of(p)
            if have is None:
                acc.set_grad(p, g)
            else:
                dst.append(have)
                src.append(g)
        if dst:
            self.rt.add_many(dst, src)

    def hand_over(self, params: Sequence[Any], totals: Sequence[Any]) -> list:
        """For the schedule's weight pass, which puts the gradients it gets into ``.grad``
        (assigned where ``.grad`` is unset, added otherwise; only then is this called, see
        :meth:`~paddle_graphpp.core.runtime.SplitBackward.weight_pass_refills_grad`): each
        parameter's ``.grad``, already holding the sum (``totals``), is unset and handed over
        whole, so the sum returns to ``.grad`` without a copy."""
        for p, total in zip(params, totals):
            if total is not None:
                self.accumulation.set_grad(p, None)
        return list(totals)

    def hand_off(self, targets: list, grads: list) -> list:
        """Give autograd gradients it may keep. A leaf with no gradient yet may adopt the tensor
        it is handed, and a static buffer would then be overwritten by the next replay. Where
        the framework adopts only tensors nobody else holds (PyTorch), handing over the held
        buffers themselves is safe; elsewhere (Paddle) such leaves get copies."""
        rt = self.rt
        if not rt.adopts_held_gradients:
            return grads
        adopt = [i for i in rt.leaves_without_grad(targets) if grads[i] is not None]
        if adopt:
            for i, c in zip(adopt, clone_many(rt, [grads[i] for i in adopt])):
                grads[i] = c
        return grads

    def sum_grads(self, first: list, second: list) -> list:
        """Per parameter, the sum of two optional gradients (new tensors where both exist)."""
        both = [i for i, (a, b) in enumerate(zip(first, second)) if a is not None and b is not None]
        out = [a if a is not None else b for a, b in zip(first, second)]
        if both:
            sums = clone_many(self.rt, [first[i] for i in both])
            self.rt.add_many(sums, [second[i] for i in both])
            for i, total in zip(both, sums):
                out[i] = total
        return out

    def bind_grads(self, params: list, buffers: list) -> None:
        """Make each buffer its parameter's ``.grad``, keeping the gradient's value: an unset
        ``.grad`` becomes the zeroed buffer, another tensor is copied into it."""
        acc = self.accumulation
        unset, dst, src = [], [], []
        for p, b in zip(params, buffers):
            g = acc.grad_of(p)
            if g is b:
                continue
            if g is None:
                unset.append(b)
            else:
                dst.append(b)
                src.append(g)
            acc.set_grad(p, b)
        if unset:
            acc.zero_many(unset)
        self.rt.copy_many(dst, src)
