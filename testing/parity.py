"""Graphed against eager on a small GPT stack: the engine's parity check on a GPU (PyTorch).

Shared by the GPU tests (``unittests/gpu/test_engine_gpu.py`` runs it as a test; the zero-bubble,
compile, pipeline and Hugging Face tests use its stack, orders and ``rel``) and by
``tools/gpu_check.py`` (which records the worst error it saw) and ``tools/bench_zero_bubble.py``. The stack is three blocks of the
trainer's GPT (:mod:`testing.gpt_torch`, explicit attention, dropout 0.1) with two differentiable
outputs (the hidden state and an auxiliary head); each step runs four micro-batches in an
interleaved pipeline order, then an AdamW step.

Run it with TF32 off (``torch.backends.cuda.matmul.allow_tf32 = False``, likewise cuDNN): the
bound of 1e-6 is for fp32 kernels.
"""

from __future__ import annotations

import copy

import torch

from testing.gpt_torch import Block, GPTShape

__all__ = ["ORDER", "Stack", "Scale", "rel", "run_step", "side_by_side", "twins", "check_parity"]

ORDER = "f1 f2 f3 b1 f4 b2 b3 b4"
"""The micro-batch order of one step: forwards ``fN`` and backwards ``bN`` of 4 micro-batches."""
SEQ = 16
TOLERANCE = 1e-6


class Stack(torch.nn.Module):
    """``n`` GPT blocks, with two differentiable outputs (hidden state and an auxiliary head)."""

    def __init__(self, n=3, hidden=64):
        super().__init__()
        shape = GPTShape(hidden=hidden, heads=4, vocab=8, seq_len=SEQ, layers=n, dropout=0.1)
        self.blocks = torch.nn.ModuleList(Block(shape) for _ in range(n))
        self.aux = torch.nn.Linear(hidden, 8)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x, self.aux(x)


class Scale(torch.autograd.Function):
    """``x * w`` (``w`` over the last dimension) as a custom autograd function: a junction where
    an activation and a parameter meet whose node a Python handle does not keep alive on
    torch <= 2.11 (the zero-bubble weight pass restarts there)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).flatten(0, -2).sum(0)


def rel(a, b) -> float:
    """Relative error of ``a`` against ``b`` (float64 norms)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_step(model, xs, order, seed):
    """Run ``order`` over the micro-batches ``xs``; returns outputs, input grads and losses."""
    torch.manual_seed(seed)
    outs, losses = {}, []
    for tok in order.split():
        n = int(tok[1:]) - 1
        if tok[0] == "f":
            h, aux = model(xs[n])
            outs[n] = (h.detach().clone(), aux.detach().clone(), h, aux)
        else:
            _, _, h, aux = outs[n]
            loss = h.square().mean() + aux.sin().mean()
            loss.backward()
            losses.append(loss.detach())
    return {n: o[:2] for n, o in outs.items()}, [x.grad.clone() for x in xs], torch.stack(losses)


def run_order(model, xs, order, loss_of, *, first=1):
    """One step of a pipeline order over the micro-batches ``xs``: ``fN`` runs the forward of
    micro-batch ``N`` (``xs[N - first]``), ``bN`` its full backward, ``iN`` and ``wN`` the input
    and the weight pass of torch.distributed.pipelining's zero-bubble schedules
    (``stage_backward_input`` / ``stage_backward_weight``). ``loss_of(output)`` makes the loss
    of a forward's output. Returns ``{index into xs: detached loss}``."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    outs, passes, losses = {}, {}, {}
    for tok in order.split():
        kind, n = tok[0], int(tok[1:]) - first
        if kind == "f":
            outs[n] = model(xs[n])
        elif kind == "w":
            stage_backward_weight(model.parameters(), passes.pop(n))
        else:
            loss = loss_of(outs[n])
            losses[n] = loss.detach()
            if kind == "b":
                loss.backward()
            else:
                _, passes[n] = stage_backward_input([loss], None, [xs[n]], model.parameters())
    return losses


def twins(*, device: str, num_warmup_steps: int = 2, **options):
    """A :class:`Stack` and a graphed copy of it (``options`` go to ``CUDAGraphedModule``),
    each with its own AdamW: ``(eager, graphed, eager optimizer, graphed optimizer)``."""
    from paddle_graphpp.torch import CUDAGraphedModule

    torch.manual_seed(0)
    eager = Stack().to(device)
    graphed = CUDAGraphedModule(copy.deepcopy(eager), num_warmup_steps=num_warmup_steps, **options)
    return (eager, graphed, torch.optim.AdamW(eager.parameters(), lr=1e-3),
            torch.optim.AdamW(graphed.parameters(), lr=1e-3))


def side_by_side(eager, graphed, *, steps: int, order: str, seed: int, device: str):
    """Run ``steps`` steps of ``order`` over 4 fresh micro-batches on ``eager`` and on its graphed
    twin ``graphed``, the same inputs and seeds; after each, yield ``(step, errors)``: the relative
    errors of the losses, each micro-batch's outputs and input gradient, and every parameter's
    gradient. The caller steps its optimizers (and checks more) before asking for the next."""
    for step in range(steps):
        base = [torch.randn(2, SEQ, 64, device=device) for _ in range(4)]
        xe = [b.clone().requires_grad_(True) for b in base]
        xg = [b.clone().requires_grad_(True) for b in base]
        oe, ge, le = run_step(eager, xe, order, seed=seed + step)
        og, gg, lg = run_step(graphed, xg, order, seed=seed + step)
        errs = [rel(lg, le)]
        for n in range(4):
            errs += [rel(og[n][0], oe[n][0]), rel(og[n][1], oe[n][1]), rel(gg[n], ge[n])]
        errs += [rel(q.grad, p.grad) for p, q in zip(eager.parameters(), graphed.module.parameters())]
        yield step, errs


def check_parity(*, accumulate_grads: bool, steps: int = 12, device: str = "cuda") -> float:
    """Train the stack eagerly and graphed side by side for ``steps`` steps; return the worst
    relative error of losses, outputs, input and parameter gradients, and final weights.

    Raises:
        AssertionError: an error above 1e-6 (naming the step), a parameter whose ``.grad`` is
            not the engine's buffer with ``accumulate_grads``, or capture/replay counts off.
    """
    eager, graphed, opt_e, opt_g = twins(device=device, accumulate_grads=accumulate_grads)
    worst = 0.0
    for step, errs in side_by_side(eager, graphed, steps=steps, order=ORDER, seed=1000, device=device):
        worst = max(worst, max(errs))
        assert max(errs) <= TOLERANCE, f"step {step}: max relative error {max(errs):.3e}"
        if accumulate_grads and step >= 2:  # from the first replayed step on (warmup, recorded, replayed), .grad is the layer's buffer
            bufs = graphed.engine.param_grad_buffers
            assert all(q.grad is b for q, b in zip(graphed.module.parameters(), bufs))
        opt_e.step(); opt_g.step()
        opt_e.zero_grad(); opt_g.zero_grad()
    for p, q in zip(eager.parameters(), graphed.module.parameters()):
        assert rel(q, p) <= TOLERANCE
    assert graphed.engine.captures == 8  # 4 positions x (fwd, bwd)
    assert graphed.engine.replays == 8 * (steps - 2)  # step 0 warms up (to the episode end), step 1 captures
    return worst
