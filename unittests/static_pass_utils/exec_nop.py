"""Runs a stage program with and without the pass's ``nop`` on Executor(CPUPlace); writes JSON.

Usage: ``FLAGS_enable_pir_api=0 python unittests/static_pass_utils/exec_nop.py OUT.json``.

Stage 0 of a 2-stage 1F1B pipeline, built with real ops: ``h = relu(fc(x))`` is sent forward
(``c_sync_calc_stream``, ``send_v2``, ``c_sync_comm_stream``), ``g = dLoss/dh`` comes back by a
backward ``recv_v2``, backward (``paddle.static.gradients`` with ``g`` as target gradient) and
SGD follow. The pass removes the sync and puts ``nop(h)`` after the recv. Paddle's CPU build has
no kernel for ``send_v2``/``recv_v2``/``c_sync_comm_stream``, so both programs run with the
communication ops taken out and ``g`` fed instead; everything else, the ``nop`` included, runs.
"""

import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from unittests.static_pass_utils.programs import B, F, paddle  # noqa: E402

import numpy as np  # noqa: E402

from static_passes import optimize_pipeline_send_wait  # noqa: E402

COMM = ("send_v2", "recv_v2", "c_sync_comm_stream", "c_sync_calc_stream")


def build():
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 8], "float32")
        g = paddle.static.data("g", [4, 8], "float32")
        h = paddle.static.nn.fc(x, 8, activation="relu")
        params = [p for p in main.all_parameters()]
        grads = paddle.static.gradients([h], params, target_gradients=[g])
        paddle.optimizer.SGD(0.1).apply_gradients(list(zip(params, grads)))
    block = main.global_block()
    producer = max(i for i, op in enumerate(block.ops) if h.name in op.output_arg_names)
    block._insert_op(producer + 1, type="c_sync_calc_stream", inputs={"X": h}, outputs={"Out": h},
                     attrs={"op_role": F})
    block._insert_op(producer + 2, type="send_v2", inputs={"X": h},
                     attrs={"ring_id": 20, "peer": 1, "use_calc_stream": False, "op_role": F})
    block._insert_op(producer + 3, type="c_sync_comm_stream", inputs={"X": h}, outputs={"Out": h},
                     attrs={"ring_id": 20, "op_role": B})
    first_backward = next(i for i, op in enumerate(block.ops) if i > producer + 3 and op.attr("op_role") == B)
    block._insert_op(first_backward, type="recv_v2", outputs={"Out": g},
                     attrs={"ring_id": 21, "peer": 0, "use_calc_stream": True, "op_role": B,
                            "out_shape": [4, 8], "dtype": g.dtype})
    return main, startup, h.name


def local(program):
    """The program without the ops that have no CPU kernel (``g`` is fed in place of the recv)."""
    program = program.clone()
    block = program.global_block()
    for i in reversed(range(len(block.ops))):
        if block.ops[i].type in COMM:
            block._remove_op(i)
    return program


def train(program, startup, fetch, steps=3):
    scope = paddle.static.Scope()
    exe = paddle.static.Executor(paddle.CPUPlace())
    rng = np.random.default_rng(0)
    with paddle.static.scope_guard(scope):
        paddle.seed(7)
        exe.run(startup)
        outs = []
        for _ in range(steps):
            feed = {"x": rng.standard_normal((4, 8)).astype("float32"),
                    "g": rng.standard_normal((4, 8)).astype("float32")}
            outs.append(exe.run(program, feed=feed, fetch_list=fetch))
        params = {p.name: np.array(scope.find_var(p.name).get_tensor()) for p in program.all_parameters()}
    return outs, params


if __name__ == "__main__":
    main, startup, h = build()
    before = local(main)
    report = optimize_pipeline_send_wait(main)
    after = local(main)
    fetch = [h] + [p.name for p in main.all_parameters()]
    out_b, par_b = train(before, startup, fetch)
    out_a, par_a = train(after, startup, fetch)
    diff = max(float(np.max(np.abs(a - b))) for ra, rb in zip(out_a, out_b) for a, b in zip(ra, rb))
    diff = max([diff] + [float(np.max(np.abs(par_a[k] - par_b[k]))) for k in par_b])
    moved = max(float(np.max(np.abs(par_a[k] - out_a[0][1 + i]))) for i, k in enumerate(par_b))
    result = {
        "with_comm_after_pass": [op.type for op in main.global_block().ops],
        "run_before": [op.type for op in before.global_block().ops],
        "run_after": [op.type for op in after.global_block().ops],
        "nop_inputs": [op.input_arg_names for op in after.global_block().ops if op.type == "nop"],
        "h": h, "max_abs_diff": diff, "params_changed_by": moved,
        "report": report.to_dict(),
    }
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)
