#!/usr/bin/env python
"""One pipeline rank of ``tools/bench_hf_pipeline.py``: a Hugging Face causal LM cut by
``causal_lm_stage``, trained under ``torch.distributed.pipelining``'s ``Schedule1F1B``.

Started once per rank by the benchmark (``RANK``/``WORLD_SIZE``/``MASTER_*`` from
``testing.launch.rank_envs``; the pipeline has ``WORLD_SIZE`` stages, one per GPU). Every rank
builds the whole model from a config with ``tools/bench_hf.make_model`` (seeded: the same
weights everywhere; dropout off, input embedding untied from the head, which sit on different
ranks) and keeps its stage, as the README's ``hf_pipe.py`` does:

* ``--variant eager``: ``causal_lm_stage(..., graph=False)``, the blocks as built;
* ``--variant graphed``: ``causal_lm_stage(...)``, the stage's blocks graphed in place (the
  library's defaults; embeddings, final norm, head and loss stay eager).

A step is ``schedule.step`` over ``--micro-batches`` micro-batches of ``--micro-batch-size`` x
``--seq-len`` tokens (``return_outputs=False``), then AdamW (fused on GPUs) and ``zero_grad``.
Every step's batch is made before the first one, the same on every rank and in both variants.
The first ``WARMUP_STEPS + 1`` steps warm up and capture (the graphed blocks' capture step is
the last of them); then ``--windows`` windows of ``--iters`` steps are timed, each between two
device synchronisations, without a host sync inside. Memory (GPU): the peak of reserved memory
over the warmup and capture steps, reset, then the steady peak over the timed windows.

Prints one JSON line (the last line of stdout): this rank's tokens/s per window and their
median, the two peaks, the per-step mean losses (last rank only), and for graphed blocks their
graph and replay counts. An error prints ``{"rank", "error", "traceback"}`` and exits 1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)
from tools import bench_hf, benchlib  # noqa: E402

VARIANTS = ("eager", "graphed")
WARMUP_STEPS = 3  # causal_lm_stage's num_warmup_steps: eager steps before the blocks record and capture
SEED = 1234
LR = 1e-4
# Dropout off, so graphed and eager runs draw nothing random and their losses compare directly.
DROPOUT_OFF = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "llama": dict(attention_dropout=0.0)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=bench_hf.MODELS, required=True)
    p.add_argument("--variant", choices=VARIANTS, required=True)
    bench_hf.add_model_args(p, micro_batches=8, models=False)
    p.add_argument("--windows", type=int, default=5, help="timed windows after the warmup and capture steps")
    p.add_argument("--iters", type=int, default=8, help="steps per timed window")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    return p.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    labels = {"rank": int(os.environ.get("RANK", "0")), "model": opts.model, "variant": opts.variant}
    # no process-group teardown: a peer may be gone, and destroying NCCL communicators after
    # captured work can hang (DESIGN.md)
    os._exit(benchlib.rank_result(lambda: run(opts), labels))


def init_distributed(device: str) -> tuple:
    """Join the group the launcher describes (NCCL, one GPU per rank; gloo on the CPU); ``(rank, world)``."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world < 2:
        raise ValueError(f"WORLD_SIZE={world}: a pipeline needs 2 or more ranks, one stage each "
                         f"(tools/bench_hf_pipeline.py starts them)")
    kwargs = {}
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
        if torch.cuda.device_count() <= local:
            raise RuntimeError(f"rank {rank} needs GPU {local}, {torch.cuda.device_count()} visible")
        torch.cuda.set_device(local)
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # multicast off on the lent machines
        kwargs["device_id"] = torch.device("cuda", local)
    else:
        torch.set_num_threads(1)  # every rank on the same few cores: more threads each only contend
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), **kwargs)
    return rank, world


def build(opts, rank: int, world: int, device):
    """This rank's stage (eager or graphed), its ``Schedule1F1B`` and its optimizer."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from paddle_graphpp.torch.hf import causal_lm_stage

    model, _ = bench_hf.make_model(opts.model, opts, tie_word_embeddings=False, **DROPOUT_OFF[opts.model])
    model.to(getattr(torch, opts.dtype))
    stage_mod = causal_lm_stage(model, rank, world, WARMUP_STEPS, graph=opts.variant == "graphed").to(device)
    x, y = stage_mod.example_io(opts.micro_batch_size, opts.seq_len)
    stage = PipelineStage(stage_mod, rank, world, device, input_args=(x,), output_args=(y,))

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    schedule = Schedule1F1B(stage, n_microbatches=opts.micro_batches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=LR, fused=device.type == "cuda")
    return stage_mod, schedule, opt


def batches(opts, steps: int, device) -> list:
    """Every step's ``(inputs, targets)``, made up front on the device (contiguous: torch 2.11's
    ``PipelineStage`` checks strides against ``example_io()``'s)."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, opts.vocab, (opts.micro_batches * opts.micro_batch_size, opts.seq_len + 1),
                               generator=g)
        out.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
    return out


def run(opts) -> dict:
    import torch
    import torch.distributed as dist

    cuda = opts.device == "cuda"
    rank, world = init_distributed(opts.device)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    stage_mod, schedule, opt = build(opts, rank, world, device)
    first, last = rank == 0, rank == world - 1
    skip = WARMUP_STEPS + 1
    data = batches(opts, skip + opts.windows * opts.iters, device)
    losses = []

    def step(i: int) -> None:
        inputs, targets = data[i]
        mine = [] if last else None
        schedule.step(*((inputs,) if first else ()), target=targets if last else None, losses=mine,
                      return_outputs=False)
        opt.step()
        opt.zero_grad()
        if last:
            losses.append(torch.stack(mine).float().mean().detach())  # read after the run: no host sync here

    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    memory = None
    if cuda:
        from tools.benchlib import DeviceMemory

        memory = DeviceMemory(device)
        sync()
        memory.reset_peak()
    t0 = time.perf_counter()
    for i in range(skip):
        step(i)
    sync()
    capture_phase_s = time.perf_counter() - t0
    capture_peak = memory.peak_mib() if cuda else None
    if cuda:
        memory.reset_peak()
    window_s = timed_windows(step, sync, start=skip, windows=opts.windows, iters=opts.iters)
    steady_peak = memory.peak_mib() if cuda else None
    tokens = opts.iters * opts.micro_batches * opts.micro_batch_size * opts.seq_len
    tps = [tokens / max(s, 1e-9) for s in window_s]
    record = {
        "rank": rank, "world": world, "model": opts.model, "variant": opts.variant, "device": opts.device,
        "parameters": sum(p.numel() for p in stage_mod.parameters()), "layer_indices": stage_mod.layer_indices,
        "warmup_and_capture_steps": skip, "windows": opts.windows, "iters_per_window": opts.iters,
        "tokens_per_s": statistics.median(tps), "tokens_per_s_windows": tps,
        "tokens_per_s_spread": max(tps) / min(tps), "capture_phase_s": round(capture_phase_s, 3),
        "capture_peak_mib": None if capture_peak is None else round(capture_peak, 1),
        "steady_peak_mib": None if steady_peak is None else round(steady_peak, 1),
        "peak_mib": None if capture_peak is None else round(max(capture_peak, steady_peak), 1),
        "losses": [float(v) for v in torch.stack(losses).tolist()] if last else None,
        **graph_counts(stage_mod, graphed=opts.variant == "graphed"),
    }
    dist.barrier()
    return record


def timed_windows(step, sync, *, start: int, windows: int, iters: int) -> list:
    """Seconds of each window of ``iters`` steps, from step ``start`` on, each between two syncs."""
    out, i = [], start
    for _ in range(windows):
        sync()
        t = time.perf_counter()
        for _ in range(iters):
            step(i)
            i += 1
        sync()
        out.append(time.perf_counter() - t)
    return out


def graph_counts(stage_mod, *, graphed: bool) -> dict:
    """Graphs captured and replays run by this stage's blocks (graphed variant; on a CPU they run
    eagerly, so both are 0)."""
    if not graphed:
        return {}
    engines = [b.engine for b in stage_mod.blocks]
    return {"graphs": sum(e.graph_count() for e in engines), "replays": sum(e.replays for e in engines)}


if __name__ == "__main__":
    sys.exit(main())
