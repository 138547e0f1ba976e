"""paddle_graphpp.PipelineLayer trained by fleet on CPU ranks (gloo), cudagraph on against off.

Each distributed case starts ``python -m paddle.distributed.launch`` in its own session under
a timeout and kills that session's processes afterwards, whatever happened.
"""

import os

import pytest

paddle = pytest.importorskip("paddle")

from paddle.distributed import fleet  # noqa: E402
from paddle.distributed.fleet.meta_parallel import LayerDesc, SharedLayerDesc  # noqa: E402
from workers.fleet_ranks import launch_workers  # noqa: E402

from paddle_graphpp.paddle.integrations import fleet as fleet_adapter  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "unittests", "workers", "paddle_pipeline_worker.py")


def launch(nproc, args, tmp_path, timeout):
    """Run the worker on ``nproc`` ranks; returns (rc or None on timeout, seconds, logs, results)."""
    return launch_workers(WORKER, nproc, args, tmp_path, timeout)


def check_identical_losses(results, nranks, steps):
    assert sorted(results) == list(range(nranks))
    reference = results[0]["eager"]["losses"]
    assert len(reference) == steps and all(loss == loss for loss in reference)  # no NaN
    assert reference[-1] < reference[0], f"the model did not train: {reference}"
    for rank, data in results.items():
        assert data["eager"]["losses"] == reference, f"rank {rank} eager losses differ"
        assert data["graphed"]["losses"] == reference, (
            f"rank {rank}: losses with use_cudagraph=True {data['graphed']['losses']} "
            f"!= use_cudagraph=False {reference}")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pp2_1f1b_tied_embedding_identical_losses(tmp_path):
    steps, micro = 5, 4
    rc, seconds, logs, results = launch(2, ["--pp", "2", "--steps", str(steps), "--micro-batches", str(micro)],
                                        tmp_path, timeout=150)
    assert rc == 0, f"launch failed (rc={rc}, {seconds:.0f}s)\n{logs[-6000:]}"
    check_identical_losses(results, 2, steps)
    first, last = results[0]["graphed"], results[1]["graphed"]
    # Tied embedding on both ends of the pipe, eager; the callable and the opted-out layer eager.
    assert first["report"].splitlines()[1].strip().startswith("eager   [0] shared:embed")
    assert "plain callable" in first["report"] and "mark_not_capturable" in last["report"]
    assert last["report"].splitlines()[-2].strip().startswith("eager   [9] shared:embed")
    assert last["report"].splitlines()[-1] == "loss: graphed (stage1.loss)"  # graph_loss=True
    assert "graphed [3:5) Block#3, Block#4" in first["report"]  # a run of several layers
    for data in (first, last):
        assert "_GraphedRunCall" in data["run_function_types"]
        # every graphed run took part in every micro-batch of every step
        assert data["graphed_calls"] and set(data["graphed_calls"].values()) == {steps * micro}
        assert data["uses_hop_groups"] is False  # a 2-rank pipe group carries gloo p2p as is


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("interval", [1, 2])
def test_pp2_1f1b_recompute_interval_trains_like_eager(tmp_path, interval):
    # fleet's recompute_interval on both models (dropout 0.1): the graphed runs recompute inside
    # their own graphs (eager on CPU: under fleet's recompute), fleet recomputes the eager model
    steps, micro = 4, 4
    rc, seconds, logs, results = launch(
        2, ["--pp", "2", "--steps", str(steps), "--micro-batches", str(micro), "--recompute-interval", str(interval)],
        tmp_path, timeout=150)
    assert rc == 0, f"launch failed (rc={rc}, {seconds:.0f}s)\n{logs[-6000:]}"
    check_identical_losses(results, 2, steps)
    recomputed = 0
    for rank, data in results.items():
        eager, graphed = data["eager"], data["graphed"]
        assert f"recompute_interval={interval}: graphed runs recompute" in graphed["report"]
        # the same layers ran forward as often (recomputations included) as under fleet's recompute
        assert graphed["forwards"] == eager["forwards"], f"rank {rank}: {graphed['forwards']} != {eager['forwards']}"
        recomputed += sum(n == 2 * steps * micro for n in eager["forwards"].values())
        # and every graphed run was called once per micro-batch of every step
        assert set(graphed["graphed_calls"].values()) == {steps * micro}
    assert recomputed >= 4, "fleet recomputed almost nothing: the test would not show much"


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_pp4_vpp2_interleaved_on_4_cpu_ranks(tmp_path):
    steps, micro = 5, 8
    rc, seconds, logs, results = launch(
        4, ["--pp", "4", "--vpp", "2", "--blocks", "8", "--steps", str(steps),
            "--micro-batches", str(micro), "--micro-batch-size", "1"], tmp_path, timeout=240)
    assert rc == 0, f"launch failed (rc={rc}, {seconds:.0f}s)\n{logs[-6000:]}"
    check_identical_losses(results, 4, steps)
    for rank, data in results.items():
        graphed = data["graphed"]
        assert graphed["uses_hop_groups"] is True
        assert f"stage {rank} chunk 0:" in graphed["report"] and f"stage {rank} chunk 1:" in graphed["report"]
        # one graphed run per chunk here; each served every micro-batch of its chunk
        assert len(graphed["graphed_calls"]) == 2
        assert set(graphed["graphed_calls"].values()) == {steps * micro}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_dead_rank_makes_the_others_exit(tmp_path):
    rc, seconds, logs, results = launch(2, ["--pp", "2", "--die-rank", "1"], tmp_path, timeout=120)
    assert rc is not None, f"the surviving rank hung past 120 s\n{logs[-6000:]}"
    assert rc != 0 and not results
    assert seconds < 90, f"took {seconds:.0f}s to fail"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bad_interleave_config_fails_on_every_rank_before_communicating(tmp_path):
    # 4 micro-batches < 2 * pp: upstream would assert only inside distributed_model.
    rc, seconds, logs, results = launch(
        4, ["--pp", "4", "--vpp", "2", "--blocks", "8", "--micro-batches", "4"], tmp_path, timeout=240)
    assert rc not in (0, None), logs[-6000:]
    assert "raise strategy.pipeline_configs['accumulate_steps'] to 8 or more" in logs
    assert "TIMEOUT" not in logs


# ---------------------------------------------------------------- single-process checks
class Block(paddle.nn.Layer):
    def forward(self, x):
        return x


def _descs(blocks):
    return ([SharedLayerDesc("embed", paddle.nn.Embedding, None, "weight", 8, 4)]
            + [LayerDesc(Block) for _ in range(blocks)])


def _check(layers, **kwargs):
    args = dict(num_stages=4, topology=None, seg_method="layer:Block", vpp=2, use_cudagraph=True,
                use_dualpipev=False, recompute_interval=0)
    args.update(kwargs)
    fleet_adapter.check_configuration(layers, **args)


@pytest.fixture
def strategy(monkeypatch):
    """The strategy fleet.init would have recorded (fleet.init needs several processes)."""
    s = fleet.DistributedStrategy()
    s.pipeline_configs = {"accumulate_steps": 8, "micro_batch_size": 1}
    monkeypatch.setattr(fleet.fleet, "_user_defined_strategy", s, raising=False)
    return s


def test_configuration_errors_name_the_fix(strategy):
    _check(_descs(8))  # valid: 8 blocks into 4*2 chunks, 8 micro-batches
    with pytest.raises(ValueError, match=r"matches 10 layers.*pp\*vpp = 4\*2 = 8"):
        _check(_descs(10))
    with pytest.raises(ValueError, match="seg_method='layer:<LayerClassName>'"):
        _check(_descs(8), seg_method="uniform")
    with pytest.raises(ValueError, match="more than 2 pipeline stages"):
        _check(_descs(8), num_stages=2)
    with pytest.raises(ValueError, match="cannot split into pp\\*vpp"):
        _check(_descs(2), seg_method="uniform", vpp=1)
    _check(_descs(8), recompute_interval=1, recompute_ctx={"offload": False})  # graphed runs recompute
    with pytest.raises(ValueError, match=r"recompute_ctx offload/partition=True.*Set offload and partition to False"):
        _check(_descs(8), recompute_interval=1, recompute_ctx={"offload": True, "partition": True})
    # DualPipeV: 2*pp chunks, the strategy must ask for it, 2*pp micro-batches
    with pytest.raises(ValueError, match=r"use_dualpipev=True needs the strategy.*\['use_dualpipev'\] = True"):
        _check(_descs(8), vpp=1, use_dualpipev=True)
    strategy.hybrid_configs = {"pp_configs": {"use_dualpipev": True}}
    _check(_descs(8), vpp=1, use_dualpipev=True)
    with pytest.raises(ValueError, match=r"matches 12 layers.*2\*pp = 2\*4 = 8 chunks"):
        _check(_descs(12), vpp=1, use_dualpipev=True)
    strategy.pipeline_configs = {"accumulate_steps": 6}
    with pytest.raises(ValueError, match="at least 2\\*pp = 8 micro-batches"):
        _check(_descs(8))
    with pytest.raises(ValueError, match=r"DualPipeV \(use_dualpipev=True\) needs at least 2\*pp = 8"):
        _check(_descs(8), vpp=1, use_dualpipev=True)


def test_dynamic_shapes_rejected_only_with_cudagraph(strategy):
    strategy.hybrid_configs = {"pp_configs": {"enable_dynamic_shape": True}}
    with pytest.raises(ValueError, match="pad sequences to a fixed length"):
        _check(_descs(8))
    _check(_descs(8), use_cudagraph=False)
    strategy.hybrid_configs = {"pp_configs": {"enable_dynamic_shape": False}}
    strategy.pipeline_configs = {"accumulate_steps": 8, "p2p_cache_shape": False}
    with pytest.raises(ValueError, match="p2p_cache_shape"):
        _check(_descs(8))
