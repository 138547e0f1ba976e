"""Starts ``unittests/workers/torch_pipeline_worker.py`` on gloo ranks (or, with ``--device cuda``,
one GPU per rank over NCCL) for the pipeline tests, and compares its graphed run with its eager one."""
import json
import os
import sys

from testing import launch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "workers", "torch_pipeline_worker.py")


def run_pipeline_ranks(args, tmp_path, world=2, timeout=150):
    """The pipeline worker with ``args`` on ``world`` gloo ranks, every one killed at ``timeout``;
    fails the test unless all exit 0. A run whose rendezvous port was taken between the pick and
    the bind (another job on the machine) runs once more on a new port.
    Returns {rank: the rank's JSON result}."""
    for _ in range(2):
        envs = launch.rank_envs(world, PYTHONPATH=os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")]))
        ends = launch.run_ranks([[sys.executable, WORKER, "--out", str(tmp_path), *args]] * world, envs=envs,
                                timeout=timeout, merge_stderr=True)
        codes = [None if e.stopped else e.returncode for e in ends]
        text = "".join(e.stdout for e in ends)
        if codes == [0] * world or launch.PORT_TAKEN not in text:
            break
    assert codes == [0] * world, f"ranks failed or hung (codes {codes}):\n{text[-6000:]}"
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)}


def graphed_against_eager(results):
    """From the worker's results: the per-step losses of the rank holding the last stage, eager
    and graphed (float64 tensors), and the worst relative error of any parameter gradient of any
    step, graphed against eager, as ``(error, rank, step, name)``."""
    import torch

    from testing.parity import rel

    last = [data for data in results.values() if data["eager"]["losses"]]
    assert len(last) == 1, "exactly one rank holds the last stage"
    eager, graphed = (torch.tensor(last[0][run]["losses"], dtype=torch.float64) for run in ("eager", "graphed"))
    worst = (0.0, None, None, None)
    for rank, data in results.items():
        for step, (want, got) in enumerate(zip(data["eager"]["grads"], data["graphed"]["grads"])):
            for name, w in want.items():
                if w is None and got[name] is None:
                    continue  # a parameter neither run gave a gradient
                err = rel(torch.tensor(got[name], dtype=torch.float64), torch.tensor(w, dtype=torch.float64))
                worst = max(worst, (err, rank, step, name), key=lambda t: t[0])
    return eager, graphed, worst



def assert_captured_once_and_replayed(runs, spans, micro_batches=4, dropped=False):
    """Exact counts of the worker's ``graphed_runs`` (by rank). ``spans``: the steps run under each
    signature, in order (``[steps]``, or ``[shorten_at, steps - shorten_at]``). Each position's
    graphs (forward and backward; forward, input and weight passes when split) are captured once
    per signature and replayed in every step from its third (warmup, record, capture). A run with
    one position per signature (the last stage of 1F1B) makes each micro-batch an episode: its
    first three micro-batches of a signature run before the first replay. With ``dropped``, a
    capture another layer's failure ended in the same episode is dropped and taken again a step
    later; its position's (forward, backward) pair runs eagerly once more, two replays fewer.
    Nothing is left in flight. A run that quietly went eager fails here."""
    for rank, rs in runs.items():
        for run in rs:
            kinds = run["positions"]
            graphs = 2 * kinds["full"] + 3 * kinds["split"]
            if (kinds["full"] + kinds["split"]) == len(spans) and micro_batches > 1:
                per_graph = sum(micro_batches * s - 3 for s in spans)
            else:
                per_graph = sum(s - 2 for s in spans)
            again = run["captures"] - graphs if dropped else 0
            want = (graphs + again, graphs, graphs // len(spans) * per_graph - 2 * again, 0)
            got = (run["captures"], run["graphs"], run["replays"], run["in_flight"])
            assert graphs > 0 and got == want, (rank, run, want)
            if len(spans) > 1:
                assert run["graphs_before_shorten"] == graphs // len(spans), (rank, run)
