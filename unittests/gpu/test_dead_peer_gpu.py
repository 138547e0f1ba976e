"""A peer that dies in the middle of a graphed tensor-parallel step (issue 37, run in the
multi-GPU issue): the survivor does not hang.

Two ranks, one GPU each, a tensor-parallel group of two: graphed blocks whose forward
all-reduces its partial sums (``torch.distributed.all_reduce``, captured by NCCL in the graphs),
two micro-batches in flight per step. Once the blocks replay, rank 1 kills itself (SIGKILL)
after its first micro-batch's forward of a step. Rank 0's next replay waits in an all-reduce
its peer never joins; its host goes on launching the step, then waits on the device for the
loss. The replay watchdog (``watch_replays(TIMEOUT, grace=GRACE)``) must end that wait:

* the error names the layer, the graph and the all-reduce captured in it;
* either the device wait returns once the communicators are aborted (``GRACE`` after the
  timeout) and the next graphed call raises ``ReplayTimeoutError``, or the process exits with
  ``EXIT_CODE`` (another ``GRACE`` later) with the error on stderr;
* all of it within ``TIMEOUT + 2 * GRACE`` of the kill, plus ``MARGIN`` (the watchdog's poll,
  the interpreter's exit).

PyTorch's own NCCL watchdog follows work objects, which replays do not have; if it ends rank 0
first on a build that notices the dead peer another way, this test fails and shows its output.

The same step with the project's custom all-reduce (``create_allreduce(timeout=AR_TIMEOUT)``,
its push kernel captured in the graphs) instead of NCCL's: the kernel gives up on the dead peer
after ``AR_TIMEOUT``, the replays complete, and the next graphed call raises
``CollectiveTimeoutError`` naming rank 1, within ``AR_TIMEOUT`` plus ``MARGIN`` of the kill.

Run on a machine with two GPUs: ``python -m pytest unittests/gpu/test_dead_peer_gpu.py -q``.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

pytestmark = [pytest.mark.two_gpus,
              pytest.mark.timeout(240)]

from paddle_graphpp.core.watchdog import EXIT_CODE  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT, GRACE, MARGIN = 5.0, 3.0, 5.0
AR_TIMEOUT = 2.0
KILL_STEP = 5  # warmup 1, recorded 2, captured and replayed 3: replays from the third step on

WORKER = textwrap.dedent(f'''
    import datetime, json, os, signal, sys, time
    import torch
    import torch.distributed as dist
    from torch import nn

    rank, port, out, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    from paddle_graphpp import ReplayTimeoutError
    from paddle_graphpp.torch import graph_layers, watch_replays

    if mode == "custom":
        from paddle_graphpp.torch.collectives.allreduce import create_allreduce

        dispatcher = create_allreduce(timeout={AR_TIMEOUT})
        why = dispatcher.why_not_custom(torch.empty(8, 256, device="cuda"))
        assert why is None, why

        class Reduce(torch.autograd.Function):
            """The row-parallel output's all-reduce; its gradient passes through."""

            @staticmethod
            def forward(ctx, y):
                return dispatcher.all_reduce(y)

            @staticmethod
            def backward(ctx, grad):
                return grad

        reduce = Reduce.apply
    else:
        def reduce(y):
            dist.all_reduce(y)
            return y

    def log(**fields):
        with open(os.path.join(out, f"rank{{rank}}.jsonl"), "a") as f:
            f.write(json.dumps(dict(fields, time=time.time())) + "\\n")

    class RowParallelMLP(nn.Module):
        """The row-parallel half of a tensor-parallel MLP: a local matmul, the partial sums all-reduced."""

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(256, 256, bias=False)

        def forward(self, x):
            return torch.nn.functional.gelu(reduce(self.fc(x)))

    torch.manual_seed(0)
    blocks = nn.ModuleList(RowParallelMLP() for _ in range(2)).cuda()
    graph_layers(blocks, num_warmup_steps=1)
    watch_replays({TIMEOUT}, grace={GRACE})
    xs = [torch.randn(8, 256, device="cuda", requires_grad=True) for _ in range(2)]
    try:
        for step in range(10):
            ys = []
            for i, x in enumerate(xs):
                for block in blocks:
                    x = block(x)
                ys.append(x)
                if rank == 1 and step == {KILL_STEP} and i == 0:
                    torch.cuda.synchronize()
                    log(event="killed", step=step)
                    os.kill(os.getpid(), signal.SIGKILL)
            for y in ys:
                y.square().mean().backward()
            loss = sum(float(y.detach().square().mean()) for y in ys)  # the host waits on the device
            log(event="step", step=step, replays=blocks[0].engine.replays, loss=loss)
    except ReplayTimeoutError as exc:  # CollectiveTimeoutError is one
        log(event="end", outcome=type(exc).__name__, message=str(exc))
    else:
        log(event="end", outcome="finished")
    sys.stdout.flush()
    os._exit(0)  # destroy_process_group can hang after captured NCCL work
''')


def _events(path):
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def _run_pair(tmp_path, mode):
    """Both ranks to their end (or 200 s) in ``mode`` ("nccl" or "custom"): (processes, the tails
    of their outputs, when they ended, when rank 1 was killed, rank 0's "end" events)."""
    from testing.launch import free_port

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    port = str(free_port())
    logs = [open(tmp_path / f"rank{r}.out", "w+") for r in range(2)]
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(tmp_path), mode], env=env,
                              cwd=str(tmp_path), stdout=logs[r], stderr=subprocess.STDOUT, start_new_session=True)
             for r in range(2)]
    try:
        deadline = time.monotonic() + 200
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        ended = time.time()
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
    finally:
        for p in procs:  # nothing outlives the test
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    outputs = []
    for f in logs:
        f.seek(0)
        outputs.append(f.read()[-4000:])
        f.close()
    assert not hung, f"ranks {hung} still ran 200 s after the start:\n" + "\n".join(outputs)
    r0, r1 = (_events(tmp_path / f"rank{r}.jsonl") for r in range(2))
    killed = [e for e in r1 if e["event"] == "killed"]
    assert procs[1].returncode == -signal.SIGKILL and killed, outputs[1]
    before = [e for e in r0 if e["event"] == "step" and e["step"] < KILL_STEP]
    assert before and before[-1]["replays"] > 0, ("rank 0 replayed nothing before the kill", r0, outputs[0])
    end = [e for e in r0 if e["event"] == "end"]
    return procs, outputs, ended, killed[0]["time"], end


def test_the_survivor_of_a_peer_killed_mid_step_raises_or_exits_within_the_timeout(tmp_path):
    procs, outputs, ended, killed, end = _run_pair(tmp_path, "nccl")
    if end:  # the device wait returned after the abort: the next graphed call raised
        assert end[0]["outcome"] == "ReplayTimeoutError", (end, outputs[0])
        message, ended = end[0]["message"], end[0]["time"]
        assert procs[0].returncode == 0, outputs[0]
    else:  # still stuck on the device: the watchdog ended the process
        assert procs[0].returncode == EXIT_CODE, (procs[0].returncode, outputs[0])
        message = outputs[0]
        assert f"exiting with code {EXIT_CODE}" in message
    assert "RowParallelMLP" in message and "all_reduce" in message, message
    assert f"has not completed {TIMEOUT:g} s after its replay was launched" in message, message
    assert ended - killed < TIMEOUT + 2 * GRACE + MARGIN, (ended - killed, outputs[0])


def test_the_custom_allreduce_gives_up_on_a_killed_peer_and_the_survivor_raises_naming_it(tmp_path):
    procs, outputs, ended, killed, end = _run_pair(tmp_path, "custom")
    assert end and end[0]["outcome"] == "CollectiveTimeoutError", (end, outputs[0])
    assert procs[0].returncode == 0, outputs[0]
    assert f"waited {AR_TIMEOUT:g} s for rank 1 and gave up" in end[0]["message"], end[0]["message"]
    assert end[0]["time"] - killed < AR_TIMEOUT + MARGIN, (end[0]["time"] - killed, outputs[0])
