"""cuBLAS workspaces and graph pools on a real GPU (PyTorch runtime).

Torch keeps a cuBLAS workspace per (handle, stream); a capture's stream would get its own in
the graph pool and keep it there. Captures into a shared pool free them before and after
(``paddle_graphpp.torch.graphs.free_blas_workspaces``): the pool keeps none between replays,
its graphs still train as eager does with several micro-batches in flight, a failed capture
leaves none behind, and an optimizer step whose matmuls make a workspace while it borrows the
pool still borrows it. A pool of one graph (``memory="per_graph"``) keeps the workspace its
capture made, which every later capture uses, and the frees stop; so they do with
``FLAGS_graphpp_free_blas_workspaces=0``. (The bookkeeping alone: unittests/test_blas_workspace_frees.py.)

Run on the GPU machine: ``python -m pytest unittests/gpu/test_blas_workspace_gpu.py -q``.
"""
import warnings
import weakref

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires a CUDA device")

from testing.parity import rel, side_by_side, twins  # noqa: E402

DEV = "cuda"
ORDER = "f1 f2 b1 f3 b2 f4 b3 b4"  # two micro-batches in flight: two positions share the pool


@pytest.fixture(autouse=True)
def _fp32_exact(fp32_exact):  # unittests/gpu/conftest.py
    yield


@pytest.fixture
def lending_on(monkeypatch):
    """Pool lending and the workspace frees as in a fresh process (an earlier test may have
    stopped either in this one)."""
    from paddle_graphpp.core.process import current_process
    from paddle_graphpp.torch.memory import pool_lending
    from paddle_graphpp.torch.runtime import RUNTIME

    watch = current_process().section("torch").part(pool_lending.OptimizerWatch)
    monkeypatch.setattr(watch, "registered", weakref.WeakSet())
    if RUNTIME._lender is not None:
        monkeypatch.setattr(RUNTIME._lender, "disabled", False)
    monkeypatch.delenv("FLAGS_graphpp_free_blas_workspaces", raising=False)
    monkeypatch.setattr(RUNTIME, "_frees_blas", None)
    torch._C._cuda_clearCublasWorkspaces()  # none left from earlier tests' graphs: each test makes its own
    return RUNTIME


def _pool_blocks() -> set:
    """(address, size) of every block allocated in a graph pool (not the default pool)."""
    return {(b["address"], b["size"]) for seg in torch.cuda.memory_snapshot()
            if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
            for b in seg["blocks"] if b["state"] == "active_allocated"}


def _freed_by_clearing_workspaces() -> set:
    """The graph pools' blocks that clearing torch's cuBLAS workspaces frees: workspaces kept there."""
    torch.cuda.synchronize()
    before = _pool_blocks()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.synchronize()
    return before - _pool_blocks()


class _MatmulMomentum(torch.optim.Optimizer):
    """Momentum whose matrices' updates go through a matmul (as orthogonalising optimizers'
    do): its step runs cuBLAS on whatever stream it is given."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                m = state["m"].mul_(0.9).add_(p.grad)
                update = m @ torch.eye(m.shape[1], device=m.device) if m.dim() == 2 else m
                p.add_(update, alpha=-group["lr"])


def _train(eager, graphed, opt_e, opt_g, steps=5):
    """``steps`` steps of ORDER on both; the worst relative error of losses, outputs, input and
    parameter gradients, and of the weights after the last step."""
    worst = 0.0
    for _, errs in side_by_side(eager, graphed, steps=steps, order=ORDER, seed=3000, device=DEV):
        worst = max(worst, *errs)
        for opt in (opt_e, opt_g):
            opt.step()
            opt.zero_grad(set_to_none=True)
    return max([worst] + [rel(q, p) for p, q in zip(eager.parameters(), graphed.module.parameters())])


def test_the_pool_keeps_no_cublas_workspace_and_training_equals_eager(lending_on):
    eager, graphed, opt_e, opt_g = twins(device=DEV, num_warmup_steps=1)
    assert _train(eager, graphed, opt_e, opt_g) <= 1e-6
    assert graphed.engine.captures > 0 and graphed.engine.replays > 0
    freed = _freed_by_clearing_workspaces()
    assert not freed, (f"clearing torch's cuBLAS workspaces freed {sum(n for _, n in freed) / 2**20:.1f} MiB of the "
                       f"graph pools: a capture stream's workspace was kept there")


def test_a_failed_capture_leaves_no_workspace_in_its_pool(lending_on):
    class SyncsAfterAMatmul(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, x):
            y = self.lin(x)  # the capture's workspace is made here
            if torch.cuda.is_current_stream_capturing():
                y = y * float(y.sum())  # a host read: the capture fails
            return y

    from paddle_graphpp.torch import CUDAGraphedModule

    graphed = CUDAGraphedModule(SyncsAfterAMatmul().to(DEV), num_warmup_steps=0, fallback="eager")
    x = torch.randn(8, 64, device=DEV, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            graphed(x).sum().backward()
    assert not _freed_by_clearing_workspaces()


def test_per_graph_pools_keep_the_workspaces_all_their_graphs_use(lending_on):
    """``memory="per_graph"``: a pool per graph. Freed after every capture, each of those pools
    would hold a workspace's worth of its own; instead the first captures' stay (one per
    capturing thread), every later capture uses them, as torch has them do, and nothing frees
    them from then on."""
    eager, graphed, opt_e, opt_g = twins(device=DEV, num_warmup_steps=1, memory="per_graph")
    assert _train(eager, graphed, opt_e, opt_g) <= 1e-6
    captures = graphed.engine.captures
    assert captures >= 4
    assert lending_on._frees_blas is False
    freed = _freed_by_clearing_workspaces()  # kept, and not a set per pool (cuBLASLt's small one may add a block)
    assert 1 <= len(freed) < captures, (captures, sorted(freed))


def test_with_the_flag_off_torch_keeps_its_workspaces(lending_on, monkeypatch):
    monkeypatch.setenv("FLAGS_graphpp_free_blas_workspaces", "0")
    eager, graphed, opt_e, opt_g = twins(device=DEV, num_warmup_steps=1)
    assert _train(eager, graphed, opt_e, opt_g) <= 1e-6
    assert _freed_by_clearing_workspaces()  # the capture stream's, kept in the pool as torch keeps them


def test_an_optimizer_step_with_matmuls_still_borrows_the_pool(lending_on):
    """Its first borrowed step makes the capture stream's workspace inside the pool; the step
    gives it back rather than counting as a leak (which would drop the graphs and stop lending)."""
    eager, graphed, _, _ = twins(device=DEV, num_warmup_steps=1)
    opt_e, opt_g = _MatmulMomentum(eager.parameters()), _MatmulMomentum(graphed.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = lending_on._lender.steps if lending_on._lender is not None else 0
        assert _train(eager, graphed, opt_e, opt_g, steps=6) <= 1e-6
    leaks = [str(w.message) for w in caught if "left" in str(w.message) and "graph pool" in str(w.message)]
    assert not leaks, leaks
    assert lending_on._lender is not None and not lending_on._lender.disabled
    assert lending_on._lender.steps > before, lending_on.lending_report()
    captures = graphed.engine.captures
    _train(eager, graphed, opt_e, opt_g, steps=2)
    assert graphed.engine.captures == captures  # nothing captured anew
