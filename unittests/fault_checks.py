"""Training loops shared by the fault tests of issue 16, on CPU and on a GPU.

A small model of graphed blocks (``CUDAGraphedModule``) and a head, trained with
``GraphedOptimizer`` (AdamW, clipping) and an LR schedule, two micro-batches in flight per
step. :func:`resume_losses` checks checkpoint and resume; :func:`scaled_losses` runs the
same model under a ``torch.amp.GradScaler`` with an overflow injected on chosen steps. On
CPU the graphed layers and the optimizer run eagerly (their bookkeeping, state dicts and
loading paths are the same); on a GPU they replay graphs.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Optional

import torch

import paddle_graphpp
from paddle_graphpp.torch import CUDAGraphedModule

WIDTH, CLASSES, MICRO_BATCHES = 32, 4, 2


class Block(torch.nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = torch.nn.Linear(2 * WIDTH, WIDTH)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(x))))


@dataclass
class Trainer:
    model: torch.nn.Module
    opt: object  # GraphedOptimizer, or a plain optimizer for the eager reference
    sched: object
    device: str


def build(device: str, *, dropout: float = 0.0, graphed: bool = True, seed: int = 0,
          clip: Optional[float] = 1.0) -> Trainer:
    """The model (two blocks, graphed or not, and a head), AdamW and a decaying LR."""
    torch.manual_seed(seed)
    blocks = [Block(dropout) for _ in range(2)]
    if graphed:
        blocks = [CUDAGraphedModule(b, num_warmup_steps=1) for b in blocks]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(WIDTH, CLASSES)).to(device)
    lr = 1e-2
    if not graphed and device.startswith("cuda"):
        # The eager reference runs the kernels GraphedOptimizer captures: AdamW's capturable
        # path with the learning rate in an fp32 device tensor.
        lr = torch.tensor(lr, dtype=torch.float32, device=device)
    inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1,
                              capturable=not graphed and device.startswith("cuda"))
    opt = paddle_graphpp.GraphedOptimizer(inner, clip_grad_norm=clip) if graphed else inner
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 1.0 / (1.0 + 0.1 * s))
    return Trainer(model, opt, sched, device)


def batch(step: int, micro_batch: int, device: str) -> tuple:
    g = torch.Generator().manual_seed(1000 * step + micro_batch)
    return (torch.randn(4, WIDTH, generator=g).to(device),
            torch.randint(0, CLASSES, (4,), generator=g).to(device))


def forward_backward(t: Trainer, step: int, *, scaler=None, poison: bool = False) -> torch.Tensor:
    """Both micro-batches' forwards, then their backwards (two in flight); returns the step's
    loss (a device tensor). ``poison``: the first micro-batch's loss becomes inf, so every
    gradient overflows."""
    losses = []
    for mb in range(MICRO_BATCHES):
        x, y = batch(step, mb, t.device)
        loss = torch.nn.functional.cross_entropy(t.model(x), y) / MICRO_BATCHES
        if poison and mb == 0:
            loss = loss * torch.tensor(float("inf"), device=t.device)
        losses.append(loss)
    for loss in losses:
        (scaler.scale(loss) if scaler is not None else loss).backward()
    return torch.stack([loss.detach() for loss in losses]).sum()


def train_step(t: Trainer, step: int) -> torch.Tensor:
    loss = forward_backward(t, step)
    if isinstance(t.opt, torch.optim.Optimizer):  # the eager reference: clip, step, zero
        torch.nn.utils.clip_grad_norm_(t.model.parameters(), 1.0)
    t.opt.step()
    t.sched.step()
    t.opt.zero_grad()
    return loss


def checkpoint(t: Trainer) -> bytes:
    """Model, optimizer, schedule and RNG states, serialised as a file would hold them."""
    state = {"model": t.model.state_dict(), "opt": t.opt.state_dict(), "sched": t.sched.state_dict(),
             "cpu_rng": torch.get_rng_state()}
    if t.device.startswith("cuda"):
        state["cuda_rng"] = torch.cuda.get_rng_state()
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def restore(t: Trainer, blob: bytes) -> None:
    """Load a :func:`checkpoint` with the in-place loaders (``load_state_dict``)."""
    state = torch.load(io.BytesIO(blob), map_location=t.device, weights_only=False)
    t.model.load_state_dict(state["model"])
    t.opt.load_state_dict(state["opt"])
    t.sched.load_state_dict(state["sched"])
    # RNG states are byte tensors on the CPU whatever map_location moved them to
    torch.set_rng_state(state["cpu_rng"].cpu())
    if "cuda_rng" in state:
        torch.cuda.set_rng_state(state["cuda_rng"].cpu())


def resume_losses(device: str, *, steps: int = 8, at: int = 4, dropout: float = 0.0) -> dict:
    """Per-step losses of one uninterrupted run, of a fresh model and optimizer resumed from
    its checkpoint after step ``at``, and of the first run's model rolled back to that
    checkpoint (``load_state_dict`` into the same graphed model and optimizer) and re-run.
    Also the final parameters of each, for comparison."""
    a = build(device, dropout=dropout)
    straight, blob = [], None
    for step in range(steps):
        if step == at:
            blob = checkpoint(a)
        straight.append(train_step(a, step).item())
    final_a = [p.detach().clone() for p in a.model.parameters()]

    b = build(device, dropout=dropout, seed=1)  # other initial weights: all must come from the checkpoint
    restore(b, blob)
    resumed = [train_step(b, step).item() for step in range(at, steps)]

    restore(a, blob)  # the same graphed model and optimizer, rolled back
    rolled = [train_step(a, step).item() for step in range(at, steps)]
    return {"straight": straight, "resumed": resumed, "rolled_back": rolled, "final": final_a,
            "final_resumed": [p.detach().clone() for p in b.model.parameters()],
            "final_rolled_back": [p.detach().clone() for p in a.model.parameters()],
            "replays": [m.engine.replays for m in b.model if isinstance(m, CUDAGraphedModule)]}


def scaled_losses(device: str, *, graphed: bool, steps: int = 6, overflow_at=(2,),
                  init_scale: float = 2.0 ** 10) -> dict:
    """Train under ``torch.amp.GradScaler`` (fp32 weights: the scaler's bookkeeping is what is
    compared), with the loss made inf on the steps in ``overflow_at``. Returns per-step losses,
    scales after each step, parameters after each step, and the final parameters."""
    t = build(device, graphed=graphed, clip=None)
    scaler = torch.amp.GradScaler(device.split(":")[0], init_scale=init_scale, growth_interval=2)
    losses, scales, params = [], [], []
    for step in range(steps):
        loss = forward_backward(t, step, scaler=scaler, poison=step in overflow_at)
        scaler.step(t.opt)  # unscales, checks for inf/nan, steps only when all are finite
        scaler.update()
        t.sched.step()
        t.opt.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
        params.append([p.detach().clone() for p in t.model.parameters()])
    return {"losses": losses, "scales": scales, "params": params,
            "replays": [m.engine.replays for m in t.model if isinstance(m, CUDAGraphedModule)]}
