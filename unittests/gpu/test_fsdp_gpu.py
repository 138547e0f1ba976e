"""Graphed blocks under FSDP2 (``fully_shard``), one rank over NCCL, on one GPU.

Each run is a process of its own (this file run as a script), ended with ``os._exit`` after it
reports (tearing down a process group after captured NCCL work can hang, see DESIGN.md):

* ``fully_shard`` on each block and the root, the blocks graphed before or after sharding: the
  losses and the final weights equal FSDP2 eager's bit for bit (fp32, dropout on; the eager
  runs' spread is 0), and the blocks replay their graphs;
* a block only the root shards, and ``CUDAGraphedModule`` around an FSDP2 module, are refused
  with errors that name the layout that works.
"""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires a CUDA device")
transformers = pytest.importorskip("transformers")

STEPS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(mode: str) -> dict:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), NCCL_NVLS_ENABLE="0",
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{mode}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fsdp2_graphed_blocks_equal_fsdp2_eager_in_either_order():
    runs = {mode: _run(mode) for mode in ("eager", "eager_again", "graph_then_shard", "shard_then_graph")}
    spread = max(abs(a - b) for a, b in zip(runs["eager"]["losses"], runs["eager_again"]["losses"]))
    for mode in ("graph_then_shard", "shard_then_graph"):
        run = runs[mode]
        assert run["replays"] > 0, f"{mode}: the graphed blocks never replayed"
        diff = max(abs(a - b) for a, b in zip(runs["eager"]["losses"], run["losses"]))
        assert diff <= spread, f"{mode}: losses differ from FSDP2 eager by {diff} (eager spread {spread})"
        if spread == 0:
            assert run["weights"] == runs["eager"]["weights"], f"{mode}: final weights differ from FSDP2 eager"


def test_fsdp2_layouts_that_cannot_work_are_refused():
    out = _run("refusals")
    assert "fully_shard() on each graphed block" in out["root_only"], out
    assert "Graph first, then shard" in out["wrapped"], out


# ------------------------------------------------------------------------------------- the worker
def _worker(mode: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from paddle_graphpp.torch import CUDAGraphedModule, graph_layers
    from test_recompute_gpu import build as _build, train  # this folder: the same model and loop

    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    model = _build()
    blocks = model.model.layers
    if mode == "refusals":
        out = {}
        fully_shard(model)  # the root only: the blocks' parameters are the root's DTensors
        try:
            graph_layers(blocks)
        except TypeError as e:
            out["root_only"] = str(e)
        inner = _build().model.layers[0]
        fully_shard(inner)
        try:
            CUDAGraphedModule(inner)
        except TypeError as e:
            out["wrapped"] = str(e)
        return out
    if mode == "graph_then_shard":
        graph_layers(blocks)
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    if mode == "shard_then_graph":
        graph_layers(blocks)
    losses, _ = train(model, STEPS)
    weights = [float(p.full_tensor().double().sum()) for p in model.parameters()]
    replays = blocks[0].engine.replays if mode.startswith(("graph", "shard")) else 0
    return {"losses": [float(v) for v in losses], "weights": weights, "replays": replays}


if __name__ == "__main__":
    result = _worker(sys.argv[1])
    print(json.dumps(result), flush=True)
    os._exit(0)
