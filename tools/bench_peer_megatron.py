#!/usr/bin/env python
"""Our graphs against Megatron-Core's own CUDA graphs, in Megatron's own training loop (GPU).

    python tools/bench_peer_megatron.py --pp 1            # one GPU, ~8 minutes
    python tools/bench_peer_megatron.py --pp 2            # two GPUs, ~9 minutes
    python tools/bench_peer_megatron.py --pp 4            # four GPUs, ~9 minutes
    python tools/bench_peer_megatron.py --tp 2 --pp 2     # four GPUs: 2-way tensor parallel per stage
    python tools/bench_peer_megatron.py --pp 1 --profile  # + where CPU time per layer call goes
    python tools/bench_peer_megatron.py --dry-run         # print the runs and the record's name
    python tools/bench_peer_megatron.py --moe             # mixture of experts, one GPU
    python tools/bench_peer_megatron.py --moe --optimizer fused   # every variant with fused AdamW

Model: Megatron-Core 0.19.2's ``GPTModel`` with ``get_gpt_layer_local_spec()`` (no
TransformerEngine) in the GPT-3 1.3B shape (hidden 2048, 24 layers, 16 heads, vocab 50304),
bf16, dropout 0.1, micro-batch 1, 8 micro-batches, trained through
``get_forward_backward_func()`` (1F1B at ``--pp`` 2 and 4, no pipelining at ``--pp 1``) with
``torch.optim.AdamW`` at sequence lengths 512 and 2048, on ``--tp`` x ``--pp`` GPUs (Megatron's
tensor parallelism within a stage at ``--tp 2``, no sequence parallelism; no data parallelism).
Variants, each in its own processes
(``tools/peer_megatron_worker.py``; what each one wraps is described there):

* ``eager``; ``eager_repeat`` (a second eager run: the spread of the losses between two
  identical runs, the yardstick for the graphed runs' loss differences);
* ``megatron``: its local graphs (``cuda_graph_impl="local"``, ``cuda_graph_warmup_steps`` 3,
  graph-safe RNG tracker, Megatron's DDP for ``main_grad``; graphs are recorded in the first
  step and captured by ``create_cudagraphs()`` at the end of Megatron's schedule);
* ``ours``: each ``TransformerLayer`` in ``paddle_graphpp.torch.CUDAGraphedModule``; on the
  last stage the cross-entropy in ``graph_loss`` and, on the last stage of a pipeline, the output
  layer graphed in place (defaults). At pp=1 (and ``--moe``) the output layer is handed the
  embedding's weight and stays eager by default: graphed there (``--ours-head graphed``) it held
  more memory and ran no faster (docs/moe.md). ``--ours-loss eager`` / ``--ours-head eager`` leave
  those eager, as the records without an ``ours_loss`` / ``ours_head`` key did. Each rank's ``graphs`` count includes
  the loss's and the head's (``loss_graphs``, ``head_graphs`` give them apart).
  ``FLAGS_graphpp_pool_expandable=1``, the default, is set explicitly so that the environment
  cannot make it the next variant;
* ``ours_segments``: the same under ``FLAGS_graphpp_pool_expandable=0`` (graph pools of
  ordinary segments; which layout holds less depends on the stage, docs/memory.md).

Megatron's graphs and both layouts of ours run ``--repeats`` times (2) per sequence length in
alternating order (megatron, ours, ours_segments, ours_segments, ours, megatron; records up to
code 6dc9927 ran ``ours_segments`` once): their figures pool the runs' rounds, so that
a machine that drifts between runs (it does: the same eager run has read 0.70x its first run a
few minutes later) moves both alike. Their ``tokens_per_s_spread`` is over all runs' rounds
(drift included); ``tokens_per_s_spread_runs`` holds each run's own. A repeat that fails or that
the budget skips is listed in ``failed_runs``; the runs that finished stand.

Per variant and rank: tokens/s (median of timed rounds after the capture steps, with the
spread), peak reserved memory over the capture steps and the steady peak after them, losses
per step against eager's (max abs difference, on the last stage), graph count and capture time.
A variant that fails keeps its exact error in the record; the others go on. Writes
``benchmarks/results/peer-megatron-pp<P>-<device>.json`` (``peer-megatron-tp<T>pp<P>-<device>.json``
at ``--tp 2``); its ``summary`` holds ours over Megatron's graphs for speed at each sequence
length and memory (max over ranks), and ours over eager's peak memory per rank (the whole run,
capture steps included), the worst over the sequence lengths.
Needs ``megatron-core`` 0.19.2 (``python -m pip install --no-deps megatron-core==0.19.2``; for a GPU
machine without a package index, ``python -m pip download --no-deps --only-binary=:all:
--python-version 3.12 megatron-core==0.19.2 -d .wheels`` here, then ``python -m pip install
--no-deps .wheels/megatron_core-*.whl`` there).

``--moe``: the mixture-of-experts GPT of ``tools/peer_megatron_worker.py --model moe`` (the
launch-bound shape of ``tools/bench_moe.py``: hidden 1024, 8 layers, 16 heads, 16 experts of
width 512, top-2, vocabulary 32000, bf16, 4 micro-batches of 2 x 256 tokens, AdamW) on one GPU,
for each ``--routings`` (``capacity``: drop and pad at factor 1.25, both peers graph whole
layers; ``dropless``: Megatron's default dispatch, which reads the host, both peers graph around
it; the worker's docstring says why, from Megatron's source). Per routing: eager, then Megatron's
graphs and ours ``--repeats`` times in alternating order, then the eager repeats. Per variant
tokens/s (median of the pooled rounds), peak allocated and reserved memory (capture steps
included, each variant in its own process), losses against eager's. Writes
``benchmarks/results/peer-megatron-moe-<device>.json``; its ``summary`` holds, per routing, ours
and Megatron's graphs over eager for speed and peak memory, and ours over Megatron's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)
from testing import launch  # noqa: E402
from tools import benchlib  # noqa: E402
from tools.peer_megatron_worker import OPTIMIZERS  # noqa: E402

WORKER = os.path.join(REPO, "tools", "peer_megatron_worker.py")
SEQS = (512, 2048)
CPU_SEQ = 32
MAIN = ("eager", "megatron", "ours")
# Variants that run a worker variant under settings: ours with the graph pools' layout set either
# way (an environment that sets the flag must not make the two alike): expandable (the default)
# and ordinary segments (docs/memory.md: where a last stage needs less memory that way).
VARIANT_SETTINGS = {"ours": ("ours", {"FLAGS_graphpp_pool_expandable": "1"}),
                    "ours_segments": ("ours", {"FLAGS_graphpp_pool_expandable": "0"})}
VARIANTS = (*MAIN, "ours_segments", "eager_repeat")
TP_CHOICES = (1, 2)
PP_CHOICES = (1, 2, 4)
# By ranks per run (tp * pp). A run needs 25-50 s on H100/H200 (start, build, capture, timed
# rounds; at pp=2 on 2 x H200 29-46 s at seq 512, eager the longest), 16 runs in all; the budget
# keeps the whole benchmark within a 10-minute GPU session and drops the eager repeats first
# (at --pp 1, where eager at seq 512 is slowest, not yet checked with rounds of 12 steps).
BUDGET_S = {1: 480.0, 2: 540.0, 4: 560.0, 8: 560.0}
RUN_CAP_S = {1: 170.0, 2: 170.0, 4: 200.0, 8: 200.0}  # one variant's processes: start, build, capture, rounds
MIN_RUN_S = 40.0  # below this much budget left, a run is skipped
MOE_SEQ = 256  # tools/bench_moe.py's --seq
MOE_ROUTINGS = ("capacity", "dropless")
MOE_VARIANTS = ("eager", "megatron", "ours", "eager_repeat")  # the default of --moe (ours_segments if named)
MOE_RECORD = "peer-megatron-moe"


def record_name(tp: int, pp: int) -> str:
    """The record's name without its device: ``peer-megatron-pp2``, ``peer-megatron-tp2pp2``."""
    return f"peer-megatron-pp{pp}" if tp == 1 else f"peer-megatron-tp{tp}pp{pp}"


def plan(pp: int, seqs, *, rounds: int, profile: bool, device: str, tp: int = 1,
         variants=VARIANTS, memory_trace: bool = False, repeats: int = 2, ours_loss: str = "graphed",
         ours_head: str = "graphed") -> list[dict]:
    """The runs in order: per sequence length eager, then Megatron's graphs and ours in both
    pool layouts ``repeats`` times each, every other repeat mirrored (megatron, ours,
    ours_segments, then ours_segments, ours, megatron, ...: a drift of the machine between runs
    moves all three alike), then, after every
    length, the eager repeats (a budget that runs out drops those first). Profiling rides on
    the shortest sequence's first Megatron and ours runs."""
    runs = []
    repeats = 1 if memory_trace else max(1, repeats)
    for seq in seqs:
        order = ["eager"] if "eager" in variants else []
        trio = ["megatron", "ours", "ours_segments"]
        for k in range(repeats):  # mirrored every other repeat: a steady drift moves all three alike
            order += [v for v in (trio if k % 2 == 0 else trio[::-1]) if v in variants]
        seen: dict = {}
        for variant in order:
            seen[variant] = seen.get(variant, 0) + 1
            prof = profile and seq == min(seqs) and variant in ("megatron", "ours") and seen[variant] == 1
            runs.append(_run(variant, seq, tp, pp, rounds, prof, device, memory_trace, seen[variant], ours_loss,
                             ours_head))
    for seq in seqs:
        if "eager_repeat" in variants:
            runs.append(_run("eager_repeat", seq, tp, pp, rounds, False, device, memory_trace))
    return runs


def plan_moe(routings, *, seq: int, rounds: int, profile: bool, device: str, variants=MOE_VARIANTS,
             memory_trace: bool = False, repeats: int = 2, ours_loss: str = "graphed",
             ours_head: str = "graphed") -> list[dict]:
    """The MoE runs in order, one GPU each: per routing eager, then Megatron's graphs and ours
    ``repeats`` times, every other repeat mirrored; after every routing the eager repeats.
    Labels ``<variant>@<routing>[#k]``."""
    runs = []
    repeats = 1 if memory_trace else max(1, repeats)
    for routing in routings:
        order = ["eager"] if "eager" in variants else []
        trio = ["megatron", "ours", "ours_segments"]
        for k in range(repeats):
            order += [v for v in (trio if k % 2 == 0 else trio[::-1]) if v in variants]
        seen: dict = {}
        for variant in order:
            seen[variant] = seen.get(variant, 0) + 1
            prof = profile and variant in ("megatron", "ours") and seen[variant] == 1 and routing == routings[0]
            runs.append(_run(variant, seq, 1, 1, rounds, prof, device, memory_trace, seen[variant], ours_loss,
                             ours_head, routing=routing))
    for routing in routings:
        if "eager_repeat" in variants:
            runs.append(_run("eager_repeat", seq, 1, 1, rounds, False, device, memory_trace, routing=routing))
    return runs


def _run(variant, seq, tp, pp, rounds, profile, device, memory_trace=False, repeat=1, ours_loss="graphed",
         ours_head="graphed", routing=None) -> dict:
    """One run; ``routing``: the MoE model with that routing (labels ``<variant>@<routing>``)."""
    worker_variant, env = VARIANT_SETTINGS.get(variant, (variant, {}))
    moe = ["--model", "moe", "--routing", routing] if routing else []
    args = ["--variant", worker_variant, *moe, "--seq", str(seq), "--tp", str(tp), "--pp", str(pp),
            "--rounds", str(rounds)]
    args += ["--loss", ours_loss, "--head", ours_head] if worker_variant == "ours" else []
    args += ["--profile"] if profile else []
    args += ["--memory-trace"] if memory_trace else []
    args += ["--device", "cpu"] if device == "cpu" else []
    label = f"{variant}@{routing or f'seq{seq}'}" + (f"#{repeat}" if repeat > 1 else "")
    return {"label": label, "variant": variant, "worker": worker_variant, "seq": seq, "args": args, "env": env}


def _in_ddp(runs: list) -> list:
    """The runs with eager and ours in Megatron's DDP as well (``--ddp``; Megatron's graphs always are)."""
    return [dict(r, args=r["args"] + ["--ddp"]) if r["worker"] != "megatron" else r for r in runs]


def _with_options(runs: list, args) -> list:
    """The runs with ``--ddp`` (eager and ours in Megatron's DDP as well; Megatron's graphs always
    are) and ``--optimizer`` applied."""
    runs = _in_ddp(runs) if args.ddp else runs
    return runs if args.optimizer == "foreach" else [dict(r, args=r["args"] + ["--optimizer", args.optimizer])
                                                     for r in runs]


def _suffix(args) -> str:
    """What the options add to the record's name: ``-ddp``, ``-fused-adam``."""
    return ("-ddp" if args.ddp else "") + ("-fused-adam" if args.optimizer == "fused" else "")


def _command(run: dict) -> str:
    """A run's command line, its settings first (``NAME=VALUE``), as a shell would take it."""
    settings = [f"{k}={v}" for k, v in run.get("env", {}).items()]
    return " ".join([*settings, "python tools/peer_megatron_worker.py", *run["args"]])


def run_variant(run: dict, world: int, timeout: float) -> dict:
    """One variant on ``world`` (tp * pp) ranks; per-rank records (the worker's JSON line, or the failure)."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", **run.get("env", {}))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    cmd = [sys.executable, WORKER, *run["args"]]
    ends = launch.run_ranks([cmd] * world, envs=launch.rank_envs(world, base=env), cwd=REPO, timeout=timeout)
    record = {"command": _command(run),
              "seconds": round(max(e.seconds for e in ends), 1), "per_rank": []}
    for rank, end in enumerate(ends):
        out = benchlib.last_json_line(end.stdout) or {}
        if end.returncode != 0 or "error" in out or not out:
            out.setdefault("error", "timed out after %.0fs" % timeout if end.timed_out
                           else f"exit code {end.returncode}" + (" (stopped: a peer failed)" if end.stopped else ""))
            out["stderr_tail"] = end.stderr[-3000:]
        if "profile" in out or "memory_trace" in out:
            sys.stderr.write(end.stderr[-20000:])  # the worker's printed profile tables or memory breakdown
        record["per_rank"].append(out)
    errors = [r["error"] for r in record["per_rank"] if "error" in r]
    if errors:
        record["error"] = errors[0]
    return record


def summarize(records: dict, seqs) -> dict:
    """Per sequence length (or MoE routing: ``seqs`` may hold its names) and variant: speed,
    memory per rank, losses against eager's. A variant run more than once (``--repeats``) pools
    its runs' timed rounds (the median and spread over all of them; ``tokens_per_s_runs``: each
    run's median) and keeps each rank's highest peak."""
    out = {}
    for seq in seqs:
        tag = seq if isinstance(seq, str) else f"seq{seq}"
        runs_of = _runs_by_variant(records, tag)
        eager_losses = _losses(runs_of.get("eager", [{}])[0])
        rows = {}
        for variant in VARIANTS:
            recs = runs_of.get(variant)
            if not recs:
                continue
            done = [r for r in recs if "error" not in r]
            if not done:
                rows[variant] = {"error": recs[0]["error"]}
                continue
            rows[variant] = _row(variant, done, eager_losses)
            if len(done) < len(recs):  # a repeat failed or the budget skipped it: the others stand
                rows[variant]["failed_runs"] = [r["error"] for r in recs if "error" in r]
        out[tag] = rows
    return out


def _runs_by_variant(records: dict, tag: str) -> dict:
    """``{variant: [record, ...]}`` of one configuration, in run order (labels
    ``<variant>@<tag>`` and ``<variant>@<tag>#<k>``; ``tag`` is ``seq<seq>`` or a MoE routing)."""
    out: dict = {}
    for label, rec in records.items():
        variant, _, rest = label.partition("@")
        if rest.split("#")[0] == tag:
            out.setdefault(variant, []).append(rec)
    return out


def _row(variant: str, recs: list, eager_losses) -> dict:
    timings = [rec["per_rank"][-1] for rec in recs]  # a rank of the last stage: every rank times the same steps
    rounds = [t for timing in timings for t in timing["tokens_per_s_rounds"]]
    world = len(recs[0]["per_rank"])
    per_rank = lambda key: [_max(rec["per_rank"][i].get(key) for rec in recs) for i in range(world)]  # noqa: E731
    ranks = recs[0]["per_rank"]
    row = {
        "tokens_per_s": statistics.median(rounds), "tokens_per_s_rounds": rounds,
        # over every run's rounds: drift between the runs included, where one run's spread has none
        "tokens_per_s_spread": max(rounds) / min(rounds),
        "peak_reserved_mib_per_rank": per_rank("peak_reserved_mib"),
        "steady_reserved_mib_per_rank": per_rank("steady_reserved_mib"),
        "peak_allocated_mib_per_rank": per_rank("peak_allocated_mib"),
        "steady_allocated_mib_per_rank": per_rank("steady_allocated_mib"),
        "capture_phase_s": timings[0]["capture_phase_s"],
    }
    row["peak_reserved_mib"] = _max(row["peak_reserved_mib_per_rank"])
    row["steady_reserved_mib"] = _max(row["steady_reserved_mib_per_rank"])
    for key in ("peak_allocated_mib", "steady_allocated_mib"):
        row[key] = _max(row[key + "_per_rank"])
    if len(recs) > 1:
        row["tokens_per_s_runs"] = [t["tokens_per_s"] for t in timings]
        row["tokens_per_s_spread_runs"] = [t.get("tokens_per_s_spread") for t in timings]  # each run's own
    for key in ("graphs", "capture_s", "runners", "replays"):
        if key in ranks[0]:
            row[key + "_per_rank"] = [r.get(key) for r in ranks]
    losses = [run for run in (_losses(rec) for rec in recs) if run]
    if losses and eager_losses and variant != "eager":
        row["max_abs_loss_diff_vs_eager"] = max(abs(a - b) for run in losses for a, b in zip(run, eager_losses))
    return row


def _losses(rec: dict):
    for r in rec.get("per_rank", [])[::-1]:
        if r.get("losses"):
            return r["losses"]
    return None


def _max(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


def headline(by_seq: dict, *, world: int = 1) -> dict:
    """Ours over Megatron's graphs: speed per sequence length; memory at the longest one. Ours
    over eager's peak memory per rank (``world`` entries, None where unmeasured): the peak of the
    whole run, capture steps included, the worst over the sequence lengths. The same for
    ``ours_segments`` (ours under ``FLAGS_graphpp_pool_expandable=0``) where it ran."""
    def ratio(seq, key, top="ours", bottom="megatron"):
        rows = by_seq.get(f"seq{seq}", {})
        a, b = rows.get(top, {}).get(key), rows.get(bottom, {}).get(key)
        return round(a / b, 4) if a and b else None

    ran = [k for k, rows in by_seq.items()
           if "tokens_per_s" in rows.get("megatron", {}) and sum(rows["megatron"].get("graphs_per_rank") or [0]) > 0]
    lengths = [int(k[3:]) for k in by_seq if k.startswith("seq")]
    longest = max(lengths) if lengths else max(SEQS)  # memory at the longest length that ran
    out = {}
    for ours in ("ours", "ours_segments"):
        if ours != "ours" and not any(ours in rows for rows in by_seq.values()):
            continue
        out.update({f"{ours}_vs_megatron_speed_seq512": ratio(512, "tokens_per_s", ours),
                    f"{ours}_vs_megatron_speed_seq2048": ratio(2048, "tokens_per_s", ours),
                    f"{ours}_vs_megatron_peak_mem": ratio(longest, "peak_reserved_mib", ours),
                    f"{ours}_vs_megatron_steady_mem": ratio(longest, "steady_reserved_mib", ours),
                    f"{ours}_peak_vs_eager_per_rank": _per_rank_vs_eager(by_seq, ours, world)})
    out["megatron_graphs_ran"] = bool(ran)
    # the same eager run twice, minutes apart: how far runs move between them, which the
    # rounds' spread inside one run does not show (a speed ratio nearer 1 than this is noise)
    out["eager_repeat_vs_eager_speed_seq512"] = ratio(512, "tokens_per_s", "eager_repeat", "eager")
    out["eager_repeat_vs_eager_speed_seq2048"] = ratio(2048, "tokens_per_s", "eager_repeat", "eager")
    return out


def headline_moe(by_routing: dict) -> dict:
    """Per MoE routing: ours (and ours in ordinary segments, where run) and Megatron's graphs over
    eager (speed; whole-run peak allocated and reserved memory, capture steps included), ours over
    Megatron's graphs, and whether Megatron's graphs ran (a run without graphs would be an eager
    run under another name)."""
    out = {}
    for routing, rows in by_routing.items():
        def ratio(top, bottom, key):
            a, b = rows.get(top, {}).get(key), rows.get(bottom, {}).get(key)
            return round(a / b, 4) if a and b else None

        def whole(variant, kind):  # the run's peak: the capture steps' or the steady one after them
            row = rows.get(variant, {})
            return _max((row.get(f"peak_{kind}_mib"), row.get(f"steady_{kind}_mib")))

        def mem(top, bottom, kind):
            a, b = whole(top, kind), whole(bottom, kind)
            return round(a / b, 4) if a and b else None

        out[routing] = {
            "ours_vs_eager_speed": ratio("ours", "eager", "tokens_per_s"),
            "megatron_vs_eager_speed": ratio("megatron", "eager", "tokens_per_s"),
            "ours_vs_megatron_speed": ratio("ours", "megatron", "tokens_per_s"),
            "ours_vs_eager_peak_allocated": mem("ours", "eager", "allocated"),
            "ours_vs_eager_peak_reserved": mem("ours", "eager", "reserved"),
            "megatron_vs_eager_peak_allocated": mem("megatron", "eager", "allocated"),
            "megatron_vs_eager_peak_reserved": mem("megatron", "eager", "reserved"),
            "ours_vs_megatron_peak_reserved": mem("ours", "megatron", "reserved"),
            "megatron_graphs_ran": sum(rows.get("megatron", {}).get("graphs_per_rank") or [0]) > 0,
            "ours_graphs_ran": sum(rows.get("ours", {}).get("graphs_per_rank") or [0]) > 0,
            "eager_repeat_vs_eager_speed": ratio("eager_repeat", "eager", "tokens_per_s"),
        }
        if "ours_segments" in rows:  # our graphs' pools in ordinary segments, where the run asked for them
            out[routing].update({
                "ours_segments_vs_eager_speed": ratio("ours_segments", "eager", "tokens_per_s"),
                "ours_segments_vs_eager_peak_allocated": mem("ours_segments", "eager", "allocated"),
                "ours_segments_vs_eager_peak_reserved": mem("ours_segments", "eager", "reserved"),
            })
    return out


def _per_rank_vs_eager(by_seq: dict, variant: str, world: int) -> list:
    """Per rank, ``variant``'s whole-run peak over eager's, the worst over the sequence lengths."""
    per_rank = [None] * world
    for rows in by_seq.values():
        ours, eager = _run_peaks(rows.get(variant, {}), world), _run_peaks(rows.get("eager", {}), world)
        for i, (a, b) in enumerate(zip(ours, eager)):
            if a and b:
                per_rank[i] = max(per_rank[i] or 0.0, round(a / b, 4))
    return per_rank


def _run_peaks(row: dict, world: int) -> list:
    """Per rank, the peak reserved MiB of the whole run: the capture steps' peak or the steady
    one after them (the worker resets the peak between the two); None where not measured."""
    peak = row.get("peak_reserved_mib_per_rank") or [None] * world
    steady = row.get("steady_reserved_mib_per_rank") or [None] * world
    out = [_max((p, s)) for p, s in zip(peak, steady)]
    return out + [None] * (world - len(out))


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
    parser.add_argument("--tp", type=int, choices=TP_CHOICES, default=1,
                        help="tensor-parallel GPUs per pipeline stage (GPUs = tp * pp)")
    parser.add_argument("--pp", type=int, choices=PP_CHOICES, default=2, help="pipeline stages")
    parser.add_argument("--seqs", default=",".join(map(str, SEQS)), help="comma-separated sequence lengths")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per variant (of 3 steps at seq 2048, as many tokens at shorter lengths)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for all runs (default 480 on 1 GPU, 540 on 2, 560 on 4)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one steady step of Megatron's graphs and ours at the shortest sequence")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated variants to run (default: all)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of Megatron's graphs and of ours per length, in alternating order (default 2; "
                             "a memory trace runs each variant once)")
    parser.add_argument("--ours-loss", choices=["graphed", "eager"], default="graphed",
                        help="ours: the last stage's cross-entropy in graph_loss (default) or left eager")
    parser.add_argument("--ours-head", choices=["graphed", "eager"], default=None,
                        help="ours: the last stage's output layer graphed in place or left eager (default: "
                             "graphed on a last stage of a pipeline, eager at pp=1 and --moe, where its weight is "
                             "the embedding's)")
    parser.add_argument("--ddp", action="store_true",
                        help="eager and ours in Megatron's DistributedDataParallel too (gradients in main_grad, "
                             "as megatron.training wraps every model); writes <record>-ddp-<device>.json")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="foreach",
                        help="torch.optim.AdamW's implementation in every variant: foreach (its default on a GPU) "
                             "or fused (no per-parameter temporaries, as Megatron's own FusedAdam); fused writes "
                             "<record>-fused-adam-<device>.json")
    parser.add_argument("--memory-trace", action="store_true",
                        help="a diagnosis: record every allocation and break each rank's memory peaks down "
                             "(slows the runs); writes memory-trace-<record>-<device>.json, not the benchmark record")
    parser.add_argument("--name", default=None,
                        help="the record's name without its device (default peer-megatron-pp<P>, "
                             "peer-megatron-tp<T>pp<P>): a run under other settings (FLAGS_graphpp_*) must not "
                             "replace the published record")
    parser.add_argument("--moe", action="store_true",
                        help="the mixture-of-experts GPT on one GPU (tools/bench_moe.py's shape); "
                             "writes peer-megatron-moe-<device>.json")
    parser.add_argument("--routings", default=",".join(MOE_ROUTINGS),
                        help="--moe: comma-separated routings (capacity: drop and pad, whole layers graphed; "
                             "dropless: host-reading dispatch, graphed around it)")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and exit")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv if argv is not None else sys.argv[1:])
    if args.ours_head is None:  # a head handed the embedding's weight cost memory graphed (docs/moe.md)
        args.ours_head = "eager" if args.moe or args.pp == 1 else "graphed"
    if args.moe:
        return main_moe(parser, args, argv if argv is not None else sys.argv[1:])
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (a spread needs two rounds)")
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"--variants {args.variants!r}: choose among {', '.join(VARIANTS)}")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.memory_trace and args.device != "cuda":
        parser.error("--memory-trace records the CUDA allocator: it needs a GPU")
    world = args.tp * args.pp
    seqs = (CPU_SEQ,) if args.device == "cpu" else tuple(int(s) for s in args.seqs.split(",") if s)
    runs = plan(args.pp, seqs, rounds=args.rounds, profile=args.profile, device=args.device, tp=args.tp,
                variants=variants, memory_trace=args.memory_trace, repeats=args.repeats, ours_loss=args.ours_loss,
                ours_head=args.ours_head)
    budget = args.budget if args.budget is not None else BUDGET_S[world]
    run_cap = RUN_CAP_S[world]
    runs = _with_options(runs, args)
    name = ("memory-trace-" if args.memory_trace else "") + (args.name or record_name(args.tp, args.pp) + _suffix(args))
    if args.dry_run:
        return _dry_run(runs, f"# budget {budget:.0f}s, {world} rank(s) per run (--tp {args.tp} x --pp {args.pp}), "
                              f"each run in its own processes, at most {run_cap:.0f}s each", name)
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < world:
            print(f"bench_peer_megatron: --tp {args.tp} x --pp {args.pp} needs {world} GPUs, found "
                  f"{torch.cuda.device_count()}; run it on a machine with {world} GPUs or lower --tp/--pp",
                  file=sys.stderr)
            return 2
    records = _run_all(runs, world=world, budget=budget, run_cap=run_cap)
    by_seq = summarize(records, seqs)
    print_table(by_seq)
    summary = headline(by_seq, world=world)
    payload = {"command": benchlib.command(), **benchlib.environment(), "versions": _versions(),
               "tp": args.tp, "pp": args.pp, "world_size": world, "seqs": list(seqs), "budget_s": budget,
               "ours_loss": args.ours_loss, "ours_head": args.ours_head, "ddp": args.ddp,
               "optimizer": args.optimizer, "summary": summary, "by_config": by_seq, "runs": records}
    return _finish(args.device, name, payload, summary, records)


def _finish(device: str, name: str, payload: dict, summary: dict, records: dict) -> int:
    """Write the record (on CPU, a check of the scripts, print it instead), print the summary;
    exit code 1 where a run failed."""
    if device == "cpu":
        print(json.dumps(payload))
    else:
        path = benchlib.write_result(name, payload)
        print(f"wrote {path}")
    print(json.dumps(summary))
    return 0 if all("error" not in r for r in records.values()) else 1


def _dry_run(runs: list, budget_line: str, name: str) -> int:
    """``--dry-run``: the budget, the record's name and each run's command."""
    print(budget_line)
    print(f"# writes benchmarks/results/{name}-<device>.json")
    for r in runs:
        print(r["label"], _command(r))
    return 0


def main_moe(parser, args, argv) -> int:
    """``--moe``: the MoE runs on one GPU (``--tp``/``--pp``/``--seqs`` do not apply)."""
    given = {a.split("=")[0] for a in argv}
    for flag in ("--tp", "--pp", "--seqs"):
        if flag in given:
            parser.error(f"--moe runs one GPU (pp=1) at seq {MOE_SEQ}: drop {flag}")
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (a spread needs two rounds)")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    if "--variants" not in given:
        variants = MOE_VARIANTS
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"--variants {args.variants!r}: choose among {', '.join(VARIANTS)}")
    routings = tuple(r.strip() for r in args.routings.split(",") if r.strip())
    if not routings or any(r not in MOE_ROUTINGS for r in routings):
        parser.error(f"--routings {args.routings!r}: choose among {', '.join(MOE_ROUTINGS)}")
    seq = CPU_SEQ if args.device == "cpu" else MOE_SEQ
    runs = plan_moe(routings, seq=seq, rounds=args.rounds, profile=args.profile, device=args.device,
                    variants=variants, memory_trace=args.memory_trace, repeats=args.repeats, ours_loss=args.ours_loss,
                    ours_head=args.ours_head)
    budget = args.budget if args.budget is not None else BUDGET_S[1]
    runs = _with_options(runs, args)
    name = ("memory-trace-" if args.memory_trace else "") + (args.name or MOE_RECORD + _suffix(args))
    if args.dry_run:
        return _dry_run(runs, f"# budget {budget:.0f}s, 1 rank per run (one GPU), each run in its own process, at most "
                              f"{RUN_CAP_S[1]:.0f}s each", name)
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < 1:
            print("bench_peer_megatron --moe: needs a GPU, found none", file=sys.stderr)
            return 2
    records = _run_all(runs, world=1, budget=budget, run_cap=RUN_CAP_S[1])
    by_routing = summarize(records, routings)
    print_table(by_routing)
    summary = headline_moe(by_routing)
    from tools import peer_megatron_worker as worker

    payload = {"command": benchlib.command(), **benchlib.environment(), "versions": _versions(),
               "model": "moe", "shape": worker.MOE_SHAPE, "seq": seq, "micro_batches": worker.MOE_MICRO_BATCHES,
               "micro_batch_size": worker.MOE_MICRO_BATCH_SIZE, "capacity_factor": worker.CAPACITY_FACTOR,
               "routings": list(routings), "world_size": 1, "budget_s": budget, "ours_loss": args.ours_loss,
               "ours_head": args.ours_head, "ddp": args.ddp, "optimizer": args.optimizer, "summary": summary,
               "by_config": by_routing, "runs": records}
    return _finish(args.device, name, payload, summary, records)


def _run_all(runs: list, *, world: int, budget: float, run_cap: float) -> dict:
    """Every run in order within ``budget`` seconds: ``{label: record}``, a skipped run's error
    saying so."""
    deadline = time.monotonic() + budget
    records = {}
    for i, run in enumerate(runs, 1):
        remaining = deadline - time.monotonic()
        if remaining < MIN_RUN_S:
            records[run["label"]] = {"error": "skipped: the time budget is spent", "per_rank": []}
            print(f"[{i}/{len(runs)}] {run['label']}: skipped (budget)", flush=True)
            continue
        print(f"[{i}/{len(runs)}] {run['label']} ...", flush=True)
        records[run["label"]] = rec = run_variant(run, world, timeout=min(run_cap, remaining - 5))
        if "error" in rec:
            print(f"  failed: {rec['error'][:500]}", flush=True)
    return records


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
