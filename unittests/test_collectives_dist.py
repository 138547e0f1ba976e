"""Two real ranks on gloo (CPU): the fallback all-reduce sums, TP layers, fleet routing.

Each case starts its ranks in a new session under a timeout and kills the session afterwards.
This file is also the rank worker: ``python test_collectives_dist.py torch|paddle ...``.
"""

import json
import os
import sys

import pytest

from testing import launch

pytestmark = pytest.mark.slow  # every case starts two ranks

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))


# ------------------------------------------------------------------------- launching
def _run(cmds, env, cwd, timeout):
    """[(exit code, or None for a process stopped at the timeout or after a peer failed; output)]."""
    ends = launch.run_ranks(cmds, envs=[env] * len(cmds), cwd=cwd, timeout=timeout, merge_stderr=True)
    return [(None if e.stopped else e.returncode, e.stdout + ("\ntimeout" if e.timed_out else "")) for e in ends]


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1")


def _results(tmp_path, n=2):
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(n)]


@pytest.mark.timeout(200)
def test_torch_gloo_fallback_sums_and_tensor_parallel(tmp_path):
    port = str(launch.free_port())
    cmds = [[sys.executable, HERE, "torch", str(r), port, str(tmp_path)] for r in range(2)]
    outs = _run(cmds, _env(), str(tmp_path), timeout=170)
    assert all(rc == 0 for rc, _ in outs), "\n".join(o[-3000:] for _, o in outs)
    for res in _results(tmp_path):
        assert "CUDA is not available" in res["why_not_custom"]
        assert res["sums_ok"], res
        assert res["paths"] == {"fallback": res["calls"], "registered": 0, "allocation_mimic": 0, "copy_in": 0}
        assert res["tp_forward_err"] < 1e-5, res
        assert res["tp_grad_err"] < 1e-5, res


@pytest.mark.timeout(280)
def test_paddle_gloo_fallback_sums_and_fleet_routing(tmp_path):
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
           "--log_dir", str(tmp_path / "log"), HERE, "paddle", str(tmp_path)]
    outs = _run([cmd], _env(), str(tmp_path), timeout=250)
    logs = ""
    if (tmp_path / "log").exists():
        logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp_path / "log").glob("workerlog.*")))
    assert outs[0][0] == 0, f"{outs[0][1][-2000:]}\n{logs}"
    for res in _results(tmp_path):
        assert "no Paddle peer-memory" in res["why_not_custom"]
        assert res["sums_ok"], res
        assert res["routed_calls"] >= 2, res        # Row forward + Column backward went through it
        assert res["unrouted_calls"] == 0, res      # outside the phase fleet's own ops run
        assert "GLOO does not support all_reduce" in res["fleet_own_op_error"], res
        assert res["fleet_forward_err"] < 1e-5, res
        assert res["fleet_grad_err"] < 1e-5, res


# --------------------------------------------------------------------------- workers
def torch_worker(rank, port, out):
    import torch
    import torch.distributed as dist

    from paddle_graphpp.core.collectives import AllReducePath, capture_custom_allreduce
    from paddle_graphpp.torch.collectives.allreduce import create_allreduce
    from paddle_graphpp.torch.collectives.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ar = create_allreduce()
    res = {"why_not_custom": ar.why_not_custom(torch.ones(4))}
    ok = True
    calls = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64):
        for phase in (False, True):
            t = torch.arange(24, dtype=dtype).reshape(4, 6) * (rank + 1)
            if phase:
                with capture_custom_allreduce():
                    r = ar.all_reduce(t)
            else:
                r = ar.all_reduce(t)
            calls += 1
            ok &= bool(torch.equal(r, torch.arange(24, dtype=dtype).reshape(4, 6) * 3))
    res["sums_ok"] = ok

    torch.manual_seed(0)   # same dense weights and data on both ranks
    w1, b1 = torch.randn(16, 8, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    w2, b2 = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    x = torch.randn(5, 8, dtype=torch.float64)
    col = ColumnParallelLinear(8, 16, dispatcher=ar, dtype=torch.float64).load_dense(w1, b1)
    row = RowParallelLinear(16, 8, dispatcher=ar, dtype=torch.float64).load_dense(w2, b2)
    xa = x.clone().requires_grad_(True)
    y = row(torch.nn.functional.gelu(col(xa)))
    y.square().sum().backward()
    calls += 2
    xd = x.clone().requires_grad_(True)
    w1d, w2d = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    yd = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(xd, w1d, b1)), w2d, b2)
    yd.square().sum().backward()
    rows = slice(rank * 8, rank * 8 + 8)
    res["tp_forward_err"] = float((y - yd).abs().max())
    res["tp_grad_err"] = max(float((xa.grad - xd.grad).abs().max()),
                             float((col.weight.grad - w1d.grad[rows]).abs().max()),
                             float((row.weight.grad - w2d.grad[:, rows]).abs().max()))
    res["calls"] = calls
    res["paths"] = {p.value: n for p, n in ar.counts.items()}
    assert ar.counts[AllReducePath.FALLBACK] == calls
    json.dump(res, open(os.path.join(out, f"rank{rank}.json"), "w"))
    os._exit(0)   # skip process-group teardown (it can hang; see DESIGN.md)


def paddle_worker(out):
    import numpy as np
    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet
    from paddle.distributed.fleet.layers.mpu.mp_layers import ColumnParallelLinear, RowParallelLinear

    from paddle_graphpp.core.collectives import AllReducePath, capture_custom_allreduce
    from paddle_graphpp.paddle.collectives.allreduce import create_allreduce, route_fleet_tensor_parallel

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 2, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    rank = hcg.get_model_parallel_rank()
    group = hcg.get_model_parallel_group()
    ar = create_allreduce(group)
    res = {"why_not_custom": ar.why_not_custom(paddle.ones([4]))}
    ok = True
    for dtype in ("float32", "float64", "int64"):
        for phase in (False, True):
            t = paddle.arange(24).astype(dtype).reshape([4, 6]) * (rank + 1)
            if phase:
                with capture_custom_allreduce():
                    r = ar.all_reduce(t)
            else:
                r = ar.all_reduce(t)
            ok &= bool(np.array_equal(r.numpy(), (np.arange(24).reshape(4, 6) * 3).astype(dtype)))
    res["sums_ok"] = ok

    paddle.seed(0)
    np.random.seed(0)
    w1, b1 = np.random.randn(8, 16), np.random.randn(16)      # paddle weights are [in, out]
    w2, b2 = np.random.randn(16, 8), np.random.randn(8)
    x = np.random.randn(5, 8)
    paddle.set_default_dtype("float64")
    col = ColumnParallelLinear(8, 16, has_bias=True, gather_output=False)
    row = RowParallelLinear(16, 8, has_bias=True, input_is_parallel=True)
    cols = slice(rank * 8, rank * 8 + 8)
    col.weight.set_value(w1[:, cols])
    col.bias.set_value(b1[cols])
    row.weight.set_value(w2[cols, :])
    row.bias.set_value(b2)

    def run():
        xa = paddle.to_tensor(x, stop_gradient=False)
        y = row(paddle.nn.functional.gelu(col(xa)))
        y.square().sum().backward()
        return y, xa.grad

    from paddle.distributed.fleet.layers.mpu import mp_ops

    with route_fleet_tensor_parallel(ar):
        before = dict(ar.counts)
        # not graphed: fleet's own op runs. On CPU it cannot (gloo has no calc-stream
        # all-reduce, c_identity no CPU kernel), and that error proves it was fleet's.
        try:
            mp_ops._mp_allreduce(paddle.ones([4]) * (rank + 1), group=group)
            res["fleet_own_op_error"] = None
        except NotImplementedError as exc:
            res["fleet_own_op_error"] = str(exc)[:200]
        res["unrouted_calls"] = sum(ar.counts.values()) - sum(before.values())
        with capture_custom_allreduce():        # graphed: through the dispatcher
            y, gx = run()
        res["routed_calls"] = ar.counts[AllReducePath.FALLBACK] - before[AllReducePath.FALLBACK]

    xd = paddle.to_tensor(x, stop_gradient=False)
    w1d, w2d = paddle.to_tensor(w1, stop_gradient=False), paddle.to_tensor(w2, stop_gradient=False)
    yd = paddle.nn.functional.linear(paddle.nn.functional.gelu(paddle.nn.functional.linear(xd, w1d, paddle.to_tensor(b1))),
                                     w2d, paddle.to_tensor(b2))
    yd.square().sum().backward()
    res["sums_ok"] = ok
    res["fleet_forward_err"] = float((y - yd).abs().max())
    res["fleet_grad_err"] = max(float((gx - xd.grad).abs().max()),
                                float((col.weight.grad - w1d.grad[:, cols]).abs().max()),
                                float((row.weight.grad - w2d.grad[cols, :]).abs().max()))
    json.dump(res, open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w"))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    if sys.argv[1] == "torch":
        torch_worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        paddle_worker(sys.argv[2])
