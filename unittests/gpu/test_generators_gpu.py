"""Random generators other than the default one inside graphed layers (PyTorch, one GPU).

A capture registers the default CUDA generator, the generators passed as ``generators=``
and the graph-safe states of Megatron-Core's RNG tracker; each replay then draws fresh
numbers from them, exactly as the eager run does. A generator that is not registered makes
the capture fail with a message that says so.

Run on the GPU machine: ``python -m pytest unittests/gpu/test_generators_gpu.py -q``.
Skipped without CUDA; the Megatron part also needs ``megatron-core`` installed.
"""
import contextlib
import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires a CUDA device")

from paddle_graphpp.core.errors import CaptureError  # noqa: E402
from paddle_graphpp.torch import CUDAGraphedModule  # noqa: E402

DEV = "cuda"
ORDER = "f1 f2 f3 b1 f4 b2 b3 b4"  # 1F1B-like: three in flight


class OwnNoise(torch.nn.Module):
    """A linear layer followed by a dropout drawn from a generator the layer was given."""

    def __init__(self, gen: torch.Generator, fork=None):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.gen = gen
        self.fork = fork or contextlib.nullcontext

    def forward(self, x):
        y = self.lin(x)
        with self.fork():
            keep = torch.rand(y.shape, device=y.device, generator=self.gen) > 0.25
        return y * keep / 0.75


def _run(model, xs, order=ORDER):
    """One step in ``order``; returns the outputs and the parameter gradients."""
    outs, pending = {}, {}
    for op in order.split():
        i = int(op[1:]) - 1
        if op[0] == "f":
            pending[i] = model(xs[i])
            outs[i] = pending[i].detach().clone()
        else:
            pending.pop(i).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [outs[i] for i in sorted(outs)], grads


def _inputs(step):
    g = torch.Generator(device=DEV).manual_seed(100 + step)
    return [torch.randn(8, 64, device=DEV, generator=g, requires_grad=True) for _ in range(4)]


def test_unregistered_generator_fails_capture_with_the_fix():
    gen = torch.Generator(device=DEV).manual_seed(1)
    layer = CUDAGraphedModule(OwnNoise(gen).to(DEV), num_warmup_steps=1)
    with pytest.raises(CaptureError) as info:
        for step in range(4):
            _run(layer, _inputs(step))
    msg = str(info.value)
    assert "did not register" in msg and "generators=" in msg
    assert "host synchronisation" not in msg  # not the general hint: the cause is known


def test_registered_generator_replays_like_eager():
    torch.manual_seed(0)
    base = OwnNoise(None).to(DEV)
    eager, graphed = copy.deepcopy(base), copy.deepcopy(base)
    eager.gen = torch.Generator(device=DEV).manual_seed(7)
    graphed.gen = torch.Generator(device=DEV).manual_seed(7)
    layer = CUDAGraphedModule(graphed, num_warmup_steps=1, generators=[graphed.gen])
    firsts = []
    for step in range(6):
        xs = _inputs(step)
        out_e, grad_e = _run(eager, [x.detach().requires_grad_() for x in xs])
        out_g, grad_g = _run(layer, xs)
        for a, b in zip(out_e + grad_e, out_g + grad_g):
            assert torch.equal(a, b), f"step {step}: graphed differs from eager"
        firsts.append(out_g[0])
    # ORDER keeps three in flight: 4 positions, captured once, replayed from the third step
    assert (layer.engine.captures, layer.engine.replays) == (2 * 4, 2 * 4 * (6 - 2))
    assert not torch.equal(firsts[-1], firsts[-2])  # fresh numbers each replay


class SwappingTracker:
    """What Megatron-Core's graph-safe RNG tracker does: its own generator states, swapped into
    the default CUDA generator around the code that draws (``fork``)."""

    def __init__(self, seed):
        default = torch.cuda.default_generators[torch.cuda.current_device()]
        self.state = default.clone_state()
        self.state.manual_seed(seed)

    @contextlib.contextmanager
    def fork(self):
        default = torch.cuda.default_generators[torch.cuda.current_device()]
        outer = default.graphsafe_get_state()
        default.graphsafe_set_state(self.state)
        try:
            yield
        finally:
            self.state = default.graphsafe_get_state()
            default.graphsafe_set_state(outer)


def _eager_and_graphed_agree(new_tracker, graph_kwargs, steps=5):
    """Train an eager and a graphed copy of one model, each with a fresh tracker from
    ``new_tracker()`` (its ``fork`` around the draws); outputs and gradients must be equal."""
    torch.manual_seed(0)
    base = OwnNoise(None).to(DEV)
    runs = []
    for graph in (False, True):
        tracker = new_tracker()
        model = copy.deepcopy(base)
        model.fork = tracker.fork
        if graph:
            model = CUDAGraphedModule(model, num_warmup_steps=1, **graph_kwargs(tracker))
        runs.append([_run(model, _inputs(step)) for step in range(steps)])
        if graph:  # 4 positions, captured once, replayed from the third step
            assert (model.engine.captures, model.engine.replays) == (2 * 4, 2 * 4 * (steps - 2))
    for step, ((out_e, grad_e), (out_g, grad_g)) in enumerate(zip(*runs)):
        for a, b in zip(out_e + grad_e, out_g + grad_g):
            assert torch.equal(a, b), f"step {step}: graphed differs from eager"


def test_tracker_states_registered_through_a_callable():
    _eager_and_graphed_agree(lambda: SwappingTracker(seed=11),
                             lambda tracker: {"generators": lambda: [tracker.state]})


def test_megatron_tracker_found_without_arguments():
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from testing.launch import free_port

    def new_tracker():
        tensor_parallel.model_parallel_cuda_manual_seed(123, use_cudagraphable_rng=True, force_reset_rng=True)
        return tensor_parallel.get_cuda_rng_tracker()

    created_group = not dist.is_initialized()
    created_parallel = not parallel_state.model_parallel_is_initialized()
    try:
        if created_group:
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        if created_parallel:
            parallel_state.initialize_model_parallel(1, 1)
        _eager_and_graphed_agree(new_tracker, lambda tracker: {})  # no generators=: found in Megatron
    finally:  # what this test set up it takes down: a group left open, or the tracker's states left
        # seeded, which every later capture in the suite would register (refusing recompute there)
        tensor_parallel.get_cuda_rng_tracker().reset()
        if created_parallel:
            parallel_state.destroy_model_parallel()
        if created_group and dist.is_initialized():
            dist.destroy_process_group()
