"""One rank of the 2-rank gloo run of the transformed real section programs; writes JSON.

Usage: ``FLAGS_enable_pir_api=0 python unittests/static_pass_utils/gloo_run.py RANK PORT OUT.json``.
Builds the real 2-stage 1F1B program of RANK (upstream's own nop disabled), applies the pass,
joins a 2-rank gloo group and runs the section program once on Executor(CPUPlace). Records the
outcome: fetched values, or the error Paddle raised.
"""

import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from unittests.static_pass_utils.programs import build_real, paddle  # noqa: E402

import numpy as np  # noqa: E402

from static_passes import optimize_pipeline_send_wait  # noqa: E402

rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
main, section, startup = build_real(2, rank, upstream_nop=False)
report = optimize_pipeline_send_wait(main, startup)

endpoints = [f"127.0.0.1:{port + 1 + i}" for i in range(2)]
os.environ.update(
    PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM="2", PADDLE_RANK_IN_NODE=str(rank),
    PADDLE_TRAINER_ENDPOINTS=",".join(endpoints), PADDLE_CURRENT_ENDPOINT=endpoints[rank],
    PADDLE_MASTER=f"127.0.0.1:{port}", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    PADDLE_DISTRI_BACKEND="gloo",
)
import paddle.distributed as dist  # noqa: E402

paddle.disable_static()
dist.init_parallel_env()
paddle.enable_static()
result = {"rank": rank, "ops": [op.type for op in section.global_block().ops], "changed": report.changed}


def attempt(program):
    """Run ``program`` once; the outcome (or Paddle's error) is the finding, so it is recorded."""
    try:
        exe = paddle.static.Executor(paddle.CPUPlace())
        rng = np.random.default_rng(rank)
        feed = {"x": rng.standard_normal((4, 8)).astype("float32")} if rank == 0 else {
            "y": rng.standard_normal((4, 1)).astype("float32")}
        scope = paddle.static.Scope()
        with paddle.static.scope_guard(scope):
            for param in program.all_parameters():
                scope.var(param.name).get_tensor().set(np.ones(param.shape, "float32"), paddle.CPUPlace())
            exe.run(program, feed=feed)
        return {"outcome": "ran"}
    except Exception as exc:
        return {"outcome": "error", "error": str(exc)[-1500:]}


result["as_is"] = attempt(section)
# The stream syncs are no-ops on a CPU and have no CPU kernel; without them, send/recv are reached.
bare = section.clone()
for i in reversed(range(len(bare.global_block().ops))):
    if bare.global_block().ops[i].type in ("c_sync_calc_stream", "c_sync_comm_stream"):
        bare.global_block()._remove_op(i)
result["without_stream_syncs"] = attempt(bare)
with open(out, "w") as f:
    json.dump(result, f)
os._exit(0)  # do not wait on gloo teardown
