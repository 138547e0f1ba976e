"""paddle_graphpp.PipelineLayer trained by fleet on CPU ranks (gloo), cudagraph on against off.

Each distributed case starts ``python -m paddle.distributed.launch`` in its own session under
a timeout and kills that session's processes afterwards, whatever happened.
"""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

paddle = pytest.importorskip("paddle")

from paddle.distributed import fleet  # noqa: E402
from paddle.distributed.fleet.meta_parallel import LayerDesc, SharedLayerDesc  # noqa: E402

from paddle_graphpp.paddle import pipeline as pipeline_mod  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "unittests", "workers", "paddle_pipeline_worker.py")
FLEET_READY = "paddle_graphpp-worker: fleet.init done"
INIT_DEADLINE_S = 45  # fleet.init takes ~5 s per rank here; past this it is stuck in gloo
# Paddle's own gloo setup inside fleet.init (new_group -> ProcessGroupGloo -> connectFullMesh)
# often fails on this 2-core machine with "connection refused": in about 6 of 10 launches with
# 4 ranks, measured. It fails before any code under test runs, so such launches are retried.
INIT_ATTEMPTS = 12


def _logs(log_dir):
    text = []
    for path in sorted(glob.glob(os.path.join(log_dir, "workerlog.*"))):
        with open(path, errors="replace") as f:
            lines = [ln for ln in f.read().splitlines() if not ln.startswith(("I1", "W1"))]
        text.append(f"== {os.path.basename(path)}\n" + "\n".join(lines))
    return "\n".join(text)


def _launch_once(nproc, args, out, timeout):
    log_dir = os.path.join(out, "log")
    os.makedirs(log_dir, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
           "--log_dir", log_dir, WORKER, "--out", out, *args]
    start = time.monotonic()
    with open(os.path.join(out, "launch.txt"), "w") as sink:
        proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = None
            while time.monotonic() - start < timeout:
                try:
                    rc = proc.wait(timeout=1.0)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if time.monotonic() - start > INIT_DEADLINE_S and _logs(log_dir).count(FLEET_READY) < nproc:
                    break  # stuck in fleet.init's own gloo setup: give up on this attempt early
        finally:
            try:  # the launcher and every rank share the new session's process group
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return rc, time.monotonic() - start, _logs(log_dir)


def launch(nproc, args, tmp_path, timeout):
    """Run the worker on ``nproc`` ranks; returns (rc or None on timeout, seconds, logs, results)."""
    for attempt in range(INIT_ATTEMPTS):
        out = str(tmp_path / f"run{attempt}")
        os.makedirs(out)
        rc, seconds, logs = _launch_once(nproc, args, out, timeout)
        results = {}
        for path in glob.glob(os.path.join(out, "rank*.json")):
            with open(path) as f:
                data = json.load(f)
            results[data["rank"]] = data
        # On a loaded machine gloo occasionally fails to connect (refused / TIMEOUT) while
        # fleet.init builds fleet's own groups, before any code under test runs: try again.
        flaky_init = rc != 0 and logs.count(FLEET_READY) < nproc
        if not flaky_init:
            break
    return rc, seconds, logs, results


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
    assert last["report"].splitlines()[-1].strip().startswith("eager   [9] shared:embed")
    assert "graphed [3:5) Block#3, Block#4" in first["report"]  # a run of several layers
    for data in (first, last):
        assert "_GraphedRunCall" in data["run_function_types"]
        # every graphed run took part in every micro-batch of every step
        assert data["graphed_calls"] and set(data["graphed_calls"].values()) == {steps * micro}
        assert data["uses_hop_groups"] is False  # a 2-rank pipe group carries gloo p2p as is


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
        4, ["--pp", "4", "--vpp", "2", "--blocks", "8", "--micro-batches", "4"], tmp_path, timeout=120)
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
    pipeline_mod._check_configuration(layers, **args)


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
    with pytest.raises(ValueError, match="recompute_interval=0"):
        _check(_descs(8), recompute_interval=1)
    with pytest.raises(NotImplementedError, match="use_dualpipev"):
        _check(_descs(8), vpp=1, use_dualpipev=True)
    strategy.pipeline_configs = {"accumulate_steps": 6}
    with pytest.raises(ValueError, match="at least 2\\*pp = 8 micro-batches"):
        _check(_descs(8))


def test_dynamic_shapes_rejected_only_with_cudagraph(strategy):
    strategy.hybrid_configs = {"pp_configs": {"enable_dynamic_shape": True}}
    with pytest.raises(ValueError, match="pad sequences to a fixed length"):
        _check(_descs(8))
    _check(_descs(8), use_cudagraph=False)
    strategy.hybrid_configs = {"pp_configs": {"enable_dynamic_shape": False}}
    strategy.pipeline_configs = {"accumulate_steps": 8, "p2p_cache_shape": False}
    with pytest.raises(ValueError, match="p2p_cache_shape"):
        _check(_descs(8))
