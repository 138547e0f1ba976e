"""In PIR mode (Paddle's default): hands a PIR program and a non-Program to the pass, and saves
a PIR inference model (.json) for the CLI test; writes JSON. Usage: ``pir_inputs.py OUTDIR OUT.json``.
"""

import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import paddle  # noqa: E402

from static_passes import SendWaitError, optimize_pipeline_send_wait  # noqa: E402

out_dir, out = sys.argv[1], sys.argv[2]
paddle.enable_static()
result = {}
main, startup = paddle.static.Program(), paddle.static.Program()
with paddle.static.program_guard(main, startup):
    x = paddle.static.data("x", [2, 4], "float32")
    y = paddle.scale(x, 2.0)
result["program_type"] = f"{type(main).__module__}.{type(main).__name__}"
for label, arg in [("pir", main), ("non_program", "not a program")]:
    try:
        optimize_pipeline_send_wait(arg)
        result[label] = {"raised": None}
    except (SendWaitError, TypeError) as exc:
        result[label] = {"raised": type(exc).__name__, "message": str(exc)}
exe = paddle.static.Executor(paddle.CPUPlace())
exe.run(startup)
prefix = os.path.join(out_dir, "pir_model")
paddle.static.save_inference_model(prefix, [x], [y], exe, program=main)
result["saved"] = sorted(os.listdir(out_dir))
with open(out, "w") as f:
    json.dump(result, f)
