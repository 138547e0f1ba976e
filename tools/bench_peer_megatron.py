#!/usr/bin/env python
"""Our graphs against Megatron-Core's own CUDA graphs, in Megatron's own training loop (GPU).

    python tools/bench_peer_megatron.py --pp 1            # one GPU, ~6 minutes
    python tools/bench_peer_megatron.py --pp 2            # two GPUs, ~8 minutes
    python tools/bench_peer_megatron.py --pp 1 --profile  # + where CPU time per layer call goes
    python tools/bench_peer_megatron.py --dry-run         # print the runs

Model: Megatron-Core 0.19.2's ``GPTModel`` with ``get_gpt_layer_local_spec()`` (no
TransformerEngine) in the GPT-3 1.3B shape (hidden 2048, 24 layers, 16 heads, vocab 50304),
bf16, dropout 0.1, micro-batch 1, 8 micro-batches, trained through
``get_forward_backward_func()`` (1F1B at ``--pp 2``, no pipelining at ``--pp 1``) with
``torch.optim.AdamW`` at sequence lengths 512 and 2048. Variants, each in its own processes
(``tools/peer_megatron_worker.py``; what each one wraps is described there):

* ``eager``; ``eager_repeat`` (a second eager run: the spread of the losses between two
  identical runs, the yardstick for the graphed runs' loss differences);
* ``megatron``: its local graphs (``cuda_graph_impl="local"``, ``cuda_graph_warmup_steps`` 3,
  graph-safe RNG tracker, Megatron's DDP for ``main_grad``; graphs are recorded in the first
  step and captured by ``create_cudagraphs()`` at the end of Megatron's schedule);
* ``ours``: each ``TransformerLayer`` in ``paddle_graphpp.torch.CUDAGraphedModule`` (defaults).

Per variant and rank: tokens/s (median of timed rounds after the capture steps, with the
spread), peak reserved memory over the capture steps and the steady peak after them, losses
per step against eager's (max abs difference), graph count and capture time. A variant that
fails keeps its exact error in the record; the others go on. Writes
``benchmarks/results/peer-megatron[-pp1]-<device>.json``; its ``summary`` holds ours over
Megatron's graphs for speed at each sequence length and memory (max over ranks).
Needs ``megatron-core`` (``python -m pip install --no-deps .wheels/megatron_core-*.whl``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)
from tools import benchlib, launch  # noqa: E402

WORKER = os.path.join(REPO, "tools", "peer_megatron_worker.py")
SEQS = (512, 2048)
CPU_SEQ = 32
MAIN = ("eager", "megatron", "ours")
BUDGET_S = {1: 360.0, 2: 480.0}
RUN_CAP_S = 170.0  # one variant's processes: start, build, capture, timed rounds
MIN_RUN_S = 40.0  # below this much budget left, a run is skipped


def plan(pp: int, seqs, *, rounds: int, profile: bool, device: str) -> list[dict]:
    """The runs in order: every sequence length's main variants first, then the eager repeats
    (a budget that runs out drops those first). Profiling rides on the shortest sequence's
    graphed runs."""
    runs = []
    for seq in seqs:
        for variant in MAIN:
            prof = profile and seq == min(seqs) and variant in ("megatron", "ours")
            runs.append(_run(variant, seq, pp, rounds, prof, device))
    for seq in seqs:
        runs.append(_run("eager_repeat", seq, pp, rounds, False, device))
    return runs


def _run(variant, seq, pp, rounds, profile, device) -> dict:
    args = ["--variant", variant, "--seq", str(seq), "--pp", str(pp), "--rounds", str(rounds)]
    args += ["--profile"] if profile else []
    args += ["--device", "cpu"] if device == "cpu" else []
    return {"label": f"{variant}@seq{seq}", "variant": variant, "seq": seq, "args": args}


def run_variant(run: dict, pp: int, timeout: float) -> dict:
    """One variant on ``pp`` ranks; per-rank records (the worker's JSON line, or the failure)."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    cmd = [sys.executable, WORKER, *run["args"]]
    ends = launch.run_ranks([cmd] * pp, envs=launch.rank_envs(pp, base=env), cwd=REPO, timeout=timeout)
    record = {"command": "python tools/peer_megatron_worker.py " + " ".join(run["args"]),
              "seconds": round(max(e.seconds for e in ends), 1), "per_rank": []}
    for rank, end in enumerate(ends):
        out = benchlib.last_json_line(end.stdout) or {}
        if end.returncode != 0 or "error" in out or not out:
            out.setdefault("error", "timed out after %.0fs" % timeout if end.timed_out
                           else f"exit code {end.returncode}" + (" (stopped: a peer failed)" if end.stopped else ""))
            out["stderr_tail"] = end.stderr[-3000:]
        if "profile" in out:
            sys.stderr.write(end.stderr[-20000:])  # the worker's printed profile tables
        record["per_rank"].append(out)
    errors = [r["error"] for r in record["per_rank"] if "error" in r]
    if errors:
        record["error"] = errors[0]
    return record


def summarize(records: dict, seqs) -> dict:
    """Per sequence length and variant: speed, memory per rank, losses against eager's."""
    out = {}
    for seq in seqs:
        eager = records.get(f"eager@seq{seq}", {})
        eager_losses = _losses(eager)
        rows = {}
        for variant in (*MAIN, "eager_repeat"):
            rec = records.get(f"{variant}@seq{seq}")
            if rec is None:
                continue
            if "error" in rec:
                rows[variant] = {"error": rec["error"]}
                continue
            ranks = rec["per_rank"]
            timing = ranks[-1]  # the last stage: every rank times the same steps
            row = {
                "tokens_per_s": timing["tokens_per_s"], "tokens_per_s_rounds": timing["tokens_per_s_rounds"],
                "tokens_per_s_spread": timing["tokens_per_s_spread"],
                "peak_reserved_mib_per_rank": [r.get("peak_reserved_mib") for r in ranks],
                "steady_reserved_mib_per_rank": [r.get("steady_reserved_mib") for r in ranks],
                "peak_reserved_mib": _max(r.get("peak_reserved_mib") for r in ranks),
                "steady_reserved_mib": _max(r.get("steady_reserved_mib") for r in ranks),
                "capture_phase_s": timing["capture_phase_s"],
            }
            for key in ("graphs", "capture_s", "runners", "replays"):
                if key in ranks[0]:
                    row[key + "_per_rank"] = [r.get(key) for r in ranks]
            losses = _losses(rec)
            if losses and eager_losses and variant != "eager":
                row["max_abs_loss_diff_vs_eager"] = max(abs(a - b) for a, b in zip(losses, eager_losses))
            rows[variant] = row
        out[f"seq{seq}"] = rows
    return out


def _losses(rec: dict):
    for r in rec.get("per_rank", [])[::-1]:
        if r.get("losses"):
            return r["losses"]
    return None


def _max(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


def headline(by_seq: dict) -> dict:
    """Ours over Megatron's graphs: speed per sequence length; memory at the longest one."""
    def ratio(seq, key):
        rows = by_seq.get(f"seq{seq}", {})
        a, b = rows.get("ours", {}).get(key), rows.get("megatron", {}).get(key)
        return round(a / b, 4) if a and b else None

    ran = [k for k, rows in by_seq.items()
           if "tokens_per_s" in rows.get("megatron", {}) and sum(rows["megatron"].get("graphs_per_rank") or [0]) > 0]
    longest = max(SEQS)
    return {"ours_vs_megatron_speed_seq512": ratio(512, "tokens_per_s"),
            "ours_vs_megatron_speed_seq2048": ratio(2048, "tokens_per_s"),
            "ours_vs_megatron_peak_mem": ratio(longest, "peak_reserved_mib"),
            "ours_vs_megatron_steady_mem": ratio(longest, "steady_reserved_mib"),
            "megatron_graphs_ran": bool(ran)}


def print_table(by_seq: dict) -> None:
    head = f"{'config':<9}{'variant':<14}{'tok/s':>10}{'spread':>8}{'peak MiB':>10}{'steady':>8}{'graphs':>8}" \
           f"{'max|dloss|':>12}"
    print(head)
    print("-" * len(head))
    for tag, rows in by_seq.items():
        for name, r in rows.items():
            if "error" in r:
                print(f"{tag:<9}{name:<14} FAILED: {r['error'][:200]}")
                continue
            num = lambda k, f="{:.0f}": f.format(r[k]) if r.get(k) is not None else "-"  # noqa: E731
            graphs = sum(g or 0 for g in r["graphs_per_rank"]) if "graphs_per_rank" in r else "-"
            print(f"{tag:<9}{name:<14}{num('tokens_per_s'):>10}{num('tokens_per_s_spread', '{:.3f}'):>8}"
                  f"{num('peak_reserved_mib'):>10}{num('steady_reserved_mib'):>8}{graphs:>8}"
                  f"{num('max_abs_loss_diff_vs_eager', '{:.2e}'):>12}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, choices=[1, 2], default=2, help="pipeline stages = GPUs")
    parser.add_argument("--seqs", default=",".join(map(str, SEQS)), help="comma-separated sequence lengths")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per variant (3 steps each)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for all runs (default 360 at --pp 1, 480 at --pp 2)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one steady step of Megatron's graphs and ours at the shortest sequence")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and exit")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (a spread needs two rounds)")
    seqs = (CPU_SEQ,) if args.device == "cpu" else tuple(int(s) for s in args.seqs.split(",") if s)
    runs = plan(args.pp, seqs, rounds=args.rounds, profile=args.profile, device=args.device)
    budget = args.budget if args.budget is not None else BUDGET_S[args.pp]
    if args.dry_run:
        print(f"# budget {budget:.0f}s, {args.pp} rank(s) per run, each run in its own processes")
        for r in runs:
            print(r["label"], "python tools/peer_megatron_worker.py", *r["args"])
        return 0
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.pp:
            print(f"bench_peer_megatron: --pp {args.pp} needs {args.pp} GPU(s), found {torch.cuda.device_count()}",
                  file=sys.stderr)
            return 2
    deadline = time.monotonic() + budget
    records = {}
    for i, run in enumerate(runs, 1):
        remaining = deadline - time.monotonic()
        if remaining < MIN_RUN_S:
            records[run["label"]] = {"error": "skipped: the time budget is spent", "per_rank": []}
            print(f"[{i}/{len(runs)}] {run['label']}: skipped (budget)", flush=True)
            continue
        print(f"[{i}/{len(runs)}] {run['label']} ...", flush=True)
        records[run["label"]] = rec = run_variant(run, args.pp, timeout=min(RUN_CAP_S, remaining - 5))
        if "error" in rec:
            print(f"  failed: {rec['error'][:500]}", flush=True)
    by_seq = summarize(records, seqs)
    print_table(by_seq)
    summary = headline(by_seq)
    payload = {"command": benchlib.command(), **benchlib.environment(), "versions": _versions(),
               "pp": args.pp, "seqs": list(seqs), "budget_s": budget, "summary": summary, "by_config": by_seq,
               "runs": records}
    if args.device == "cpu":  # a check of the scripts: no result file
        print(json.dumps(payload)[:20000])
    else:
        path = benchlib.write_result("peer-megatron" + ("-pp1" if args.pp == 1 else ""), payload)
        print(f"wrote {path}")
    print(json.dumps(summary))
    return 0 if all("error" not in r for r in records.values()) else 1


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in ("megatron-core", "torch", "paddle_graphpp"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    if out["megatron-core"] is None:
        try:
            import megatron.core

            out["megatron-core"] = getattr(megatron.core, "__version__", None)
        except ImportError:
            pass
    return out


if __name__ == "__main__":
    sys.exit(main())
