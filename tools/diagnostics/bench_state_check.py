"""Cost of the replay-time check that parameters, buffers and optimizer state were not replaced.

Measures :meth:`paddle_graphpp.core.state.StateWatch.changed` on CPU (the check runs on the
host: it reads dictionaries and tensor addresses, never the device) for a graphed layer's
parameters and buffers and for an AdamW optimizer's state, and writes a JSON record.

    python tools/diagnostics/bench_state_check.py --out benchmarks/results/state-check-cpu.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import timeit

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from paddle_graphpp.core.state import StateWatch  # noqa: E402
from paddle_graphpp.torch.optim import optimizer_state_slots  # noqa: E402
from paddle_graphpp.torch.runtime import RUNTIME  # noqa: E402
from tools import benchlib  # noqa: E402


def per_tensor_us(watch: StateWatch, tensors: int, number: int, repeat: int) -> dict:
    best = min(timeit.repeat(watch.changed, number=number, repeat=repeat)) / number
    return {"tensors": tensors, "slots": len(watch), "us_per_check": round(best * 1e6, 3),
            "us_per_tensor": round(best * 1e6 / tensors, 4)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24, help="decoder layers whose optimizer state is checked")
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    layer = torch.nn.TransformerEncoderLayer(args.hidden, 16, 4 * args.hidden, batch_first=True)
    layer.register_buffer("rope_cache", torch.zeros(16, args.hidden // 16))  # a buffer, as rotary caches are
    layer_watch = StateWatch(RUNTIME, RUNTIME.state_slots(layer))
    n_layer = sum(1 for _ in layer.parameters()) + sum(1 for _ in layer.buffers())

    model = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
                                  for _ in range(args.layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8, 64)).sum().backward()
    opt.step()  # creates the state: step, exp_avg, exp_avg_sq per parameter
    params = [p for g in opt.param_groups for p in g["params"]]
    opt_watch = StateWatch(RUNTIME, optimizer_state_slots(opt, params))
    n_opt = sum(sum(1 for v in opt.state[p].values() if isinstance(v, torch.Tensor)) for p in params)

    record = {
        "benchmark": "state_check",
        "command": "python " + " ".join([os.path.relpath(__file__, REPO), *(argv if argv is not None else sys.argv[1:])]),
        "code_version": benchlib.code_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu": platform.processor() or platform.machine(),
        "note": ("StateWatch.changed() on the host: one dict lookup, one identity test and one data_ptr() "
                 "per tensor. Graphed layers run it once per layer and step (first forward replay of an "
                 "episode); GraphedOptimizer once per step. Best of --repeat runs of --number checks."),
        "layer": {"module": f"TransformerEncoderLayer({args.hidden}, 16) + 1 buffer",
                  **per_tensor_us(layer_watch, n_layer, args.number, args.repeat)},
        "optimizer": {"optimizer": f"AdamW over {len(params)} parameters ({args.layers} encoder layers)",
                      **per_tensor_us(opt_watch, n_opt, max(args.number // 20, 10), args.repeat)},
    }
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return record


if __name__ == "__main__":
    main()
