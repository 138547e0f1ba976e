"""A whole step's bookkeeping through the one lifecycle (``core.lifecycle``), with a fake runtime
registered as "torch": which calls warm up, capture and replay, the ``max_signatures`` rule, and
how a failed capture is reported. The fake "captures" by running the step eagerly and replays
nothing, so this proves the bookkeeping only; unittests/gpu/test_whole_gpu.py proves capture.
"""

import warnings

import pytest
import torch

from paddle_graphpp import CaptureError, CaptureFallbackWarning
from paddle_graphpp.core.records import Phase
from paddle_graphpp.torch import graph_step


@pytest.fixture
def fake(capturing_torch):
    return capturing_torch


def _step(fake, host_read=False):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ran = []

    def train_step(x):
        ran.append("capture" if fake.capturing else "eager")
        if host_read and fake.capturing:
            raise RuntimeError("operation not permitted when stream is capturing (a .item() here)")
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach()
    return train_step, opt, ran


def test_warmup_then_one_capture_then_replays(fake):
    fn, opt, ran = _step(fake)
    step = graph_step(fn, 2, optimizers=opt)
    for _ in range(6):
        step(torch.ones(3, 4))
    assert ran == ["eager", "eager", "capture"]  # the later calls replay: the function does not run
    assert (step.captures, step.replays) == (1, 4)  # the capturing call replays once, as every later call
    assert step.lifecycle.phase() is Phase.READY and step.eager_reason(torch.ones(3, 4)) is None


def test_a_signature_past_max_signatures_runs_eagerly_with_one_warning(fake):
    fn, opt, ran = _step(fake)
    step = graph_step(fn, 1, optimizers=opt, max_signatures=1)
    step(torch.ones(3, 4))
    with pytest.warns(RuntimeWarning, match="max_signatures"):
        step(torch.ones(5, 4))
    step(torch.ones(5, 4))
    assert "max_signatures" in step.eager_reason(torch.ones(5, 4))
    assert step.captures == 0 and len(step.lifecycle.all()) == 1


def test_a_failed_capture_raises_once_and_the_signature_then_runs_eagerly(fake):
    fn, opt, ran = _step(fake, host_read=True)
    step = graph_step(fn, 1, optimizers=opt)
    step(torch.ones(3, 4))
    with pytest.raises(CaptureError, match=r"capturing the step failed.*item\(\).*runs eagerly from now on"):
        step(torch.ones(3, 4))
    for _ in range(3):
        step(torch.ones(3, 4))
    assert ran == ["eager", "capture", "eager", "eager", "eager"]
    assert step.captures == 0 and step.lifecycle.phase() is Phase.EAGER
    assert "capturing the step failed" in step.eager_reason(torch.ones(3, 4))


def test_fallback_eager_warns_once_with_its_own_category_and_trains_on(fake):
    fn, opt, ran = _step(fake, host_read=True)
    step = graph_step(fn, 1, optimizers=opt, fallback="eager")
    step(torch.ones(3, 4))
    with pytest.warns(CaptureFallbackWarning, match="runs eagerly from now on"):
        loss = step(torch.ones(3, 4))
    assert loss.dim() == 0 and ran == ["eager", "capture", "eager"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        step(torch.ones(3, 4))
    assert step.captures == 0 and step.lifecycle.eager_reason is not None
