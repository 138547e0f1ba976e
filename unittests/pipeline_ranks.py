"""Starts ``unittests/workers/torch_pipeline_worker.py`` on gloo ranks for the pipeline tests."""
import json
import os
import sys

from tools import launch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "workers", "torch_pipeline_worker.py")


def run_pipeline_ranks(args, tmp_path, world=2, timeout=150):
    """The pipeline worker with ``args`` on ``world`` gloo ranks, every one killed at ``timeout``;
    fails the test unless all exit 0. Returns {rank: the rank's JSON result}."""
    envs = launch.rank_envs(world, PYTHONPATH=os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")]))
    ends = launch.run_ranks([[sys.executable, WORKER, "--out", str(tmp_path), *args]] * world, envs=envs,
                            timeout=timeout, merge_stderr=True)
    codes = [None if e.stopped else e.returncode for e in ends]
    text = "".join(e.stdout for e in ends)
    assert codes == [0] * world, f"ranks failed or hung (codes {codes}):\n{text[-6000:]}"
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)}
