"""Two gloo ranks agree on failed captures (``paddle_graphpp.torch.agree_on_captures``).

The ranks use the fake graph runtime (CPU tensors; its capture runs the code, so a layer can
fail "capture" the way a host sync fails a real one). Each case starts its ranks in a new session
under a timeout (testing/launch.py) and kills them afterwards. This file is also the rank worker:
``python test_capture_agreement.py MODE RANK PORT OUT_DIR``.
"""
import json
import os
import sys
import time

import pytest

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))

pytestmark = pytest.mark.slow  # every case starts two ranks

AGREEMENT_TIMEOUT = 4.0


# ------------------------------------------------------------------------- the tests
def _run(mode, tmp_path):
    from testing import launch

    return launch.run_worker_ranks(HERE, mode, tmp_path, timeout=90, pythonpath=[REPO, os.path.dirname(HERE)])


@pytest.mark.timeout(150)
def test_one_rank_fails_capture_and_every_rank_raises(tmp_path):
    r0, r1 = _run("one_fails", tmp_path)
    assert r1["outcome"] == "CaptureError" and "rank1-layer: capturing the forward failed" in r1["message"]
    assert "every rank of the capture agreement group raises" in r1["notes"]
    assert r0["outcome"] == "CaptureError"
    assert "failed on rank(s) [1] of the capture agreement group" in r0["message"]
    assert r0["step"] == r1["step"] == 1  # the capture step, on both ranks


@pytest.mark.timeout(150)
def test_by_default_a_peers_failed_capture_makes_this_rank_raise(tmp_path):
    # No agree_on_captures(): the replay watchdog reads the failure rank 1 published in the
    # store, and rank 0 raises at its next graphed call instead of going on alone.
    r0, r1 = _run("default", tmp_path)
    assert r1["outcome"] == "CaptureError" and "rank1-layer: capturing the forward failed" in r1["message"]
    assert r0["outcome"] == "ReplayTimeoutError", r0
    assert "capturing CUDA graphs failed on rank 1: CaptureError: rank1-layer" in r0["message"], r0
    assert r0["seconds_to_raise"] < 15, r0  # the store is read about once a second; the group's timeout is 30 s
    assert r0["store_read_ms"] < 50, r0  # what each of those reads costs the watchdog's thread


@pytest.mark.timeout(150)
def test_the_default_agreement_can_be_turned_off(tmp_path):
    r0, r1 = _run("default_off", tmp_path)
    assert r1["outcome"] == "CaptureError"
    assert r0["outcome"] == "trained", r0


@pytest.mark.timeout(150)
def test_fallback_eager_keeps_every_rank_training(tmp_path):
    r0, r1 = _run("fallback", tmp_path)
    assert r0["outcome"] == r1["outcome"] == "trained"
    assert r0["replays"] == 4 and r1["replays"] == 0  # rank 1's layer went eager, rank 0's replays


@pytest.mark.timeout(150)
def test_a_peer_that_never_captures_makes_the_other_raise_within_the_timeout(tmp_path):
    r0, r1 = _run("late", tmp_path)
    assert r0["outcome"] == "CaptureError" and "did not complete within" in r0["message"], r0
    assert r0["seconds_in_capture_step"] < AGREEMENT_TIMEOUT + 10, r0
    assert r1["outcome"] == "trained"


# ------------------------------------------------------------------------- the worker
def _worker(mode, rank, port, out):
    import datetime

    import torch
    import torch.distributed as dist

    from fake_runtime import FakeGraphRuntime
    from paddle_graphpp.core import runtime as runtime_mod
    from paddle_graphpp.core.engine import EngineOptions, GraphedCallable
    from paddle_graphpp.core.errors import CaptureError
    from paddle_graphpp.torch import agree_on_captures

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if mode == "gpu":
        _gpu_worker(rank, out)
    if mode.startswith("default"):
        _default_worker(mode, rank, out)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    rt = FakeGraphRuntime()
    runtime_mod.register_runtime("torch", lambda: rt)
    agree_on_captures(timeout=AGREEMENT_TIMEOUT)

    class SyncsInCapture(torch.nn.Module):
        """Fails under capture as a host sync would (on the rank told to)."""

        def __init__(self, fail):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.fail = fail

        def forward(self, x):
            if self.fail and rt.capturing:
                raise RuntimeError("operation not permitted when stream is capturing")
            return self.lin(x)

    fails = rank == 1 and mode in ("one_fails", "fallback")
    warmup = 10 if (rank == 1 and mode == "late") else 0
    module = SyncsInCapture(fails)
    layer = GraphedCallable(module, rt, lambda: list(module.parameters()), name=f"rank{rank}-layer",
                            options=EngineOptions(num_warmup_steps=warmup,
                                                  fallback="eager" if mode == "fallback" else "error"))
    result = {"outcome": "trained", "notes": ""}
    step = 0
    try:
        for step in range(3):  # recorded, then captured (at step 1's start) and replayed
            start = time.monotonic()
            layer((torch.randn(2, 4, requires_grad=True),), {}).sum().backward()
    except CaptureError as exc:
        result.update(outcome="CaptureError", message=str(exc), notes=" ".join(getattr(exc, "__notes__", [])))
    result.update(step=step, replays=layer.replays, seconds_in_capture_step=time.monotonic() - start)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if mode == "late" and rank == 1:
        time.sleep(AGREEMENT_TIMEOUT + 4)  # stay connected: rank 0 must give up on its own timeout
    sys.stdout.flush()
    os._exit(0)  # no destroy_process_group: a broken gloo group can hang there


def _default_worker(mode, rank, out):
    """Modes "default" and "default_off": no agree_on_captures(); rank 1's capture fails."""
    import datetime

    import torch
    import torch.distributed as dist

    from fake_runtime import FakeGraphRuntime
    from paddle_graphpp.core.engine import EngineOptions, GraphedCallable
    from paddle_graphpp.core.errors import CaptureError, ReplayTimeoutError

    if mode == "default_off":
        os.environ["FLAGS_graphpp_capture_agreement"] = "0"
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    rt = FakeGraphRuntime()

    class Fails(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            if rank == 1 and rt.capturing:
                raise RuntimeError("operation not permitted when stream is capturing")
            return self.lin(x)

    module = Fails()
    layer = GraphedCallable(module, rt, lambda: list(module.parameters()), name=f"rank{rank}-layer",
                            options=EngineOptions(num_warmup_steps=0))
    result, start, failed_at = {"outcome": "trained"}, time.monotonic(), None
    try:
        for step in range(40 if rank == 0 else 3):  # rank 0 keeps stepping for a few seconds
            layer((torch.randn(2, 4, requires_grad=True),), {}).sum().backward()
            time.sleep(0.2 if rank == 0 else 0)
    except (CaptureError, ReplayTimeoutError) as exc:
        result.update(outcome=type(exc).__name__, message=str(exc))
        failed_at = time.monotonic()
    if rank == 0:
        store = dist.distributed_c10d._get_default_store()
        begin = time.perf_counter()
        for _ in range(20):
            store.add("paddle_graphpp/capture_failures", 0)
        result["store_read_ms"] = (time.perf_counter() - begin) / 20 * 1e3
        # from rank 1's failure (its capture runs at its step 1, right after start) to here
        result["seconds_to_raise"] = (failed_at or time.monotonic()) - start
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if rank == 1:
        time.sleep(6)  # stay up while rank 0 reads the store
    sys.stdout.flush()
    os._exit(0)


def _gpu_worker(rank, out):
    """Mode "gpu" (unittests/gpu/test_faults_gpu.py, 2 GPUs): NCCL ranks with real captures; rank 1's
    layer reads a value on the host, which fails its capture; an NCCL all-reduce follows every
    step, where rank 0 would wait for rank 1 if it went on alone."""
    import datetime

    import torch
    import torch.distributed as dist

    from paddle_graphpp.core.errors import CaptureError
    from paddle_graphpp.torch import CUDAGraphedModule, agree_on_captures

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60),
                            device_id=torch.device("cuda", rank))
    agree_on_captures(timeout=AGREEMENT_TIMEOUT)

    class HostSync(torch.nn.Module):
        def __init__(self, sync):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)
            self.sync = sync

        def forward(self, x):
            y = self.lin(x)
            if self.sync and y.sum().item() > 1e30:  # a host read: cannot be captured
                y = y * 0
            return y

    layer = CUDAGraphedModule(HostSync(rank == 1).cuda(), num_warmup_steps=0, name=f"rank{rank}-layer")
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    result = {"outcome": "trained", "notes": ""}
    step = 0
    try:
        for step in range(3):  # recorded, then captured (at step 1's start) and replayed
            layer(x).sum().backward()
            total = torch.ones(1, device="cuda")
            dist.all_reduce(total)
            torch.cuda.synchronize()
    except CaptureError as exc:
        result.update(outcome="CaptureError", message=str(exc), notes=" ".join(getattr(exc, "__notes__", [])))
    result.update(step=step, replays=layer.engine.replays)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # no destroy_process_group: it can hang after NCCL work


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
