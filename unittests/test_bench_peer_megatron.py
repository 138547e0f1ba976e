"""tools/bench_peer_megatron.py on CPU: the run plan and record names at pp 1/2/4 and TP=2 x PP=2,
the summary's ratios, the errors for bad input (no Megatron needed) and, when Megatron-Core is
importable, a tiny model through every variant on 2 and 4 gloo ranks (graphs need CUDA: Megatron's
variant then runs its DDP/main_grad path without graphs, ours runs eagerly) with equal losses."""
import importlib.util
import json
import os
import sys

import pytest

from testing import launch
from tools import bench_peer_megatron, peer_megatron_worker

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tools", "bench_peer_megatron.py")


def test_dry_run_lists_every_variant_and_length(capsys):
    assert bench_peer_megatron.main(["--pp", "1", "--profile", "--dry-run"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if not l.startswith("#")]
    labels = [l.split()[0] for l in lines]
    # the peer and both layouts of ours alternate, every other repeat mirrored
    per_seq = ["eager", "megatron", "ours", "ours_segments", "ours_segments#2", "ours#2", "megatron#2"]
    assert labels[:14] == [f"{v.split('#')[0]}@seq{s}" + (f"#{v.split('#')[1]}" if "#" in v else "")
                           for s in (512, 2048) for v in per_seq]
    assert labels[14:] == ["eager_repeat@seq512", "eager_repeat@seq2048"]  # dropped first when time runs out
    profiled = [l.split()[0] for l in lines if "--profile" in l]
    assert profiled == ["megatron@seq512", "ours@seq512"]  # the first run of each only
    assert all("--pp 1" in l for l in lines)
    segments = [l for l in lines if l.startswith("ours_segments@")]
    assert segments and all("FLAGS_graphpp_pool_expandable=0 python" in l and "--variant ours " in l for l in segments)
    ours = [l for l in lines if l.startswith("ours@")]  # the default layout, whatever the environment says
    assert ours and all("FLAGS_graphpp_pool_expandable=1 python" in l for l in ours)


def test_repeated_runs_pool_their_rounds_and_keep_each_ranks_highest_peak():
    def rec(rounds, peaks, losses=None):
        ranks = [{"tokens_per_s": sorted(rounds)[len(rounds) // 2], "tokens_per_s_rounds": rounds,
                  "tokens_per_s_spread": max(rounds) / min(rounds), "capture_phase_s": 1.0,
                  "peak_reserved_mib": p, "steady_reserved_mib": p,
                  "losses": losses if i == len(peaks) - 1 else None} for i, p in enumerate(peaks)]
        return {"per_rank": ranks}
    records = {"eager@seq512": rec([10.0, 10.0], [100.0, 100.0], [1.0, 2.0]),
               "ours@seq512": rec([30.0, 31.0], [101.0, 90.0], [1.0, 2.0]),
               "ours@seq512#2": rec([20.0, 21.0], [99.0, 95.0], [1.0, 2.5]),
               "ours_segments@seq512": rec([30.0, 30.0], [98.0, 97.0], [1.0, 2.0])}
    rows = bench_peer_megatron.summarize(records, (512,))["seq512"]
    assert rows["ours"]["tokens_per_s_rounds"] == [30.0, 31.0, 20.0, 21.0]
    assert rows["ours"]["tokens_per_s"] == 25.5 and rows["ours"]["tokens_per_s_spread"] == 31.0 / 20.0
    assert rows["ours"]["peak_reserved_mib_per_rank"] == [101.0, 95.0]
    assert rows["ours"]["max_abs_loss_diff_vs_eager"] == 0.5  # the worst of both runs
    assert "tokens_per_s_runs" in rows["ours"] and "tokens_per_s_runs" not in rows["ours_segments"]
    assert rows["ours"]["tokens_per_s_spread_runs"] == [31.0 / 30.0, 21.0 / 20.0]  # each run's own
    h = bench_peer_megatron.headline({"seq2048": rows}, world=2)
    assert h["ours_peak_vs_eager_per_rank"] == [1.01, 0.95]
    assert h["ours_segments_peak_vs_eager_per_rank"] == [0.98, 0.97]


def test_a_failed_repeat_keeps_the_runs_that_finished():
    def rec(rounds, peaks):
        return {"per_rank": [{"tokens_per_s": rounds[0], "tokens_per_s_rounds": rounds, "tokens_per_s_spread": 1.0,
                              "capture_phase_s": 1.0, "peak_reserved_mib": p, "steady_reserved_mib": p,
                              "graphs": 4, "losses": None} for p in peaks]}
    skipped = {"error": "skipped: the time budget is spent", "per_rank": []}
    records = {"megatron@seq2048": rec([10.0, 10.0], [100.0]), "ours@seq2048": rec([12.0, 12.0], [90.0]),
               "ours@seq2048#2": rec([11.0, 11.0], [95.0]), "megatron@seq2048#2": skipped}
    rows = bench_peer_megatron.summarize(records, (2048,))["seq2048"]
    assert rows["megatron"]["tokens_per_s"] == 10.0 and rows["megatron"]["failed_runs"] == [skipped["error"]]
    assert "failed_runs" not in rows["ours"] and rows["ours"]["tokens_per_s"] == 11.5
    h = bench_peer_megatron.headline({"seq2048": rows}, world=1)
    assert h["ours_vs_megatron_speed_seq2048"] == 1.15 and h["megatron_graphs_ran"] is True
    assert h["ours_vs_megatron_peak_mem"] == 0.95  # memory at the longest length that ran
    only_failed = bench_peer_megatron.summarize({"megatron@seq2048": skipped}, (2048,))["seq2048"]
    assert only_failed["megatron"] == {"error": skipped["error"]}


def test_headline_ratios_are_ours_over_megatron():
    rows = {"seq512": {"ours": {"tokens_per_s": 300.0}, "megatron": {"tokens_per_s": 200.0, "graphs_per_rank": [48]}},
            "seq2048": {"ours": {"tokens_per_s": 90.0, "peak_reserved_mib": 800.0, "steady_reserved_mib": 500.0},
                        "megatron": {"error": "RuntimeError: ..."}}}
    h = bench_peer_megatron.headline(rows)
    assert h["ours_vs_megatron_speed_seq512"] == 1.5
    assert h["ours_vs_megatron_speed_seq2048"] is None and h["ours_vs_megatron_peak_mem"] is None
    assert h["megatron_graphs_ran"] is True
    assert h["eager_repeat_vs_eager_speed_seq512"] is None  # no repeat ran


def test_headline_says_how_far_the_same_eager_run_moved_between_two_runs():
    rows = {"seq512": {"eager": {"tokens_per_s": 25100.0}, "eager_repeat": {"tokens_per_s": 17459.0}},
            "seq2048": {"eager": {"tokens_per_s": 58466.0}, "eager_repeat": {"error": "x"}}}
    h = bench_peer_megatron.headline(rows, world=4)
    assert h["eager_repeat_vs_eager_speed_seq512"] == 0.6956
    assert h["eager_repeat_vs_eager_speed_seq2048"] is None


@pytest.mark.parametrize("argv, world, record, budget", [
    (["--pp", "1"], 1, "peer-megatron-pp1", 480),
    (["--pp", "2"], 2, "peer-megatron-pp2", 540),
    (["--pp", "4"], 4, "peer-megatron-pp4", 560),
    (["--tp", "2", "--pp", "2"], 4, "peer-megatron-tp2pp2", 560),
])
def test_dry_run_names_the_ranks_and_the_record(capsys, argv, world, record, budget):
    assert bench_peer_megatron.main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"# budget {budget}s, {world} rank(s) per run")
    assert out[1] == f"# writes benchmarks/results/{record}-<device>.json"
    tp = argv[argv.index("--tp") + 1] if "--tp" in argv else "1"
    runs = out[2:]
    assert len(runs) == 16 and all(f"--tp {tp} --pp {argv[-1]}" in l for l in runs)


def test_the_per_run_cap_fits_the_budget_for_every_world_size():
    for world, budget in bench_peer_megatron.BUDGET_S.items():
        assert bench_peer_megatron.RUN_CAP_S[world] + bench_peer_megatron.MIN_RUN_S < budget


@pytest.mark.parametrize("argv", [["--tp", "3"], ["--pp", "3"], ["--tp", "0", "--pp", "2"]])
def test_unsupported_parallel_sizes_are_refused_with_the_choices(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        bench_peer_megatron.main([*argv, "--dry-run"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_worker_refuses_a_world_size_that_is_not_tp_times_pp(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    opts = peer_megatron_worker.parse_args(["--variant", "eager", "--seq", "32", "--tp", "2", "--pp", "2",
                                            "--device", "cpu"])
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2 .*--tp 2 x --pp 2 needs 4"):
        peer_megatron_worker.init_distributed(opts, 0)


def test_both_shapes_split_over_every_offered_layout():
    for shape in peer_megatron_worker.SHAPES.values():
        for tp in bench_peer_megatron.TP_CHOICES:
            for pp in bench_peer_megatron.PP_CHOICES:
                peer_megatron_worker.check_shape(shape, tp=tp, pp=pp)
    with pytest.raises(ValueError, match="layers 4 do not split over --pp 3"):
        peer_megatron_worker.check_shape(dict(layers=4, heads=4, vocab=128), tp=1, pp=3)


def test_ours_peak_vs_eager_is_per_rank_over_the_whole_run():
    rows = {"seq2048": {
        "eager": {"peak_reserved_mib_per_rank": [100.0, 200.0, 100.0, 50.0],
                  "steady_reserved_mib_per_rank": [100.0, 250.0, 100.0, 50.0]},
        "ours": {"peak_reserved_mib_per_rank": [110.0, 200.0, 120.0, None],  # rank 3 not measured
                 "steady_reserved_mib_per_rank": [105.0, 225.0, 90.0, None]}}}
    h = bench_peer_megatron.headline(rows, world=4)
    assert h["ours_peak_vs_eager_per_rank"] == [1.1, 0.9, 1.2, None]
    failed = bench_peer_megatron.headline({"seq2048": {"ours": {"error": "x"}}}, world=4)
    assert failed["ours_peak_vs_eager_per_rank"] == [None] * 4  # one entry per rank even when nothing ran


def test_ours_peak_vs_eager_per_rank_is_the_worst_over_the_sequence_lengths():
    def row(eager, ours):
        return {"eager": {"peak_reserved_mib_per_rank": eager}, "ours": {"peak_reserved_mib_per_rank": ours}}
    rows = {"seq512": row([100.0, 100.0], [108.0, 100.0]), "seq2048": row([200.0, 200.0], [202.0, 220.0])}
    assert bench_peer_megatron.headline(rows, world=2)["ours_peak_vs_eager_per_rank"] == [1.08, 1.1]


def test_a_memory_trace_runs_the_named_variants_traced_and_writes_a_record_of_its_own(capsys):
    assert bench_peer_megatron.main(["--pp", "1", "--seqs", "2048", "--variants", "eager,ours", "--memory-trace",
                                     "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "# writes benchmarks/results/memory-trace-peer-megatron-pp1-<device>.json"
    assert [l.split()[0] for l in out[2:]] == ["eager@seq2048", "ours@seq2048"]
    assert all(l.endswith("--memory-trace") for l in out[2:])
    with pytest.raises(SystemExit):
        bench_peer_megatron.main(["--variants", "eager,fast", "--dry-run"])
    assert "choose among eager, megatron, ours, ours_segments, eager_repeat" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="megatron-core is not installed: python -m pip install --no-deps "
                           ".wheels/megatron_core-*.whl (a Python 3.12 wheel; see tools/bench_peer_megatron.py)")
@pytest.mark.parametrize("argv, world, repeats", [(["--pp", "1"], 1, 1), (["--pp", "2"], 2, 2), (["--pp", "4"], 4, 1),
                                                  (["--tp", "2", "--pp", "2"], 4, 1)],
                         ids=["pp1", "pp2", "pp4", "tp2pp2"])
def test_tiny_model_every_variant_on_cpu_ranks(argv, world, repeats):
    end = launch.run([sys.executable, SCRIPT, "--device", "cpu", *argv, "--rounds", "2", "--repeats", str(repeats)],
                     cwd=REPO, timeout=400)
    assert end.returncode == 0, end.stdout[-3000:] + end.stderr[-3000:]
    payload = json.loads([l for l in end.stdout.splitlines() if l.startswith('{"command"')][-1])
    assert payload["world_size"] == world
    rows = payload["by_config"]["seq32"]
    for variant in ("megatron", "ours", "ours_segments", "eager_repeat"):
        assert rows[variant]["max_abs_loss_diff_vs_eager"] == 0.0, variant
    if repeats > 1:  # both runs of the peer and of ours pooled
        assert len(rows["ours"]["tokens_per_s_runs"]) == len(rows["megatron"]["tokens_per_s_runs"]) == repeats
    assert len(payload["summary"]["ours_peak_vs_eager_per_rank"]) == world
    ranks = payload["runs"]["ours@seq32"]["per_rank"]
    pp = payload["pp"]
    last_stage = [r["losses"] for r in ranks if r["pp_rank"] == pp - 1]
    assert len(last_stage) == payload["tp"] and all(l == last_stage[0] for l in last_stage)  # TP ranks agree
    assert all(r["losses"] is None for r in ranks if r["pp_rank"] < pp - 1)


def test_the_worker_refuses_a_memory_trace_without_a_gpu(capsys):
    with pytest.raises(SystemExit):
        peer_megatron_worker.parse_args(["--variant", "ours", "--seq", "32", "--device", "cpu", "--memory-trace"])
    assert "needs --device cuda" in capsys.readouterr().err


@pytest.mark.parametrize("extra, loss, head", [([], "graphed", "graphed"), (["--ours-loss", "eager"], "eager", "graphed"),
                                               (["--ours-head", "eager"], "graphed", "eager")])
def test_ours_runs_name_how_the_last_stage_loss_and_head_run_and_the_others_do_not(capsys, extra, loss, head):
    assert bench_peer_megatron.main(["--pp", "2", "--seqs", "512", "--dry-run", *extra]) == 0
    runs = capsys.readouterr().out.splitlines()[2:]
    ours = [l for l in runs if l.split()[0].startswith("ours")]
    assert ours and all(f"--loss {loss} --head {head}" in l for l in ours)
    assert all("--loss" not in l and "--head" not in l for l in runs if not l.split()[0].startswith("ours"))


@pytest.mark.parametrize("args", [["--pp", "1", "--seqs", "512"], ["--moe"]], ids=["pp1", "moe"])
def test_a_head_handed_the_embeddings_weight_stays_eager_unless_asked(capsys, args):
    assert bench_peer_megatron.main([*args, "--dry-run"]) == 0
    ours = [l for l in capsys.readouterr().out.splitlines()[2:] if l.split()[0].startswith("ours")]
    assert ours and all("--head eager" in l for l in ours)
    assert bench_peer_megatron.main([*args, "--dry-run", "--ours-head", "graphed"]) == 0
    ours = [l for l in capsys.readouterr().out.splitlines()[2:] if l.split()[0].startswith("ours")]
    assert ours and all("--head graphed" in l for l in ours)


def test_a_timed_round_holds_as_many_tokens_at_every_length_on_a_gpu():
    steps = peer_megatron_worker.steps_per_round
    assert [steps(s) * s for s in (512, 1024, 2048)] == [3 * 2048] * 3
    assert steps(4096) == 3 and steps(32, "cpu") == 3
    assert steps(768) == 8  # 6144 tokens, as at seq 2048


def test_moe_dry_run_lists_each_routing_on_one_gpu_and_names_its_record(capsys):
    assert bench_peer_megatron.main(["--moe", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "# writes benchmarks/results/peer-megatron-moe-<device>.json"
    labels = [l.split()[0] for l in out[2:]]
    per_routing = ["eager", "megatron", "ours", "ours#2", "megatron#2"]
    assert labels == [f"{v.split('#')[0]}@{r}" + (f"#{v.split('#')[1]}" if "#" in v else "")
                      for r in ("capacity", "dropless") for v in per_routing] + \
        ["eager_repeat@capacity", "eager_repeat@dropless"]
    runs = out[2:]
    assert all("--model moe" in l and "--seq 256 --tp 1 --pp 1" in l for l in runs)
    assert all(f"--routing {l.split()[0].split('@')[1].split('#')[0]}" in l for l in runs)


@pytest.mark.parametrize("args, record", [(["--moe"], "peer-megatron-moe-ddp"), (["--pp", "2"], "peer-megatron-pp2-ddp")])
def test_with_ddp_eager_and_ours_train_in_megatrons_ddp_into_a_record_of_their_own(capsys, args, record):
    assert bench_peer_megatron.main([*args, "--ddp", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"# writes benchmarks/results/{record}-<device>.json"
    runs = out[2:]
    assert runs and all(("--ddp" in l) == (not l.startswith("megatron")) for l in runs)
    worker = peer_megatron_worker.parse_args(["--variant", "ours", "--seq", "32", "--ddp"])
    assert peer_megatron_worker.in_ddp(worker)
    assert not peer_megatron_worker.in_ddp(peer_megatron_worker.parse_args(["--variant", "eager", "--seq", "32"]))


@pytest.mark.parametrize("args, record", [(["--moe"], "peer-megatron-moe-fused-adam"),
                                          (["--moe", "--ddp"], "peer-megatron-moe-ddp-fused-adam"),
                                          (["--pp", "1"], "peer-megatron-pp1-fused-adam")])
def test_a_fused_optimizer_runs_in_every_variant_into_a_record_of_its_own(capsys, args, record):
    assert bench_peer_megatron.main([*args, "--optimizer", "fused", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"# writes benchmarks/results/{record}-<device>.json"
    runs = out[2:]
    assert runs and all("--optimizer fused" in l for l in runs)
    assert peer_megatron_worker.parse_args(["--variant", "eager", "--seq", "32"]).optimizer == "foreach"
    assert bench_peer_megatron.main([*args, "--dry-run"]) == 0
    assert "--optimizer" not in capsys.readouterr().out


def test_a_moe_memory_trace_runs_each_variant_once_traced_into_a_record_of_its_own(capsys):
    assert bench_peer_megatron.main(["--moe", "--memory-trace", "--variants", "eager,ours", "--routings", "capacity",
                                     "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "# writes benchmarks/results/memory-trace-peer-megatron-moe-<device>.json"
    assert [l.split()[0] for l in out[2:]] == ["eager@capacity", "ours@capacity"]
    assert all(l.endswith("--memory-trace") for l in out[2:])


@pytest.mark.parametrize("argv", [["--pp", "2"], ["--tp", "2"], ["--seqs", "512"], ["--routings", "capacity,fast"]])
def test_moe_refuses_what_it_does_not_run(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        bench_peer_megatron.main(["--moe", *argv, "--dry-run"])
    assert exc.value.code == 2


def test_the_moe_worker_runs_on_one_rank_only(capsys):
    with pytest.raises(SystemExit):
        peer_megatron_worker.parse_args(["--variant", "ours", "--model", "moe", "--seq", "32", "--pp", "2"])
    assert "--model moe runs on one GPU" in capsys.readouterr().err
    opts = peer_megatron_worker.parse_args(["--variant", "megatron", "--model", "moe", "--routing", "dropless",
                                            "--seq", "256"])
    assert peer_megatron_worker.micro_batches(opts) == (4, 2)
    assert peer_megatron_worker.steps_per_round(256, "cuda", "moe") == 5


def test_moe_summary_is_per_routing_with_allocated_and_reserved_peaks():
    def rec(tps, alloc, reserved, graphs=None, losses=(1.0, 2.0)):
        return {"per_rank": [{"tokens_per_s": tps, "tokens_per_s_rounds": [tps, tps], "tokens_per_s_spread": 1.0,
                              "capture_phase_s": 1.0, "peak_allocated_mib": alloc, "steady_allocated_mib": alloc - 1,
                              "peak_reserved_mib": reserved, "steady_reserved_mib": reserved - 1,
                              "losses": list(losses), **({"graphs": graphs} if graphs is not None else {})}]}
    records = {"eager@capacity": rec(100.0, 1000.0, 1100.0), "megatron@capacity": rec(300.0, 1100.0, 1300.0, 16),
               "ours@capacity": rec(330.0, 1050.0, 1155.0, 16, (1.0, 2.5)), "eager@dropless": rec(50.0, 900.0, 1000.0),
               "megatron@dropless": {"error": "RuntimeError: x", "per_rank": []}}
    by = bench_peer_megatron.summarize(records, ("capacity", "dropless"))
    assert by["capacity"]["ours"]["peak_allocated_mib"] == 1050.0
    assert by["capacity"]["ours"]["max_abs_loss_diff_vs_eager"] == 0.5
    assert by["dropless"]["megatron"] == {"error": "RuntimeError: x"}
    h = bench_peer_megatron.headline_moe(by)
    assert h["capacity"]["ours_vs_megatron_speed"] == 1.1 and h["capacity"]["ours_vs_eager_speed"] == 3.3
    assert h["capacity"]["ours_vs_eager_peak_reserved"] == 1.05 and h["capacity"]["megatron_vs_eager_peak_allocated"] == 1.1
    assert h["capacity"]["megatron_graphs_ran"] and not h["dropless"]["megatron_graphs_ran"]
    assert h["dropless"]["ours_vs_megatron_speed"] is None
    assert "ours_segments_vs_eager_peak_reserved" not in h["capacity"]
    records["ours_segments@capacity"] = rec(320.0, 1040.0, 1210.0, 16)
    h = bench_peer_megatron.headline_moe(bench_peer_megatron.summarize(records, ("capacity", "dropless")))
    assert h["capacity"]["ours_segments_vs_eager_peak_reserved"] == 1.1
    assert h["capacity"]["ours_segments_vs_eager_speed"] == 3.2
    assert "ours_segments_vs_eager_speed" not in h["dropless"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="megatron-core is not installed: python -m pip install --no-deps "
                           ".wheels/megatron_core-*.whl (a Python 3.12 wheel; see tools/bench_peer_megatron.py)")
def test_tiny_moe_model_every_variant_and_routing_on_cpu():
    end = launch.run([sys.executable, SCRIPT, "--device", "cpu", "--moe", "--rounds", "2", "--repeats", "1"],
                     cwd=REPO, timeout=400)
    assert end.returncode == 0, end.stdout[-3000:] + end.stderr[-3000:]
    payload = json.loads([l for l in end.stdout.splitlines() if l.startswith('{"command"')][-1])
    for routing in ("capacity", "dropless"):
        rows = payload["by_config"][routing]
        for variant in ("megatron", "ours", "eager_repeat"):  # no graphs on CPU: the same math as eager
            assert rows[variant]["max_abs_loss_diff_vs_eager"] == 0.0, (routing, variant)
