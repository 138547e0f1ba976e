"""The 2-GPU memory benchmark's plan and summary (the runs themselves need GPUs)."""
from tools import bench_pipeline_memory as bpm


def _run(peaks, steady, tps, losses):
    return {"per_rank": [{"peak_mem_mib": p, "steady_peak_mem_mib": s} for p, s in zip(peaks, steady)],
            "tokens_per_s": tps, "losses": losses}


def test_plan_alternates_eager_and_default_rounds_then_the_other_variants():
    labels = [label for label, _, _ in bpm.plan("gpt1.3b", ["eager", "default", "per_graph", "async"], 2)]
    assert labels[:6] == ["eager@seq2048_1f1b#0", "default@seq2048_1f1b#0", "eager@seq2048_vpp2#0",
                          "default@seq2048_vpp2#0", "eager@seq512#0", "default@seq512#0"]
    assert "eager@seq2048_1f1b#1" in labels and "eager@seq2048_vpp2#1" not in labels
    assert labels[-2:] == ["per_graph@seq2048_1f1b#0", "async@seq2048_1f1b#0"]


def test_summary_ratios_are_per_rank_maxima_and_losses_are_set_against_eager_spread():
    runs = {
        "eager@seq2048_1f1b#0": _run([1000, 2000], [1000, 2000], 100.0, [5.0, 4.0]),
        "default@seq2048_1f1b#0": _run([1100, 2000], [1010, 1990], 99.0, [5.0, 4.003]),
        "eager@seq2048_1f1b#1": _run([1000, 2000], [1000, 2000], 102.0, [5.0, 4.001]),
        "default@seq2048_1f1b#1": _run([1100, 2000], [1010, 1990], 103.0, [5.0, 4.002]),
        "per_graph@seq2048_1f1b#0": {"error": "timed out"},
    }
    rows = bpm.summarize(runs)["seq2048_1f1b"]
    default = rows["default"]
    assert default["peak_vs_eager"] == 1.1 and default["steady_vs_eager"] == 1.01
    assert default["speed_vs_eager"] == round(101.0 / 101.0, 4)
    assert abs(default["max_abs_loss_diff_vs_eager"] - 0.003) < 1e-9
    assert abs(default["eager_loss_spread"] - 0.001) < 1e-9
    assert rows["per_graph"] == {"error": "timed out"}


def test_upstream_sets_per_graph_under_the_stream_ordered_allocator_against_per_graph():
    runs = {
        "eager@seq2048_1f1b#0": _run([1000, 2000], [1000, 2000], 100.0, [5.0]),
        "per_graph@seq2048_1f1b#0": _run([1400, 2600], [1400, 2600], 100.0, [5.0]),
        "per_graph_async@seq2048_1f1b#0": _run([1300, 2080], [1300, 2080], 100.0, [5.0]),
    }
    up = bpm.upstream(bpm.summarize(runs)["seq2048_1f1b"])
    assert up["per_graph_peak_vs_eager"] == 1.4 and up["per_graph_async_peak_vs_eager"] == 1.3
    assert up["per_graph_async_vs_per_graph"] == round(2080 / 2600, 4) and "95% -> 25%" in up["seed"]
    assert bpm.upstream({})["per_graph_peak_vs_eager"] is None  # variants missing: no ratio invented
    labels = [label for label, _, env in bpm.plan("gpt1.3b", ["eager", "default", "per_graph_async"], 1)]
    assert labels[-1] == "per_graph_async@seq2048_1f1b#0"
    env = dict(bpm.plan("gpt1.3b", ["per_graph_async"], 1)[-1][2])
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}


def test_the_pp4_preset_runs_the_same_model_over_four_stages_at_seq_2048():
    runs = bpm.plan("gpt1.3b-pp4", ["eager", "default"], 1)
    assert [label for label, _, _ in runs] == ["eager@seq2048_1f1b#0", "default@seq2048_1f1b#0",
                                               "eager@seq2048_vpp2#0", "default@seq2048_vpp2#0"]
    args = runs[0][1]
    assert args[args.index("--pp") + 1] == "4" and args[args.index("--layers") + 1] == "24"
    assert bpm.GPUS["gpt1.3b-pp4"] == 4
