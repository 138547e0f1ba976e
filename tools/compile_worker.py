#!/usr/bin/env python
"""One variant of ``tools/bench_compile.py``, alone in its process: build, warm up, then step on command.

    python tools/compile_worker.py --variant compile --shape small [--micro-batches 4 --warmup 6]

The model is an unmodified Hugging Face ``LlamaForCausalLM`` built from a config
(``torch.manual_seed(0)``, bf16 on ``cuda``, ``use_cache=False``) and trained with its own
``labels=`` loss: one step is ``--micro-batches`` forward + ``backward`` of the loss over the
number of micro-batches (gradient accumulation), then fused AdamW and
``zero_grad(set_to_none=True)``. Every variant runs this loop; only the wrapping differs
(:data:`VARIANTS`). The token ids of step ``s`` come from ``torch.Generator().manual_seed(s % 8)``
on the CPU, made once and kept on the GPU, so every process trains on the same data.

Protocol: one command per line on stdin, one JSON line per reply on stdout. Everything else the
process writes to stdout (compile logs, C extensions) is moved to stderr.

    warm   -> build, time the first step (compilation included, CUDA synchronised), run
              ``--warmup`` more steps, note the peak reserved memory so far, reset the peak;
              reply {"event": "ready", "first_step_s", "warmup_s", "losses", "peak_reserved_mib"}
    run N  -> N steps between two ``torch.cuda.synchronize()``; reply {"event": "ran", "seconds"}
    profile N -> N steps under ``torch.profiler``; reply {"event": "profiled", ...} with
              ``tools/diagnostics/busy.report``: the compute-busy share, kernel time by kind
    done   -> reply {"event": "done", "steady_peak_reserved_mib"} (the peak since the reset); exit 0

A failure replies {"event": "failed", "error": ...} and exits 1. ``reduce_overhead`` tries the
approaches of :data:`APPROACHES` in order, each on a freshly built model, and reports them all
under ``"tried"`` (with the one that worked, if any, as ``"approach"``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)

import torch  # noqa: E402

VARIANTS = ("eager", "compile", "reduce_overhead", "ours", "ours_compiled_model", "ours_compiled", "ours_whole",
            "ours_whole_compiled", "ours_whole_step")
RECORDED_STEPS = 6  # per-step mean losses kept: steps 1..6, the first included
DATA_STEPS = 8  # distinct batches, cycled
ERROR_CHARS = 4000


@dataclass(frozen=True, slots=True)
class Shape:
    """A Llama configuration and its micro-batch."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    micro_batch: int
    seq: int


SHAPES = {
    "small": Shape(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1376, vocab=8192, micro_batch=2, seq=256),
    "1b": Shape(hidden=2048, layers=16, heads=16, kv_heads=16, intermediate=5504, vocab=32000, micro_batch=1,
                seq=2048),
    "tiny": Shape(hidden=128, layers=16, heads=4, kv_heads=2, intermediate=344, vocab=8192, micro_batch=1, seq=32),
}

APPROACHES = {
    "a": ("torch.compiler.cudagraph_mark_step_begin() before every micro-batch's forward; losses cloned",
          {"mark": "micro-batch"}),
    "b": ("torch.compiler.cudagraph_mark_step_begin() once per optimizer step; losses cloned", {"mark": "step"}),
    "c": ("(a), and the model called on .clone()d input tensors", {"mark": "micro-batch", "clone_inputs": True}),
}


class VariantFailed(Exception):
    def __init__(self, error: str, tried: list):
        super().__init__(error)
        self.error, self.tried = error, tried


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]


def build(shape: Shape):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.seq)
    config.use_cache = False
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16)


def wrap(model, variant: str):
    """What the training loop calls: the model, compiled and/or with graphed decoder blocks."""
    if variant == "compile":
        return torch.compile(model)
    if variant == "reduce_overhead":
        return torch.compile(model, mode="reduce-overhead")
    if variant == "ours":
        from paddle_graphpp.torch import graph_layers

        graph_layers(model.model.layers)
    elif variant in ("ours_compiled_model", "ours_compiled"):
        from paddle_graphpp.torch import graph_layers

        graph_layers(model.model.layers, compile=True)
        if variant == "ours_compiled_model":
            return torch.compile(model)  # the graphed blocks are opaque to dynamo: the rest compiles
    elif variant.startswith("ours_whole"):
        from paddle_graphpp.torch import graph_model

        # ours_whole_compiled, and ours_whole_step (that compiled model inside the step's graph)
        graph_model(model, compile=True if variant in ("ours_whole_compiled", "ours_whole_step") else None)
    return model


def make_data(shape: Shape, micro_batches: int) -> list:
    """``DATA_STEPS`` steps of token ids, one tensor per micro-batch, on the GPU."""
    steps = []
    for s in range(DATA_STEPS):
        g = torch.Generator().manual_seed(s)
        ids = torch.randint(0, shape.vocab, (micro_batches, shape.micro_batch, shape.seq), generator=g)
        steps.append([ids[i].clone().to("cuda") for i in range(micro_batches)])
    return steps


class Trainer:
    """The training loop; ``mark`` and ``clone_inputs`` serve ``reduce_overhead``'s approaches."""

    def __init__(self, model, call, data, *, mark: str = "never", clone_inputs: bool = False,
                 whole_step: bool = False):
        self.model, self.call, self.data = model, call, data
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        self.mark, self.clone_inputs = mark, clone_inputs
        self.steps = 0
        self._run = self._step
        if whole_step:  # the whole step, micro-batches and optimizer, as one graph
            from paddle_graphpp.torch import graph_step

            self._run = graph_step(self._step, optimizers=self.opt)

    def step(self) -> list:
        """One optimizer step; returns each micro-batch's loss (a detached clone)."""
        batch = self.data[self.steps % len(self.data)]
        self.steps += 1
        return list(self._run(batch))

    def _step(self, batch: list) -> torch.Tensor:
        kept = []
        for i, ids in enumerate(batch):
            if self.mark == "micro-batch" or (self.mark == "step" and i == 0):
                torch.compiler.cudagraph_mark_step_begin()
            x, y = (ids.clone(), ids.clone()) if self.clone_inputs else (ids, ids)
            loss = self.call(input_ids=x, labels=y).loss  # the model shifts the labels
            kept.append(loss.detach().clone())
            (loss / len(batch)).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return torch.stack(kept)


def timed_steps(trainer: Trainer, n: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        trainer.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def profiled_steps(trainer: Trainer, n: int) -> dict:
    """``n`` steps under the profiler: how busy the GPU was and with which kernels."""
    from tools.diagnostics import busy

    torch.cuda.synchronize()
    try:
        prof = busy.start()
        for _ in range(n):
            trainer.step()
        return busy.report(prof, n)
    except Exception as exc:  # noqa: BLE001 - the timings stand without it
        traceback.print_exc()
        return {"error": error_text(exc)}


def warm_up(trainer: Trainer, warmup: int, memory) -> dict:
    """The first step (timed), ``warmup`` more, the losses of the first steps, the peak so far."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    losses = [trainer.step()]
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(warmup):
        kept = trainer.step()
        if len(losses) < RECORDED_STEPS:
            losses.append(kept)
    torch.cuda.synchronize()
    rest = time.perf_counter() - start
    means = [torch.stack(k).float().mean().item() for k in losses]
    return {"first_step_s": first, "warmup_s": rest, "losses": means, "peak_reserved_mib": memory.peak_mib()}


def free_compiled_state() -> None:
    """Drop what a failed attempt left: dynamo's caches, Inductor's CUDA-graph trees, memory."""
    torch._dynamo.reset()  # also clears the cudagraph trees
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def warm_reduce_overhead(shape: Shape, args, memory):
    """Try each approach on a fresh model until one gets through the warmup."""
    tried = []
    for key, (how, options) in APPROACHES.items():
        memory.reset_peak()
        trainer = None
        try:
            model = build(shape)
            trainer = Trainer(model, wrap(model, "reduce_overhead"), make_data(shape, args.micro_batches), **options)
            info = warm_up(trainer, args.warmup, memory)
        except Exception as exc:  # noqa: BLE001 - every failure is the finding
            traceback.print_exc()
            tried.append({"approach": key, "how": how, "error": error_text(exc)})
        else:
            tried.append({"approach": key, "how": how, "error": None})
            return trainer, dict(info, approach=key, tried=tried)
        model = trainer = None
        free_compiled_state()
    raise VariantFailed(f"reduce-overhead failed with every approach tried ({', '.join(APPROACHES)}); "
                        f"first: {tried[0]['error']}", tried)


def warm(args, memory):
    """The trainer of ``args.variant``, warmed up, and what the warmup measured."""
    shape = SHAPES[args.shape]
    if args.variant == "reduce_overhead":
        return warm_reduce_overhead(shape, args, memory)
    model = build(shape)
    trainer = Trainer(model, wrap(model, args.variant), make_data(shape, args.micro_batches),
                      whole_step=args.variant == "ours_whole_step")
    return trainer, warm_up(trainer, args.warmup, memory)


def reply_channel():
    """A function writing one JSON line to the real stdout; stdout itself then goes to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    return reply


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", required=True, choices=VARIANTS)
    p.add_argument("--shape", required=True, choices=list(SHAPES))
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=6, help="untimed steps after the first")
    return p.parse_args(argv)


def serve(args, reply) -> int:
    """Answer the parent's commands until ``done`` or the end of stdin."""
    from tools.benchlib import DeviceMemory

    memory = DeviceMemory()
    trainer = None
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "warm":
            trainer, info = warm(args, memory)
            memory.reset_peak()
            reply({"event": "ready", "variant": args.variant, "shape": args.shape, **info})
        elif cmd[0] == "run" and len(cmd) == 2 and trainer is not None:
            n = int(cmd[1])
            reply({"event": "ran", "steps": n, "seconds": timed_steps(trainer, n)})
        elif cmd[0] == "profile" and len(cmd) == 2 and trainer is not None:
            reply({"event": "profiled", **profiled_steps(trainer, int(cmd[1]))})
        elif cmd[0] == "done" and trainer is not None:
            reply({"event": "done", "steady_peak_reserved_mib": memory.peak_mib()})
            return 0
        else:
            reply({"event": "failed", "error": f"compile_worker: unexpected command {line.strip()!r}"})
            return 2
    return 0  # stdin closed: the parent is gone


def main(argv=None) -> int:
    args = parse_args(argv)
    reply = reply_channel()
    print(f"compile_worker: {args.variant} at {args.shape}: {asdict(SHAPES[args.shape])}", file=sys.stderr)
    try:
        return serve(args, reply)
    except VariantFailed as exc:
        reply({"event": "failed", "error": exc.error, "tried": exc.tried})
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which goes on with the others
        traceback.print_exc()
        reply({"event": "failed", "error": error_text(exc)})
    return 1


if __name__ == "__main__":
    sys.exit(main())
