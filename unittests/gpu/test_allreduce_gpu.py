"""2 GPUs: the custom all-reduce captured in graphs (parity, misuse, correctness per size).

Runs ``tools/bench_allreduce.py`` with a short size list (it launches its own 2 ranks under a
hard timeout) and checks its JSON. The full latency run is ``python tools/bench_allreduce.py``.
"""

import json
import os
import sys

import pytest
import torch

from testing import launch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.two_gpus


@pytest.mark.timeout(300)
def test_custom_allreduce_in_graphs(tmp_path):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    cmd = [sys.executable, os.path.join(REPO, "tools", "bench_allreduce.py"), "--sizes", "4096,262144,4194304",
           "--calls", "8", "--rounds", "5", "--stress-calls", "50", "--timeout", "200", "--out", str(tmp_path)]
    end = launch.run(cmd, env=env, timeout=260)
    files = list(tmp_path.glob("allreduce-*.json"))
    assert files, end.stdout[-3000:] + end.stderr[-3000:]
    rec = json.load(open(files[0]))
    assert rec["status"] == "ok", end.stdout[-3000:] + end.stderr[-3000:]
    assert rec["custom_unavailable_reason"] is None, rec["peer_access"]
    for row in rec["sections"]["latency"]:
        assert row["errors"] == {} and all(row["correct"].values()), row
    for name, p in rec["sections"]["parity"].items():
        assert p["passed"], (name, p)
        assert p["paths_during_capture_phase"]["registered"] >= 1, p
    assert rec["sections"]["stress"]["passed"], rec["sections"]["stress"]
    assert rec["sections"]["epoch_wrap"]["passed"], rec["sections"]["epoch_wrap"]
    assert rec["sections"]["misuse"]["passed"], rec["sections"]["misuse"]
