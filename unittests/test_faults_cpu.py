"""Checkpoint and resume, and loss-scaler overflow steps, with graphed layers and
GraphedOptimizer on CPU (both run eagerly there; their state dicts, loaders and FIFO
bookkeeping are the ones the GPU uses). The GPU versions are in unittests/gpu/test_faults_gpu.py.
"""
import warnings

import pytest
import torch

from unittests import fault_checks


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA graphs are not used.*")
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
        yield


def _same(a, b):
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_resumed_run_equals_uninterrupted_run(dropout):
    got = fault_checks.resume_losses("cpu", dropout=dropout)
    assert got["resumed"] == got["straight"][4:]
    assert got["rolled_back"] == got["straight"][4:]
    _same(got["final"], got["final_resumed"])
    _same(got["final"], got["final_rolled_back"])
    assert len(set(got["straight"])) == len(got["straight"])  # the losses do move: the check is not vacuous


def test_overflow_step_is_skipped_as_eager_skips_it():
    ref = fault_checks.scaled_losses("cpu", graphed=False)
    got = fault_checks.scaled_losses("cpu", graphed=True)
    assert got["losses"][2] == float("inf")
    assert got["scales"] == ref["scales"]
    assert got["scales"][2] == got["scales"][1] / 2  # the overflow halves the scale
    _same(got["params"][1], got["params"][2])  # ... and leaves the parameters as they were
    for a, b in zip(ref["params"], got["params"]):
        _same(a, b)
    assert got["losses"][:2] + got["losses"][3:] == ref["losses"][:2] + ref["losses"][3:]
