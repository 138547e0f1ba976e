"""Fleet pipeline workers on CPU ranks: the worker's half and the test's half.

A worker (``paddle_pipeline_worker.py``, ``paddleformers_worker.py``) calls :func:`init_fleet`,
trains (:func:`train_on_random_tokens`, :func:`count_calls`), and ends with :func:`finish`,
which writes ``rank<N>.json`` into ``--out``. A test calls
:func:`launch_workers`, which runs the worker under ``python -m paddle.distributed.launch`` in
its own session under a time limit (``testing/launch.py``) and reads the results back.

Paddle's own gloo setup inside ``fleet.init`` often fails on a 2-core machine ("connection
refused"; about 6 of 10 launches with 4 ranks, measured). It fails before any code under test
runs, so such launches are retried: a worker prints :data:`FLEET_READY` once ``fleet.init``
returned, and a launch in which not every rank printed it (within :data:`INIT_DEADLINE_S`, or
before it failed) is tried again, :data:`INIT_ATTEMPTS` times at most.
"""

import glob
import json
import os
import sys

FLEET_READY = "paddle_graphpp-worker: fleet.init done"
INIT_DEADLINE_S = 45  # fleet.init takes ~5 s per rank here; past this it is stuck in gloo
INIT_ATTEMPTS = 12
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------------- worker side
def init_fleet(pp: int, micro_batches: int, micro_batch_size: int, *, dualpipev: bool = False) -> int:
    """``fleet.init`` for a pure pipeline of ``pp`` stages (DualPipeV's with ``dualpipev``);
    returns this rank."""
    import paddle
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": pp,
                               **({"pp_configs": {"use_dualpipev": True}} if dualpipev else {})}
    strategy.pipeline_configs = {"accumulate_steps": micro_batches, "micro_batch_size": micro_batch_size}
    fleet.init(is_collective=True, strategy=strategy)
    rank = paddle.distributed.get_rank()
    print(FLEET_READY, flush=True)  # tells the test that gloo's own group setup succeeded
    # fleet.init is not a barrier: a rank that finished it may fail (a bad configuration) and
    # exit while a slower rank still connects its groups, which then sees "connection refused".
    paddle.distributed.barrier()
    return rank


def count_calls(layers) -> dict:
    """``{index: calls}`` of ``layers``, counted by a forward pre-hook on each."""
    calls = {}
    for idx, layer in enumerate(layers):
        calls[idx] = 0

        def count(_layer, _inputs, key=idx):
            calls[key] += 1

        layer.register_forward_pre_hook(count)
    return calls


def train_on_random_tokens(model, args, vocab: int, seq: int, *, die_rank: int = -1, before_step=None,
                           labels_as_tuple: bool = False):
    """Train ``fleet.distributed_model(model)`` with AdamW(1e-2) for ``args.steps`` steps of
    ``args.micro_batches * args.micro_batch_size`` random token sequences of length ``seq``
    (seeded by ``args.seed``); returns the distributed model and the per-step losses. Rank
    ``die_rank`` exits abruptly (code 3) in the first step instead. ``before_step()`` is called
    before each optimizer step (the gradients of the step are in place then). With
    ``labels_as_tuple`` the labels go in as a one-tensor tuple (a loss that reads ``labels[0]``)."""
    import numpy as np
    import paddle
    from paddle.distributed import fleet

    opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(opt)
    if before_step is not None:
        step = opt.step

        def step_after_the_hook(*a, **k):
            before_step()
            return step(*a, **k)

        opt.step = step_after_the_hook
    data = np.random.RandomState(args.seed)
    batch = args.micro_batches * args.micro_batch_size
    losses = []
    for _ in range(args.steps):
        tokens = data.randint(0, vocab, (batch, seq + 1)).astype("int64")
        x, y = paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])
        if die_rank == paddle.distributed.get_rank():
            os._exit(3)
        loss = model.train_batch([x, (y,) if labels_as_tuple else y], opt)
        losses.append(float(np.asarray(loss.numpy()).reshape(-1)[0]))
    return model, losses


def finish(out: str, rank: int, result: dict) -> None:
    """Write ``result`` to ``<out>/rank<rank>.json`` and exit without interpreter teardown."""
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    # Skip interpreter teardown of gloo groups: a peer that already left must not stall us.
    os._exit(0)


# --------------------------------------------------------------------------- test side
def worker_logs(log_dir: str) -> str:
    """The launcher's per-rank logs, without glog's info and warning lines."""
    text = []
    for path in sorted(glob.glob(os.path.join(log_dir, "workerlog.*"))):
        with open(path, errors="replace") as f:
            lines = [ln for ln in f.read().splitlines() if not ln.startswith(("I1", "W1"))]
        text.append(f"== {os.path.basename(path)}\n" + "\n".join(lines))
    return "\n".join(text)


def _launch_once(worker, nproc, args, out, timeout):
    from testing import launch

    log_dir = os.path.join(out, "log")
    os.makedirs(log_dir, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
           "--log_dir", log_dir, worker, "--out", out, *args]

    def stuck_in_fleet_init(elapsed):  # give up on this attempt early
        return elapsed > INIT_DEADLINE_S and worker_logs(log_dir).count(FLEET_READY) < nproc

    # the launcher and every rank share the new session's process group
    end = launch.run(cmd, cwd=out, env=env, timeout=timeout, merge_stderr=True, abandon=stuck_in_fleet_init)
    with open(os.path.join(out, "launch.txt"), "w") as sink:
        sink.write(end.stdout)
    return None if end.stopped else end.returncode, end.seconds, worker_logs(log_dir)


def launch_workers(worker: str, nproc: int, args: list, tmp_path, timeout: float):
    """Run ``worker`` on ``nproc`` ranks, retrying launches that failed inside ``fleet.init``.

    Returns ``(rc, seconds, logs, results)``: the launcher's exit code (``None`` when it was
    stopped at ``timeout``), its seconds, the ranks' logs, and the results by rank.
    """
    for attempt in range(INIT_ATTEMPTS):
        out = str(tmp_path / f"run{attempt}")
        os.makedirs(out)
        rc, seconds, logs = _launch_once(worker, nproc, args, out, timeout)
        results = {}
        for path in glob.glob(os.path.join(out, "rank*.json")):
            with open(path) as f:
                data = json.load(f)
            results[data["rank"]] = data
        if rc == 0 or logs.count(FLEET_READY) >= nproc:
            break  # not a failure inside fleet.init's own gloo setup: no retry
    return rc, seconds, logs, results
