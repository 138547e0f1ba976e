#!/usr/bin/env python
"""Training throughput of unmodified Hugging Face causal LMs, eager against ``graph_layers``, on one GPU.

    python tools/bench_hf.py                     # GPT-2 and Llama, hidden 512, 8 layers; ~1 min
    python tools/bench_hf.py --models llama --dtype float32

Each model (built from a config, no download; ``use_cache=False``, dropout as the config's
defaults: GPT-2 0.1, Llama none) is trained twice side by side in one process, from the same
weights: ``eager`` as built, ``graphed`` a copy with ``graph_layers`` on its decoder blocks.
One timed iteration is one training step: ``--micro-batches`` micro-batches of
``--micro-batch-size`` x ``--seq-len`` tokens, forward and backward in 1F1B-like order
(``f1 f2 b1 f3 b2 ... bN``), then a fused AdamW step and ``zero_grad``. After ``--warmup``
steps of each (the graphed copy warms up, records and captures in its first three), the two
take turns in ``--rounds`` rounds of ``--iters`` steps (order reversed every round, CUDA
synchronised before each clock; ``tools/benchlib.time_rounds``); tokens/s come from the median
round, with the spread (slowest round over fastest) beside them. The first step's losses of
both copies are recorded as a check that they train the same model.

Writes ``benchmarks/results/hf-<device>.json`` (command, device, date, versions, settings and,
per model, each variant's timing, tokens/s and the graphed/eager ratio) and prints a table.
The same models split over 2 GPUs under ``torch.distributed.pipelining``: ``tools/bench_hf_pipeline.py``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from tools import benchlib  # noqa: E402

MODELS = ("gpt2", "llama")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, micro_batches=4)
    p.add_argument("--warmup", type=int, default=6, help="untimed steps of each variant first")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--iters", type=int, default=10, help="steps per round")
    args = p.parse_args(argv)
    args.models = models_arg(p, args.models)
    return args


def add_model_args(p: argparse.ArgumentParser, *, micro_batches: int, models: bool = True) -> None:
    """The flags that choose the models (``models=False``: not that one) and their shape (shared with
    tools/bench_hf_pipeline.py and its rank, tools/hf_stage_worker.py)."""
    if models:
        p.add_argument("--models", default=",".join(MODELS), help="comma-separated: gpt2, llama")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batches", type=int, default=micro_batches)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")


def models_arg(p: argparse.ArgumentParser, text: str) -> list:
    """``--models`` as a list; an unknown or empty list ends with the parser's error."""
    models = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        p.error(f"--models takes {', '.join(MODELS)}; got {bad or 'none'}")
    return models


def make_model(kind: str, args, **config_overrides) -> tuple:
    """The model on the CPU in fp32, seeded (the same weights in every process), from a config of
    ``args``' shape (no download) with ``config_overrides`` on top; and a function returning its
    decoder blocks."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        config = LlamaConfig(**{**dict(vocab_size=args.vocab, hidden_size=args.hidden,
                                       intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                                       num_attention_heads=args.heads, num_key_value_heads=args.heads,
                                       max_position_embeddings=args.seq_len, use_cache=False), **config_overrides})
        return LlamaForCausalLM(config), (lambda m: m.model.layers)
    config = GPT2Config(**{**dict(vocab_size=args.vocab, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
                                  n_positions=args.seq_len, use_cache=False), **config_overrides})
    return GPT2LMHeadModel(config), (lambda m: m.transformer.h)


def build(kind: str, args) -> tuple:
    """The model on the GPU in ``args.dtype``, and a function returning its decoder blocks."""
    model, blocks = make_model(kind, args)
    return model.to("cuda", getattr(torch, args.dtype)), blocks


def make_step(model, batches):
    """One training step over ``batches`` (1F1B-like order), AdamW, zero_grad; returns the
    step function and a list that collects the losses of the steps it is asked to keep."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    n = len(batches)
    order = [("f", 0)] + [x for i in range(1, n) for x in (("f", i), ("b", i - 1))] + [("b", n - 1)]

    def step(keep=None):
        outs = {}
        for kind, i in order:
            if kind == "f":
                outs[i] = model(batches[i], labels=batches[i])  # the model shifts the labels
            else:
                loss = outs.pop(i).loss
                loss.backward()
                if keep is not None:
                    keep.append(loss.detach().float().item())
        opt.step()
        opt.zero_grad()

    return step


def bench_model(kind: str, args) -> dict:
    from paddle_graphpp.torch import graph_layers

    eager, blocks_of = build(kind, args)
    graphed = copy.deepcopy(eager)
    graph_layers(blocks_of(graphed))
    data = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.micro_batch_size, args.seq_len), generator=data).cuda()
               for _ in range(args.micro_batches)]
    steps = {"eager": make_step(eager, batches), "graphed": make_step(graphed, batches)}
    first = {}
    for name, step in steps.items():
        torch.manual_seed(2)
        first[name] = []
        step(keep=first[name])
        for _ in range(args.warmup - 1):
            step()
    torch.cuda.synchronize()
    timing = benchlib.time_rounds(steps, iters=args.iters, rounds=args.rounds)
    tokens = args.micro_batches * args.micro_batch_size * args.seq_len
    for t in timing.values():
        t["tokens_per_s"] = tokens / (t["median_ms"] / 1e3)
    blocks = blocks_of(graphed)
    return {
        "parameters": sum(p.numel() for p in eager.parameters()),
        "first_step_losses": first,
        "graphs_per_block": blocks[0].engine.graph_count(),
        "replays_per_block": blocks[0].engine.replays,
        "variants": timing,
        "graphed_over_eager": timing["graphed"]["tokens_per_s"] / timing["eager"]["tokens_per_s"],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_hf.py needs a CUDA device", file=sys.stderr)
        return 2
    import transformers

    import paddle_graphpp

    results = {kind: bench_model(kind, args) for kind in args.models}
    payload = {
        "command": benchlib.command(),
        **benchlib.environment(),
        "transformers": transformers.__version__,
        "paddle_graphpp": getattr(paddle_graphpp, "__version__", None),
        "settings": {k: v for k, v in vars(args).items()},
        "method": "one step = micro-batches fwd+bwd (1F1B-like order) + fused AdamW + zero_grad; median of "
                  "alternating rounds after warmup, CUDA synchronised before each clock; spread = slowest/fastest round",
        "results": results,
    }
    path = benchlib.write_result("hf", payload)
    print(f"\nHugging Face causal LMs, hidden {args.hidden}, {args.layers} layers, micro-batch "
          f"{args.micro_batch_size} x {args.seq_len}, {args.micro_batches} micro-batches, {args.dtype}, "
          f"{payload['device']}")
    print(f"{'model':8} {'variant':8} {'ms/step':>9} {'tokens/s':>10} {'spread':>7}")
    for kind, r in results.items():
        for name, t in r["variants"].items():
            print(f"{kind:8} {name:8} {t['median_ms']:9.2f} {t['tokens_per_s']:10.0f} {t['spread']:7.3f}")
        print(f"{kind:8} graphed/eager {r['graphed_over_eager']:.2f}x   first-step losses "
              f"{r['first_step_losses']['eager'][0]:.4f} / {r['first_step_losses']['graphed'][0]:.4f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
