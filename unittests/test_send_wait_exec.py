"""Running programs that went through the send-wait pass on Paddle 3.3.1 CPU."""

import os
import sys

import pytest
from static_pass_utils.runner import ROOT, legacy_env, run_script

from testing import launch

pytest.importorskip("paddle")
pytestmark = pytest.mark.slow  # each case runs programs in fresh interpreters, one on two ranks


def test_nop_program_runs_on_cpu_with_identical_results(tmp_path):
    r = run_script("exec_nop.py", tmp_path / "exec.json")
    h = r["h"]
    assert r["with_comm_after_pass"][3:7] == ["c_sync_calc_stream", "send_v2", "recv_v2", "nop"]
    assert "c_sync_comm_stream" not in r["with_comm_after_pass"]
    assert "nop" in r["run_after"] and "nop" not in r["run_before"]
    assert [t for t in r["run_after"] if t != "nop"] == r["run_before"]
    assert r["nop_inputs"] == [[h]]
    assert r["max_abs_diff"] == 0.0      # fetched h, parameters after 3 SGD steps: bit-identical
    assert r["params_changed_by"] > 1e-3  # and training did move the parameters


def test_two_rank_gloo_static_send_recv_not_executable_on_cpu(tmp_path):
    """Paddle 3.3.1's CPU build has no static-mode kernel for send_v2/recv_v2 (nor the stream
    syncs), so the transformed 2-rank programs cannot run on gloo. If a later Paddle runs them,
    this test fails: then compare the two ranks' results against the untransformed programs."""
    script = os.path.join(ROOT, "unittests", "static_pass_utils", "gloo_run.py")
    import json

    for attempt in range(3):  # gloo's rendezvous on fresh ports can fail on a loaded machine: retry
        port = launch.free_port()
        outs = [tmp_path / f"a{attempt}-r{rank}.json" for rank in (0, 1)]
        ends = launch.run_ranks([[sys.executable, script, str(rank), str(port), str(outs[rank])] for rank in (0, 1)],
                                envs=[legacy_env()] * 2, cwd=ROOT, timeout=120)
        errors = ["timed out" if e.stopped else e.stderr[-2000:] for e in ends]
        if all(o.exists() for o in outs):
            break
    assert all(o.exists() for o in outs), "a rank wrote no result:\n" + "\n---\n".join(errors)
    results = [json.load(open(o)) for o in outs]
    r0, r1 = results
    assert r0["changed"] and "nop" in r0["ops"] and not r1["changed"]
    assert r0["as_is"]["outcome"] == "error" and "c_sync_calc_stream" in r0["as_is"]["error"]
    assert r0["without_stream_syncs"]["outcome"] == "error"
    assert "Do not support send for cpu kernel" in r0["without_stream_syncs"]["error"]
    assert r1["without_stream_syncs"]["outcome"] == "error"
    assert "Do not support recv for cpu kernel" in r1["without_stream_syncs"]["error"]
