#!/usr/bin/env python
"""Graph memory in a real pipeline (2 GPUs): eager against every graphed setting.

    python tools/bench_pipeline_memory.py --preset gpt1.3b      # GPT-3 1.3B shape, bf16
    python tools/bench_pipeline_memory.py --preset gpt1.3b-pp4 --variants eager,default  # 4 GPUs
    python tools/bench_pipeline_memory.py --preset small        # the earlier small interleaved run

Each variant is one ``tools/train_gpt.py --framework torch --pp 2`` run in its own processes
(peaks do not reset cleanly inside one process). Per rank it records the peak of reserved
memory including the capture step, the steady peak after it, ``memory_report()``, the
per-step losses, and tokens/s. Speed is compared as the median of ``--rounds`` alternating
rounds of eager and the default graphed settings.

Variants: ``eager``; ``default`` (``--cudagraph``: the library's defaults, the loss graphed with
the last stage by ``graph_loss``); ``eager_loss`` (the loss eager); ``no_accumulate``;
``per_graph`` (upstream Paddle's design: a pool per graph); ``async``
(the default settings under ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``: graph
memory nodes shared with eager stream-ordered allocations); ``per_graph_async`` (upstream's
design under that allocator, the seed's 95% -> 25%; ``summary.upstream`` sets it against
``per_graph``). Under that allocator the figures include the driver's graph memory (torch's
counters leave it out; ``tools/benchlib.DeviceMemory``). The gpt1.3b preset runs them
with 1F1B at seq 2048, eager and default interleaved (vpp 2), and eager and default at
seq 512 (launch-bound). Writes ``benchmarks/results/<name>-<device>.json`` (``--name``; by
default ``memory-pipeline-gpt1.3b-pp2``, ``memory-pipeline-gpt1.3b-pp4`` or
``memory-pipeline-small`` by preset) with ``summary.default`` (1F1B, the longest sequence) and
a PNG chart next to it. The
gpt1.3b-pp4 preset is the same model over 4 GPUs (pp=4, 6 blocks a stage), 1F1B and
interleaved at seq 2048.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)
from tools import benchlib  # noqa: E402
from tools.bench_pipeline import RECORD_LR, run_one  # noqa: E402

GPT_1_3B = ["--hidden", "2048", "--layers", "24", "--heads", "16", "--vocab", "50304", "--micro-batch-size", "1",
            "--micro-batches", "8", "--dtype", "bfloat16", "--attention", "sdpa", "--dropout", "0.1", "--steps", "10",
            "--seed", "1234", "--timeout", "120", *RECORD_LR]
PRESETS = {
    "gpt1.3b": ["--framework", "torch", "--pp", "2", *GPT_1_3B],
    "gpt1.3b-pp4": ["--framework", "torch", "--pp", "4", *GPT_1_3B],
    "small": ["--framework", "torch", "--pp", "2", "--vpp", "2", "--hidden", "2048", "--layers", "4",
              "--micro-batch-size", "4", "--micro-batches", "8", "--steps", "12", "--seed", "1234",
              "--timeout", "120", *RECORD_LR],
}
SEQ = {"gpt1.3b": (2048, 512), "gpt1.3b-pp4": (2048,), "small": (512,)}
GPUS = {"gpt1.3b": 2, "gpt1.3b-pp4": 4, "small": 2}
RECORD = {"gpt1.3b": "memory-pipeline-gpt1.3b-pp2", "gpt1.3b-pp4": "memory-pipeline-gpt1.3b-pp4",
          "small": "memory-pipeline-small"}
GRAPHED = {
    "default": ([], None),
    "eager_loss": (["--no-graph-loss"], None),
    "no_accumulate": (["--no-graph-accumulate-grads"], None),
    "per_graph": (["--graph-memory", "per_graph"], None),
    "async": ([], {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}),
    "per_graph_async": (["--graph-memory", "per_graph"], {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}),
}
SEED_UPSTREAM = ("Paddle's per-graph pools under the stream-ordered allocator: 95% -> 25% of memory "
                 "(GPT-3 1.3B PP4 BF16, 4xH100; the seed's report, not measured here)")
KEEP = ("command", "error", "stderr_tail", "peak_mem_mib", "steady_peak_mem_mib", "tokens_per_s", "losses",
        "per_rank", "seconds")


def plan(preset: str, variants: list[str], rounds: int) -> list[tuple[str, list, dict | None]]:
    """(label, train_gpt arguments, extra env) in run order: the alternating speed rounds of
    eager and default first, then one run of every other variant."""
    base = PRESETS[preset]
    runs = []
    seqs = SEQ[preset]
    long_seq = seqs[0]
    for r in range(rounds):
        for seq in seqs:
            for vpp in ((1, 2) if preset.startswith("gpt1.3b") and seq == long_seq else (None,)):
                sched = [] if vpp is None else ["--vpp", str(vpp)]
                tag = f"seq{seq}" + ("" if vpp is None else ("_1f1b" if vpp == 1 else "_vpp2"))
                for name in ("eager", "default"):
                    if r > 0 and vpp == 2:
                        continue  # interleaved: memory only, one round
                    extra = [] if name == "eager" else ["--cudagraph"]
                    runs.append((f"{name}@{tag}#{r}", base + ["--seq-len", str(seq)] + sched + extra, None))
    tag = f"seq{long_seq}" + ("_1f1b" if preset.startswith("gpt1.3b") else "")
    sched = ["--vpp", "1"] if preset.startswith("gpt1.3b") else []
    for name in variants:
        if name in ("eager", "default"):
            continue
        extra, env = GRAPHED[name]
        runs.append((f"{name}@{tag}#0", base + ["--seq-len", str(long_seq)] + sched + ["--cudagraph"] + extra, env))
    return runs


def summarize(runs: dict) -> dict:
    """Per configuration and variant: memory per rank against eager's, speed as the median
    over rounds against eager's median, and the per-step losses against eager's, next to the
    spread of two identical eager runs (``eager_loss_spread``) where two rounds ran."""
    by = {}
    for label, r in runs.items():
        name, rest = label.split("@")
        tag, _ = rest.split("#")
        by.setdefault(tag, {}).setdefault(name, []).append(r)
    out = {}
    for tag, variants in by.items():
        eager = [r for r in variants.get("eager", []) if "error" not in r]
        if not eager:
            continue
        e0 = eager[0]
        spread = benchlib.max_loss_diff(eager[0], eager[1]) if len(eager) > 1 else None
        eager_tps = statistics.median(r["tokens_per_s"] for r in eager)
        rows = {}
        for name, rs in variants.items():
            ok = [r for r in rs if "error" not in r]
            if not ok:
                rows[name] = {"error": rs[0].get("error")}
                continue
            r0 = ok[0]
            peak = [a["peak_mem_mib"] / b["peak_mem_mib"] for a, b in zip(r0["per_rank"], e0["per_rank"])]
            steady = [a["steady_peak_mem_mib"] / b["steady_peak_mem_mib"]
                      for a, b in zip(r0["per_rank"], e0["per_rank"])]
            tps = [r["tokens_per_s"] for r in ok]
            rows[name] = {
                "peak_mib_per_rank": [a["peak_mem_mib"] for a in r0["per_rank"]],
                "steady_mib_per_rank": [a["steady_peak_mem_mib"] for a in r0["per_rank"]],
                "peak_vs_eager": round(max(peak), 4), "steady_vs_eager": round(max(steady), 4),
                "tokens_per_s_median": statistics.median(tps), "tokens_per_s_all": tps,
                "speed_vs_eager": round(statistics.median(tps) / eager_tps, 4),
                "max_abs_loss_diff_vs_eager": benchlib.max_loss_diff(r0, e0),
                "eager_loss_spread": spread,
            }
        out[tag] = rows
    return out


def upstream(rows: dict) -> dict:
    """Upstream's design (a pool per graph) without and with the stream-ordered allocator, as
    the seed reported it (its 95% -> 25%): each against eager, and the one against the other
    (per-rank maxima of peak memory)."""
    out = {"seed": SEED_UPSTREAM}
    plain, with_async = rows.get("per_graph", {}), rows.get("per_graph_async", {})
    for key, row in (("per_graph", plain), ("per_graph_async", with_async)):
        out[f"{key}_peak_vs_eager"] = row.get("peak_vs_eager")
    if "peak_mib_per_rank" in plain and "peak_mib_per_rank" in with_async:
        out["per_graph_async_vs_per_graph"] = round(max(with_async["peak_mib_per_rank"]) /
                                                    max(plain["peak_mib_per_rank"]), 4)
    return out


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def chart(summary: dict, tag: str, path: str, title: str) -> None:
    """Bars of peak and steady MiB per variant and rank, eager's as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary[tag]
    names = [n for n in rows if "error" not in rows[n]]
    ranks = len(rows["eager"]["peak_mib_per_rank"])
    fig, axes = plt.subplots(1, ranks, figsize=(5 * ranks, 4), sharey=True)
    for rank, ax in enumerate(axes if ranks > 1 else [axes]):
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [rows[n]["peak_mib_per_rank"][rank] for n in names], 0.4, label="peak (capture step)")
        ax.bar([x + 0.2 for x in xs], [rows[n]["steady_mib_per_rank"][rank] for n in names], 0.4, label="steady")
        ax.axhline(rows["eager"]["peak_mib_per_rank"][rank], color="k", lw=1, ls="--", label="eager")
        ax.set_xticks(list(xs), names, rotation=30, ha="right")
        ax.set_title(f"rank {rank}")
        ax.set_ylabel("max reserved MiB")
    axes_first = axes[0] if ranks > 1 else axes
    axes_first.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpt1.3b")
    parser.add_argument("--variants", default=",".join(["eager", *GRAPHED]),
                        help="comma-separated, from: eager," + ",".join(GRAPHED))
    parser.add_argument("--rounds", type=int, default=2, help="alternating eager/default rounds for speed")
    parser.add_argument("--budget", type=float, default=560.0, help="seconds for all runs")
    parser.add_argument("--name", help="result file name: <name>-<device>.json (default by preset)")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and exit")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - {"eager", *GRAPHED})
    if unknown or args.rounds < 1:
        parser.error(f"unknown variants {unknown}" if unknown else "--rounds must be >= 1")
    runs_plan = plan(args.preset, variants, args.rounds)
    if args.dry_run:
        for label, a, env in runs_plan:
            print(label, " ".join(f"{k}={v}" for k, v in (env or {}).items()), "python tools/train_gpt.py", *a)
        return 0
    import torch

    gpus = GPUS[args.preset]
    if torch.cuda.device_count() < gpus:
        print(f"bench_pipeline_memory: --preset {args.preset} needs {gpus} GPUs, found {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget
    runs = {}
    for i, (label, a, env) in enumerate(runs_plan, 1):
        remaining = deadline - time.monotonic()
        if remaining < 25:
            runs[label] = {"error": "skipped: time budget spent"}
            continue
        print(f"[{i}/{len(runs_plan)}] {label} ...", flush=True)
        r = run_one(a, timeout=min(150.0, remaining - 5), extra_env=env)
        runs[label] = {f: r[f] for f in KEEP if f in r}
    summary = summarize(runs)
    long_tag = next(iter(summary)) if summary else None
    default_tag = "seq2048_1f1b" if args.preset.startswith("gpt1.3b") else long_tag
    print(f"{'config':<14}{'variant':<15}{'peak x':>8}{'steady x':>10}{'speed x':>9}{'loss diff':>11}"
          f"{'eager spr':>11}  MiB peak/steady per rank")
    for tag, rows in summary.items():
        for name, row in rows.items():
            if "error" in row:
                print(f"{tag:<14}{name:<15} FAILED: {row['error']}")
                continue
            diff, spread = row["max_abs_loss_diff_vs_eager"], row["eager_loss_spread"]
            print(f"{tag:<14}{name:<15}{row['peak_vs_eager']:>8.3f}{row['steady_vs_eager']:>10.3f}"
                  f"{row['speed_vs_eager']:>9.3f}{_fmt(diff):>11}{_fmt(spread):>11}"
                  f"  {row['peak_mib_per_rank']} / {row['steady_mib_per_rank']}")
    default = summary.get(default_tag, {}).get("default", {})
    payload = {"command": benchlib.command(), **benchlib.environment(), "preset": args.preset,
               "config": PRESETS[args.preset], "summary": {
                   "default": {k: default.get(k) for k in ("peak_vs_eager", "steady_vs_eager", "speed_vs_eager")},
                   "default_config": default_tag, "upstream": upstream(summary.get(default_tag, {})),
                   "by_config": summary},
               "runs": runs}
    path = benchlib.write_result(args.name or RECORD[args.preset], payload)
    print(f"wrote {path}")
    if default_tag in summary and "eager" in summary[default_tag]:
        try:
            png = str(path).replace(".json", ".png")
            chart(summary, default_tag, png, f"{args.preset}, {default_tag}: max reserved per rank")
            print(f"wrote {png}")
            if os.environ.get("OUT"):
                import shutil

                shutil.copy(png, os.environ["OUT"])
        except ImportError as exc:
            print(f"no chart ({exc})", file=sys.stderr)
    return 0 if all("error" not in r for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
