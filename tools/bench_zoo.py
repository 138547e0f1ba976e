#!/usr/bin/env python
"""The Hugging Face zoo on one GPU: each causal-LM class graphed by ``graph_layers`` and by
``graph_model`` against the same model trained eagerly, exactness and tokens/s.

    python tools/bench_zoo.py                        # the classes below; ~5 min on an H200
    python tools/bench_zoo.py --models llama mistral --compile llama

Each class is built tiny from its config (``testing/zoo.py``: fp32, dropout 0, sliding windows
shorter than the sequence, Gemma's logit softcapping; mixtures of experts with
``experts_implementation="batched_mm"``, sync-free, unless ``--experts`` says otherwise) and
trained ``--steps`` AdamW steps of ``--micro-batches`` micro-batches, in three copies from the same
weights: ``eager``, ``layers`` (``graph_layers`` on its decoder blocks) and ``model``
(``graph_model``). A graphed copy is exact when its per-step losses and its parameters after the
last step equal eager's bit for bit; where two eager runs differ (atomics in a backward), within
that spread. Then the copies (and ``torch.compile`` for the classes in ``--compile``) take turns
in ``--rounds`` alternating rounds of ``--iters`` steps; tokens/s from the median round.

Writes ``benchmarks/results/zoo-<device>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from testing import zoo  # noqa: E402
from tools import benchlib  # noqa: E402

MODELS = ("llama", "gpt2", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3",
          "gemma2", "gemma3_text", "phi3", "olmo2", "gpt_oss")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="*", default=list(MODELS))
    p.add_argument("--compile", nargs="*", default=["llama", "mistral", "gemma2", "qwen3_moe"],
                   help="classes also timed under torch.compile (each compiles for tens of seconds)")
    p.add_argument("--experts", default="batched_mm", help="experts_implementation of mixtures of experts")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="steps checked for exactness (3 warm up and capture)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", type=float, default=480, help="seconds after which the timing is skipped")
    p.add_argument("--deadline", type=float, default=900, help="seconds after which no further class is started")
    p.add_argument("--device", default="cuda", help="cpu runs the same code eagerly (a check of the script)")
    return p.parse_args(argv)


def batches(args, vocab, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(args.device) for _ in range(args.micro_batches)]
            for _ in range(steps)]


def trainer(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch):
        losses = []
        for ids in batch:
            loss = model(ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return losses
    return step


def train(model, data):
    step = trainer(model)
    losses = [torch.stack(step(b)).tolist() for b in data]
    return losses, [p.detach().clone() for p in model.parameters()]


def compare(a, b):
    """Largest difference of losses and of parameters between two runs."""
    (la, pa), (lb, pb) = a, b
    loss = max(abs(x - y) for ra, rb in zip(la, lb) for x, y in zip(ra, rb))
    param = max((x - y).abs().max().item() for x, y in zip(pa, pb))
    return loss, param


def replays(model):
    whole = model.__dict__.get("_graphpp_whole")
    if whole is not None:
        return whole.graphed._engine.replays
    blocks = zoo.blocks_of(model)
    return sum(b.engine.replays for b in blocks)


def measure(name, args, out):
    from paddle_graphpp.torch import graph_layers, graph_model

    row = {"class": None}
    try:
        base = zoo.build(name, experts_implementation=args.experts).to(args.device)
    except Exception as exc:  # noqa: BLE001 - a class that does not build is recorded as such
        row["build"] = f"{type(exc).__name__}: {exc}"[:300]
        return row
    row["class"] = type(base).__name__
    vocab = base.config.get_text_config().vocab_size
    data = batches(args, vocab, args.steps)
    eager = train(copy.deepcopy(base), data)
    again = train(copy.deepcopy(base), data)
    spread = compare(eager, again)
    row["eager_vs_eager"] = {"loss": spread[0], "param": spread[1]}
    copies = {"eager": copy.deepcopy(base)}
    for door, graph in (("layers", lambda m: graph_layers(zoo.blocks_of(m))), ("model", graph_model)):
        model = copy.deepcopy(base)
        try:
            graph(model)
            run = train(model, data)
        except Exception as exc:  # noqa: BLE001 - recorded: a refusal or a capture error, with its message
            row[door] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            traceback.print_exc(limit=3)
            continue
        diff = compare(eager, run)
        exact = diff == (0.0, 0.0)
        row[door] = {"exact": exact, "within_eager_spread": diff[0] <= spread[0] and diff[1] <= spread[1],
                     "loss_diff": diff[0], "param_diff": diff[1], "replays": replays(model)}
        copies[door] = model
    if time.perf_counter() - out["started"] > args.budget:
        row["timing"] = "skipped: budget"
        return row
    steps = {door: trainer(m) for door, m in copies.items()}
    if name in args.compile:
        compiled = copy.deepcopy(base)
        compiled.forward = torch.compile(compiled.forward)
        steps["compile"] = trainer(compiled)
    data = batches(args, vocab, 1, seed=1)[0]
    variants = {door: (lambda s=s: s(data)) for door, s in steps.items()}
    for fn in variants.values():  # warm up (and capture or compile) outside the clock
        for _ in range(4):
            fn()
    timing = benchlib.time_rounds(variants, iters=args.iters, rounds=args.rounds)
    tokens = args.batch * args.seq * args.micro_batches
    row["tokens_per_s"] = {d: tokens / (t["median_ms"] / 1e3) for d, t in timing.items()}
    row["spread"] = {d: t["spread"] for d, t in timing.items()}
    row["vs_eager"] = {d: timing["eager"]["median_ms"] / t["median_ms"] for d, t in timing.items() if d != "eager"}
    if "compile" in timing:
        row["vs_compile"] = {d: timing["compile"]["median_ms"] / timing[d]["median_ms"]
                             for d in ("layers", "model") if d in timing}
    return row


def record(args, rows):
    exact = {d: sorted(n for n, r in rows.items() if r.get(d, {}).get("exact")) for d in ("layers", "model")}
    payload = {"environment": benchlib.environment(), "settings": vars(args), "models": rows,
               "summary": {"classes": len(rows), "exact_layers": exact["layers"], "exact_model": exact["model"]}}
    return benchlib.write_result("zoo", payload)


def main(argv=None):
    args = parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = {"started": time.perf_counter()}
    rows = {}
    for name in args.models:
        if time.perf_counter() - out["started"] > args.deadline:
            rows[name] = {"class": None, "skipped": "deadline"}
        else:
            rows[name] = measure(name, args, out)
        print(f"[{time.perf_counter() - out['started']:5.0f} s] {name}", rows[name], flush=True)
        path = record(args, rows)  # after every class, so that an interrupted run keeps what it measured
    print(f"\n{'class':14s} {'layers':>14s} {'model':>14s} {'x eager L/M':>12s} {'x compile L/M':>14s}")
    for name, r in rows.items():
        def verdict(d):
            v = r.get(d, {})
            return "exact" if v.get("exact") else "spread" if v.get("within_eager_spread") else \
                ("ERR" if "error" in v else "DIFF" if v else "-")
        ve, vc = r.get("vs_eager", {}), r.get("vs_compile", {})
        print(f"{name:14s} {verdict('layers'):>14s} {verdict('model'):>14s} "
              f"{ve.get('layers', 0):5.2f}/{ve.get('model', 0):5.2f} {vc.get('layers', 0):6.2f}/{vc.get('model', 0):5.2f}")
    print(path)


if __name__ == "__main__":
    main()
