"""The capacity mode's checks agree across NCCL ranks, with the blocks graphed (two GPUs).

Two ranks train a Hugging Face Qwen3-MoE under DDP over NCCL, one GPU each, with the capacity mode
(``on_overflow="rerun"``) and every block graphed whole by ``graph_layers``: rank 0's capacity holds
every pair, rank 1's drops in every step. The checks agree through the default group's store, so
both ranks re-run every step without the capacity mode, and each trains bit for bit (fp32, TF32
off) as plain DDP with the model's own experts, while the blocks' graphs are captured and replayed
in the steps' first runs. Each rank runs in its own session under a timeout (testing/launch.py).
This file is also the rank worker: ``python test_moe_ranks_gpu.py MODE RANK PORT OUT_DIR``, where
MODE ``gloo`` runs the same worker on CPU ranks (no graphs are captured there), to check the
worker itself without GPUs.
"""
import os
import sys

import pytest

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))

pytestmark = [pytest.mark.two_gpus, pytest.mark.timeout(300)]

GROUP_TIMEOUT = 60  # seconds: the process group's, which the checks wait for a peer


def test_an_overflow_on_one_nccl_rank_re_runs_the_graphed_step_on_both_and_equals_plain_ddp(tmp_path):
    pytest.importorskip("transformers")
    from testing import launch

    r0, r1 = launch.run_worker_ranks(HERE, "nccl", tmp_path, timeout=240, pythonpath=[REPO])
    for r in (r0, r1):
        assert r["equal_to_plain"], r  # losses and every parameter, bit for bit
        assert r["reruns"] == r["steps"] == 3, r
        assert r["captures"] > 0 and r["replays"] > 0, r  # the steps' first runs replayed graphs
    assert r0["dropped_here"] == 0 < r1["dropped_here"]  # rank 0 drops nothing, and re-runs all the same
    assert r0["rerun_dropped"] == r1["rerun_dropped"] > 0  # the pairs dropped on every rank
    assert r0["digest"] == r1["digest"]  # the replicas stay equal


def _worker(mode, rank, port, out):
    import copy
    import datetime
    import warnings

    import torch
    import torch.distributed as dist

    from testing import launch, zoo
    from paddle_graphpp.torch import capacity_experts, graph_layers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    gpu = mode == "nccl"
    if gpu:
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT))
    base = zoo.build("qwen3_moe", experts_implementation="eager").to(device)
    experts, top_k = base.config.num_experts, base.config.num_experts_per_tok
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own batches
    data = [[torch.randint(0, base.config.vocab_size, (2, 16), generator=gen).to(device) for _ in range(2)]
            for _ in range(3)]
    factor = experts / top_k if rank == 0 else 0.25  # rank 0 holds every pair, rank 1 a quarter of a share
    ids = [rank] if gpu else None

    expected = zoo.train_steps(torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=ids), data)
    model = copy.deepcopy(base)
    mode_ = capacity_experts(model, factor, on_overflow="rerun")
    graphed = graph_layers(zoo.blocks_of(model), num_warmup_steps=1)
    wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    dropped_here = zoo.note_own_drops(mode_)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = zoo.train_steps(wrapped, data, mode_.step)
    same = all(torch.equal(a, b) for a, b in zip(expected[0] + expected[1], got[0] + got[1]))
    result = {"equal_to_plain": same, "reruns": mode_.reruns, "steps": len(data),
              "rerun_dropped": mode_.rerun_dropped, "dropped_here": sum(dropped_here),
              "captures": sum(block.engine.captures for block in graphed),
              "replays": sum(block.engine.replays for block in graphed),
              "digest": float(sum(p.double().sum() for p in model.parameters()))}
    if gpu:
        torch.cuda.synchronize()
    launch.finish_worker_rank(result, rank, out)


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
