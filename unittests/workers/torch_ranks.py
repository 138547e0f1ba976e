"""Process-group setup shared by the torch rank workers (started under ``testing/launch.py``)."""
import datetime
import os

import torch
import torch.distributed as dist


def init_ranks(device: str, timeout_s: float = 60.0) -> tuple:
    """Join the process group the launcher's ``RANK``/``WORLD_SIZE``/``MASTER_*`` describe:
    NCCL on ``device="cuda"`` (one GPU per rank, TF32 off so graphed and eager fp32 runs agree
    to ~1e-6, multicast off), gloo on ``"cpu"``. Returns ``(rank, world)``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s)
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout,
                                device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    return rank, world


def run_rank(device: str, out_dir: str, body) -> None:
    """Join the group, write ``body(rank, world)`` (a JSON-able dict) to ``rank<N>.json`` in
    ``out_dir``, wait for the peers and leave without process-group teardown (a peer that
    already left must not stall this one). Any exception: its traceback and exit code 1."""
    import json
    import sys
    import traceback

    try:
        rank, world = init_ranks(device)
        result = body(rank, world)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
