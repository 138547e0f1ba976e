"""One pipeline rank's memory on one GPU: a stage of the GPT run in its rank's 1F1B order.

    python tools/diagnostics/stage_memory.py                              # both stages of pp=2, eager and default
    python tools/diagnostics/stage_memory.py --stages 1 --variants eager,default --seq-len 512 --trace

A rank of a pipeline sees only its stage: the forwards and backwards of its micro-batches in
the order its schedule runs them, activations coming in and gradients coming back. This tool
runs exactly that in one process on one GPU (inputs and output gradients are random tensors
of the shapes the neighbours would send; the last stage computes the loss itself), so the
memory a rank of a multi-GPU pipeline holds can be studied where only one GPU is at hand.
Each (stage, variant) runs in its own process; per run it prints the peak including the
capture step, the steady peak after it, and with ``--trace`` where the memory was at the peak
(tools/diagnostics/memtrace.py). Not included: the peer-to-peer buffers and the tied-weight all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from testing import launch  # noqa: E402
from tools.benchlib import DeviceMemory, last_json_line  # noqa: E402

VARIANTS = {  # graph_stage_module options per variant (None: eager)
    "eager": None,
    "default": {},
    "no_accumulate": {"accumulate_grads": False},
    "per_graph": {"memory": "per_graph"},
    "no_reserve": {},  # default options, without the pool's reservation for the optimizer (see VARIANT_ENV)
    "eager_tied": {"shared": "tied"},  # the tied embedding / head kept eager (the default before 2026-11-25)
    "graphed_loss": {},  # default options, and the last stage's loss graphed too (graph_loss)
    "eager_async": None,  # eager under the stream-ordered allocator (see VARIANT_ENV)
    "async": {},  # default options under the stream-ordered allocator
    "per_graph_async": {"memory": "per_graph"},  # upstream Paddle's design under the stream-ordered allocator
}
_ASYNC = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
VARIANT_ENV = {"no_reserve": {"FLAGS_graphpp_reserve_pool": "0"}, "eager_async": _ASYNC, "async": _ASYNC,
               "per_graph_async": _ASYNC}
WARMUP = 3  # graph_stage_module's num_warmup_steps, as the trainer uses


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[str]:
    """The order one stage of a 1F1B pipeline runs: ``stages - stage`` forwards, then one
    backward per forward, then the remaining backwards."""
    warm = min(stages - stage, micro_batches)
    order = [f"f{i}" for i in range(warm)]
    for i in range(warm, micro_batches):
        order += [f"b{i - warm}", f"f{i}"]
    order += [f"b{i}" for i in range(micro_batches - warm, micro_batches)]
    return order


def zero_bubble(stage: int, stages: int, micro_batches: int) -> list[str]:
    """The 1F1B order with each backward split as a zero-bubble schedule runs it: the input
    pass ``i<n>`` where 1F1B runs ``b<n>``, and that micro-batch's weight pass ``w<n>`` one
    slot later (after the next input pass; the last ones at the end), so one weight pass is
    pending at a time, as ZB-H1 defers them into the bubble."""
    order, pending = [], []
    for op in one_f_one_b(stage, stages, micro_batches):
        if op[0] == "b":
            order.append("i" + op[1:])
            if pending:
                order.append("w" + pending.pop(0))
            pending.append(op[1:])
        else:
            order.append(op)
    return order + ["w" + n for n in pending]


def worker(args) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from testing.gpt_shape import GPTShape
    from testing.gpt_torch import build_chunk

    torch.cuda.set_device(0)
    if args.trace:
        from tools.diagnostics import memtrace

        memtrace.start()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    shape = GPTShape(hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq_len=args.seq_len,
                     layers=args.layers, dropout=0.1, attention="sdpa")
    per = args.layers // args.pp
    first, last = args.stage == 0, args.stage == args.pp - 1
    chunk, tied = build_chunk(shape, range(args.stage * per, (args.stage + 1) * per), first=first, last=last,
                              seed=1234)
    chunk.to(device=dev, dtype=dtype)
    params = list(chunk.parameters())
    options = VARIANTS[args.variant]
    model = chunk
    if options is not None:
        from paddle_graphpp.torch.pipeline import graph_stage_module

        if options.get("shared") == "tied":
            options = {**options, "shared": tied if isinstance(tied, tuple) else (tied,)}
        model = graph_stage_module(chunk, WARMUP, name=f"stage{args.stage}", **options)
    def loss_fn(y, labels):
        return F.cross_entropy(y.flatten(0, 1).float(), labels.flatten()) / args.micro_batches

    if last and args.variant == "graphed_loss":
        from paddle_graphpp.torch.pipeline import graph_loss

        loss_fn = graph_loss(loss_fn, WARMUP)
    optimizer = torch.optim.AdamW(params, lr=3e-4)
    gen = torch.Generator(device=dev).manual_seed(args.stage)
    mb, seq, hid = 1, args.seq_len, args.hidden
    order = (zero_bubble if args.order == "zb" else one_f_one_b)(args.stage, args.pp, args.micro_batches)
    passes = {}  # zero-bubble order: what each input pass left for its weight pass
    memory = DeviceMemory()  # under cudaMallocAsync: torch's reserved memory plus the driver's graph memory
    per_step = []  # (peak reserved in the step, reserved at its end, graph pools' reserved at its end), MiB
    losses = []
    seconds = []
    steady_since_us = None
    for step in range(args.steps):
        if step == args.steady_from:
            steady_since_us = time.time() * 1e6
        memory.reset_peak()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        kept = []  # --keep-outputs: the last stage's outputs, to the end of the step
        outs, inputs = {}, {}
        for op in order:
            i = int(op[1:])
            if op[0] == "f":
                if first:
                    x = torch.randint(0, args.vocab, (mb, seq), device=dev, generator=gen)
                else:
                    x = torch.randn(mb, seq, hid, device=dev, dtype=dtype, generator=gen).requires_grad_()
                outs[i], inputs[i] = model(x), x
            elif op[0] == "w":
                groups, _keep = passes.pop(i)
                stage_backward_weight(model.parameters(), groups)
            else:
                y, x = outs.pop(i), inputs.pop(i)
                if last:
                    labels = torch.randint(0, args.vocab, (mb, seq), device=dev, generator=gen)
                    loss = loss_fn(y, labels)
                    losses.append(loss.detach().clone())  # a graphed loss is overwritten by its next replay
                    root, grad = loss, None
                else:
                    root, grad = y, torch.randn(y.shape, device=dev, dtype=dtype, generator=gen)
                if op[0] == "b":
                    root.backward(grad)
                else:  # the input pass of a zero-bubble schedule
                    _, groups = stage_backward_input([root], None if grad is None else [grad], [x],
                                                     model.parameters())
                    # the weight pass restarts autograd inside this micro-batch's graph: keep it
                    # alive until then, as the pipelining stage keeps its outputs
                    passes[i] = (groups, root)
                if last and args.keep_outputs:
                    # as PipelineStage keeps output_chunks to merge them, detached after the backward
                    kept.append(y if y._is_view() else y.detach_())
        optimizer.step()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        del kept  # PipelineStage clears them when the next step starts
        per_step.append((memory.peak_mib(), memory.current_mib(), _pools_reserved_mib(memory)))
    out = {"stage": args.stage, "variant": args.variant, "seq_len": seq,
           "peak_mib": max(p for p, _, _ in per_step), "steady_mib": max(p for p, _, _ in per_step[args.steady_from:]),
           "per_step_mib": per_step,
           "steady_step_ms": 1000 * statistics.median(seconds[args.steady_from:]),
           "allocated_end_mib": torch.cuda.memory_allocated() / 2**20,
           "loss_last": float(torch.stack(losses[-args.micro_batches:]).sum()) if losses else None}
    if options is not None:
        from paddle_graphpp.core.memory import memory_report

        from paddle_graphpp.torch.runtime import RUNTIME

        out["memory_report"] = memory_report()
        out.update(RUNTIME.lending_report() or dict.fromkeys(
            ("optimizer_steps_in_pool", "optimizer_steps_declined", "pool_reserved_before_capture_mib")))
    if args.trace:
        from tools.diagnostics import memtrace

        out["trace"] = memtrace.analyze(torch.cuda.memory._snapshot(), steady_since_us=steady_since_us)
    return out


def _pools_reserved_mib(memory) -> float:
    """Reserved by the graph pools (every pool but the default one); under the stream-ordered
    allocator, the driver's graph memory."""
    import torch

    if memory.graphs is not None:
        return memory.graph_mib()
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)) / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default="0,1", help="comma-separated stage indices (default 0,1)")
    ap.add_argument("--variants", default="eager,default", help="comma-separated, from: " + ",".join(VARIANTS))
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--steady-from", type=int, default=6, help="first step of the steady state")
    ap.add_argument("--order", choices=["1f1b", "zb"], default="1f1b",
                    help="1F1B, or its backwards split into input and weight passes (zero-bubble, ZB-H1-like; "
                         "stages after the first)")
    ap.add_argument("--keep-outputs", action="store_true",
                    help="the last stage keeps each micro-batch's output (detached after its backward) to the end of "
                         "the step, as torch.distributed.pipelining's PipelineStage does to return them merged "
                         "(default: dropped after the backward, as the records before 2026-11-25 evening ran)")
    ap.add_argument("--trace", action="store_true", help="break the peak down by allocation site")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    ap.add_argument("--out", help="write all runs as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="eager", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    variants = [v for v in args.variants.split(",") if v]
    if args.order == "zb" and 0 in [int(x) for x in args.stages.split(",") if x]:
        ap.error("--order zb: the first stage has no input gradient to split off (its input is tokens); "
                 "use --stages 1 (or later)")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    stages = [int(s) for s in args.stages.split(",")]
    if any(not 0 <= s < args.pp for s in stages) or args.layers % args.pp:
        ap.error(f"stages must be in [0, {args.pp}) and --layers a multiple of --pp")
    passthrough = _drop_values(argv if argv is not None else sys.argv[1:], ("--stages", "--variants", "--out"))
    runs = []
    for stage in stages:
        for variant in variants:
            cmd = [sys.executable, __file__, *passthrough, "--worker", "--stage", str(stage), "--variant", variant]
            res = launch.run(cmd, timeout=args.timeout,
                             env={**os.environ, "NCCL_NVLS_ENABLE": "0", **VARIANT_ENV.get(variant, {})})
            rec = last_json_line(res.stdout) if res.returncode == 0 else None
            if rec is None:
                rec = {"stage": stage, "variant": variant, "error": f"exit {res.returncode}",
                       "stderr_tail": (res.stderr or "")[-2000:]}
            runs.append(rec)
            _print_row(rec, runs)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs}, indent=1))
    return 0 if all("error" not in r for r in runs) else 1


def _drop_values(argv: list, names: tuple) -> list:
    """``argv`` without the options in ``names`` (and their values)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if a.split("=", 1)[0] in names:
            continue
        out.append(a)
    return out


def _per_step(per_step: list) -> str:
    """Each step's figures; for long runs the first five, then each change of the step peak."""
    text = [f"{a:.0f}/{b:.0f}/{c:.0f}" for a, b, c in per_step]
    if len(text) <= 20:
        return " ".join(text)
    changes = [f"step {i}: {text[i]}" for i in range(5, len(text)) if per_step[i][0] != per_step[i - 1][0]]
    return " ".join(text[:5]) + f" ... {len(text)} steps; later changes of the step peak: " + (
        ", ".join(changes) if changes else "none")


def _print_row(rec: dict, runs: list) -> None:
    if "error" in rec:
        print(f"stage {rec['stage']} {rec['variant']:<14} ERROR {rec['error']}\n{rec.get('stderr_tail', '')}")
        return
    eager = next((r for r in runs if r.get("variant") == "eager" and r.get("stage") == rec["stage"]
                  and "error" not in r), None)
    ratio = (f"  x{rec['peak_mib'] / eager['peak_mib']:.3f} / x{rec['steady_mib'] / eager['steady_mib']:.3f}"
             if eager else "")
    print(f"stage {rec['stage']} {rec['variant']:<14} peak {rec['peak_mib']:8.0f}  steady {rec['steady_mib']:8.0f} MiB"
          f"{ratio}  step {rec['steady_step_ms']:.1f} ms", flush=True)
    print("   optimizer steps in the graph pool:", rec.get("optimizer_steps_in_pool"),
          "declined:", rec.get("optimizer_steps_declined"), "reserved before capture (MiB):",
          rec.get("pool_reserved_before_capture_mib"),
          " per step (peak / end / pools):", _per_step(rec["per_step_mib"]))
    if rec.get("trace"):
        from tools.diagnostics import memtrace

        print(memtrace.describe(rec["trace"]))


if __name__ == "__main__":
    sys.exit(main())
