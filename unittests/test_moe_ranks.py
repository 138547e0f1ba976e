"""The capacity mode's checks agree across ranks (two gloo ranks on CPU, data parallel).

A pair dropped on one rank stops the optimizer step on every rank (``"raise"``), or re-runs it on
every rank (``"rerun"``): the replicas stay equal, and a re-run data-parallel training equals
the plain one bit for bit. A rank that never comes to the check makes the other raise within
the process group's timeout. Each case starts its ranks in a new session under a timeout
(testing/launch.py) and kills them afterwards. This file is also the rank worker:
``python test_moe_ranks.py MODE RANK PORT OUT_DIR``.
"""
import os
import sys
import time

import pytest

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))

pytestmark = pytest.mark.slow  # every case starts two ranks

GROUP_TIMEOUT = 6  # seconds: the process group's, which the checks wait for a peer


def _run(mode, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from testing import launch

    return launch.run_worker_ranks(HERE, mode, tmp_path, timeout=120, pythonpath=[REPO, os.path.dirname(HERE)])


@pytest.mark.timeout(200)
def test_a_drop_on_one_rank_re_runs_the_step_on_every_rank_and_training_equals_plain_ddp(tmp_path):
    r0, r1 = _run("rerun", tmp_path)
    for r in (r0, r1):
        assert r["equal_to_plain"], r  # losses and every parameter, bit for bit
        assert r["reruns"] == r["steps"] == 3, r
    assert r0["dropped_here"] == 0 < r1["dropped_here"]  # rank 0 drops nothing, and re-runs all the same
    assert r0["rerun_dropped"] == r1["rerun_dropped"] > 0  # the pairs dropped on every rank
    assert r0["digest"] == r1["digest"]  # the replicas stay equal


@pytest.mark.timeout(200)
def test_a_rank_without_experts_joins_the_checks_and_re_runs_with_its_peers(tmp_path):
    # rank 0 trains a dense model (a pipeline stage without experts), rank 1 a Qwen3-MoE that drops
    r0, r1 = _run("dense", tmp_path)
    for r in (r0, r1):
        assert r["equal_to_plain"], r  # each trains as its model does without the capacity mode, bit for bit
        assert r["reruns"] == r["steps"] == 3, r
    assert r0["rerun_dropped"] == r1["rerun_dropped"] > 0
    assert "LlamaForCausalLM is in capacity mode with on_overflow='rerun' (no experts" in r0["checked"], r0


@pytest.mark.timeout(200)
def test_a_drop_on_one_rank_stops_the_step_on_every_rank(tmp_path):
    r0, r1 = _run("raise", tmp_path)
    assert r0["outcome"] == r1["outcome"] == "CapacityOverflow"
    assert "none on this rank; on rank(s) [1]" in r0["message"], r0
    assert "and on rank(s)" not in r1["message"] and "this step was not taken" in r1["message"], r1
    assert all("Raise capacity_factor" in r["message"] and "cannot re-run" not in r["message"] for r in (r0, r1))
    assert r0["unchanged"] and r1["unchanged"]
    assert r0["trained_after"] and r1["trained_after"]  # the next step, without drops, is taken on both
    for rank, r in enumerate((r0, r1)):
        assert f"checks would agree over [{rank}], and another model's in this process over every rank" \
            in r["other_group"], r
        assert f"this rank ({rank}) is not in group [{1 - rank}]" in r["not_in_group"], r
        assert r["whole_group_accepted"]  # a group of every rank is the default's ranks, not another group


@pytest.mark.timeout(200)
def test_a_step_one_rank_cannot_re_run_is_stopped_on_every_rank(tmp_path):
    # rank 0 checks with on_overflow="raise", rank 1 (which drops) with "rerun": re-running on rank 1
    # alone would leave the replicas apart, so both raise
    r0, r1 = _run("mixed", tmp_path)
    assert r0["outcome"] == r1["outcome"] == "CapacityOverflow", (r0, r1)
    assert "none on this rank; on rank(s) [1]" in r0["message"], r0
    assert "Rank(s) [0] of the group cannot re-run this step" in r1["message"], r1
    assert r0["unchanged"] and r1["unchanged"]
    assert r1["reruns"] == 0


@pytest.mark.timeout(200)
def test_a_rank_that_never_checks_makes_the_other_raise_within_the_timeout(tmp_path):
    r0, r1 = _run("late", tmp_path)
    assert r0["outcome"] == "trained"  # its mode drops without checking
    assert r1["outcome"] == "RuntimeError", r1
    assert "rank(s) [0] of [0, 1] did not come within" in r1["message"], r1
    assert r1["seconds"] < GROUP_TIMEOUT + 10, r1


# ------------------------------------------------------------------------- the worker
def _worker(mode, rank, port, out):
    import copy
    import datetime
    import warnings

    import torch
    import torch.distributed as dist

    from testing import launch, zoo
    from paddle_graphpp.torch import CapacityOverflow, capacity_experts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT))
    base = zoo.build("qwen3_moe", experts_implementation="eager")
    experts, top_k = base.config.num_experts, base.config.num_experts_per_tok
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own batches
    data = [[torch.randint(0, base.config.vocab_size, (2, 16), generator=gen) for _ in range(2)] for _ in range(3)]
    # rank 0's capacity holds every pair; rank 1's a quarter of an even share
    factor = experts / top_k if rank == 0 else 0.25
    result = {"outcome": "trained"}

    def params(model):
        return [p.detach().clone() for p in model.parameters()]

    if mode == "rerun":
        plain = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        expected = zoo.train_steps(plain, data)
        model = copy.deepcopy(base)
        mode_ = capacity_experts(model, factor, on_overflow="rerun")
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        dropped_here = zoo.note_own_drops(mode_)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got = zoo.train_steps(wrapped, data, mode_.step)
        same = all(torch.equal(a, b) for a, b in zip(expected[0] + expected[1], got[0] + got[1]))
        digest = float(sum(p.double().sum() for p in model.parameters()))
        result.update(equal_to_plain=same, reruns=mode_.reruns, steps=len(data), rerun_dropped=mode_.rerun_dropped,
                      dropped_here=sum(dropped_here), digest=digest)
    elif mode == "dense":
        from paddle_graphpp.torch.moe import checked_experts

        model = zoo.build("llama") if rank == 0 else copy.deepcopy(base)
        data = [[torch.randint(0, model.config.vocab_size, (2, 16), generator=gen) for _ in range(2)]
                for _ in range(3)]
        expected = zoo.train_steps(copy.deepcopy(model), data)
        mode_ = capacity_experts(model, factor, on_overflow="rerun")
        result["checked"] = checked_experts()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got = zoo.train_steps(model, data, mode_.step)
        same = all(torch.equal(a, b) for a, b in zip(expected[0] + expected[1], got[0] + got[1]))
        result.update(equal_to_plain=same, reruns=mode_.reruns, steps=len(data), rerun_dropped=mode_.rerun_dropped)
    elif mode == "raise":
        model = copy.deepcopy(base)
        capacity_experts(model, factor, on_overflow="raise")
        before = params(model)
        try:
            zoo.train_steps(model, data[:1])
        except CapacityOverflow as exc:
            result.update(outcome="CapacityOverflow", message=str(exc))
        result["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, params(model)))
        with torch.no_grad():  # calls without grad are not counted: the next step drops nothing
            model(data[1][0])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.step()  # no gradients, no drops: the check passes on both ranks, and the step runs
        result["trained_after"] = True
        alone = [dist.new_group([0]), dist.new_group([1])]  # every rank creates every group
        try:  # a second checked model agreeing over other ranks than the first
            capacity_experts(copy.deepcopy(base), factor, group=alone[rank])
        except ValueError as exc:
            result["other_group"] = str(exc)
        try:
            capacity_experts(copy.deepcopy(base), factor, group=alone[1 - rank])
        except ValueError as exc:
            result["not_in_group"] = str(exc)
        capacity_experts(copy.deepcopy(base), factor, group=dist.new_group([0, 1])).undo()
        result["whole_group_accepted"] = True
    elif mode == "mixed":
        model = copy.deepcopy(base)
        mode_ = capacity_experts(model, factor, on_overflow="raise" if rank == 0 else "rerun")
        before = params(model)
        try:
            zoo.train_steps(model, data[:1], mode_.step)
        except CapacityOverflow as exc:
            result.update(outcome="CapacityOverflow", message=str(exc))
        result["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, params(model)))
        result["reruns"] = mode_.reruns
    elif mode == "late":
        model = copy.deepcopy(base)
        capacity_experts(model, factor, on_overflow="drop" if rank == 0 else "raise")
        start = time.monotonic()
        try:
            zoo.train_steps(model, data[:1])
        except RuntimeError as exc:
            result.update(outcome=type(exc).__name__, message=str(exc))
        result["seconds"] = time.monotonic() - start
    launch.finish_worker_rank(result, rank, out)


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
