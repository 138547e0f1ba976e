"""Paddle: a graphed layer under fleet's zero-bubble weight store (DualPipeV's backwards).

Fleet's DualPipeV enables ``WeightGradStore`` around the backwards it runs zero-bubble; then the
``SplitBWLinear`` layers queue their weight products and a later weight pass runs them. A graphed
layer runs its input half in the backward and queues its weight half into the store. Here, on
CPU: the eager split gives the plain layer's gradients bit for bit, whatever the mix of zero-bubble
and ordinary backwards (an unused parameter keeps no gradient; hooks see what they see eagerly);
the fake graph runtime shows split positions captured as three graphs and replayed, with no
weight closure of fleet run and fleet's store untouched inside any capture; weight closures the
layer cannot own are refused during a capture.
"""
import copy
import os
import re
import warnings

import pytest

paddle = pytest.importorskip("paddle")
zb = pytest.importorskip("paddle.distributed.fleet.meta_parallel.zero_bubble_utils")

from paddle_graphpp import CUDAGraphedLayer  # noqa: E402
from paddle_graphpp.paddle import split_backward  # noqa: E402
from fake_paddle_runtime import FakeGraphedLayer, FakePaddleRuntime  # noqa: E402

Store = zb.WeightGradStore


@pytest.fixture(autouse=True)
def _clean_store():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA graphs are not used.*")
        Store.clear()
        Store.enabled = False
        yield
        Store.clear()
        Store.enabled = False


class Block(paddle.nn.Layer):
    """Two deferring linears (fleet's SplitBWLinear), a norm, a plain linear (its weight
    gradient is computed in the backward, not deferred) and a residual."""

    def __init__(self, outside=None):
        super().__init__()
        self.norm = paddle.nn.LayerNorm(8)
        self.up = zb.SplitBWLinear(8, 16)
        self.down = zb.SplitBWLinear(16, 8)
        self.plain = paddle.nn.Linear(8, 8)
        self.spare = self.create_parameter([3])  # never used: its gradient must stay unset
        self.__dict__["outside"] = outside  # a layer this block calls but does not own

    def forward(self, x):
        h = self.down(paddle.nn.functional.relu(self.up(self.norm(x))))
        if self.outside is not None:
            h = self.outside(h)
        return self.plain(h) + x


def dualpipe_like_step(model, xs, zero_bubble):
    """Forwards, then each backward with the store on where ``zero_bubble[i]`` (flushed as
    DualPipeV does), then the store's weight passes, oldest first."""
    outs = [model(x) for x in xs]
    for out, zb_on in zip(outs, zero_bubble):
        Store.enabled = zb_on
        out.square().mean().backward()
        Store.enabled = False
        if zb_on:
            Store.flush()
    while not Store.funcs_queue.empty():
        Store.pop()


def grads(layer):
    return {n: (None if p.grad is None else p.grad.numpy().copy()) for n, p in layer.named_parameters()}


@pytest.mark.parametrize("zero_bubble", [(False, True, True, True), (True, True, True, True),
                                         (False, False, False, False)],
                         ids=["plain-then-zb", "all-zb", "no-zb"])
def test_eager_split_gives_the_plain_layers_gradients(zero_bubble):
    paddle.seed(0)
    plain = Block()
    graphed = CUDAGraphedLayer(copy.deepcopy(plain), num_warmup_steps=1)
    for step in range(4):  # warmup, recorded, then (on CPU) eager again
        xs = [paddle.randn([4, 8]) for _ in zero_bubble]
        dualpipe_like_step(plain, [x.clone() for x in xs], zero_bubble)
        dualpipe_like_step(graphed, [x.clone() for x in xs], zero_bubble)
        want, got = grads(plain), grads(graphed.layer)
        for name in want:
            assert (want[name] is None) == (got[name] is None), f"step {step}: {name}"
            assert want[name] is None or (want[name] == got[name]).all(), f"step {step}: {name}"
        assert graphed.engine.in_flight == 0
        assert not Store.cache and Store.funcs_queue.empty()


def test_a_full_backward_keeps_split_linears_off_the_store():
    # With the store off, the SplitBWLinear closures inside a graphed layer's backward come back
    # to the layer as gradients (handed to autograd, which sets .grad); none reaches the store.
    paddle.seed(1)
    block = Block()
    graphed = CUDAGraphedLayer(block, num_warmup_steps=0)
    x = paddle.randn([4, 8])
    x.stop_gradient = False
    graphed(x).sum().backward()
    assert not Store.cache and Store.funcs_queue.empty()
    assert block.up.weight.grad is not None and block.down.weight.grad is not None


def test_parameter_hooks_see_during_the_backward_what_they_see_eagerly():
    # fleet's gradient hooks (sequence-parallel all-reduce, fused communication buffers) fire
    # when a parameter's gradient is accumulated: the input half hands the gradients nothing
    # defers to autograd at once, so such a hook sees the norm's gradient of this backward.
    paddle.seed(3)
    plain = Block()
    graphed = CUDAGraphedLayer(copy.deepcopy(plain), num_warmup_steps=0)
    seen = {"plain": [], "graphed": []}
    for key, block in (("plain", plain), ("graphed", graphed.layer)):
        for param in (block.norm.weight, block.plain.weight):
            param._register_backward_hook(
                lambda p=param, key=key: seen[key].append(None if p.grad is None else float(p.grad.sum())))
    xs = [paddle.randn([4, 8]) for _ in range(3)]
    dualpipe_like_step(plain, [x.clone() for x in xs], (True, True, True))
    dualpipe_like_step(graphed, [x.clone() for x in xs], (True, True, True))
    assert len(seen["plain"]) == 6 and None not in seen["plain"]
    assert seen["graphed"] == seen["plain"]


def test_split_positions_are_captured_as_three_graphs_and_replayed_in_the_stores_order():
    rt = FakePaddleRuntime()
    layer = FakeGraphedLayer(Block(), rt, num_warmup_steps=1)
    order = (False, True, True)  # position 0 full, positions 1 and 2 split
    for _ in range(2):  # warmup, recorded
        dualpipe_like_step(layer, [paddle.randn([4, 8]) for _ in order], order)
    assert layer.engine.captures == 0
    dualpipe_like_step(layer, [paddle.randn([4, 8]) for _ in order], order)  # captured, replayed
    assert layer.engine.position_kinds() == {"full": 1, "split": 2}
    assert layer.engine.graph_count() == 2 + 3 + 3
    assert layer.engine.captures == 8 and layer.engine.replays == 8
    for _ in range(2):
        dualpipe_like_step(layer, [paddle.randn([4, 8]) for _ in order], order)
    assert layer.engine.captures == 8 and layer.engine.replays == 24
    assert layer.engine.in_flight == 0 and Store.funcs_queue.empty()


def test_a_micro_batch_stays_in_flight_until_the_store_runs_its_weight_half():
    layer = CUDAGraphedLayer(Block(), num_warmup_steps=0)
    out = layer(paddle.randn([4, 8]))
    Store.enabled = True
    out.sum().backward()
    Store.enabled = False
    Store.flush()
    assert layer.engine.in_flight == 1
    before = layer.layer.up.weight.grad
    Store.pop()
    assert layer.engine.in_flight == 0
    assert before is None and layer.layer.up.weight.grad is not None


def test_a_weight_the_layer_does_not_own_is_left_to_the_store_eagerly_and_refused_in_a_capture():
    # (without a bias: paddle.grad w.r.t. the block's own tensors treats a bias it is not asked
    # for as frozen, and SplitBWMatmul then fails returning its gradient; fleet's limit, not ours)
    paddle.seed(2)
    outside = zb.SplitBWLinear(8, 8, bias_attr=False)
    reference_outside = copy.deepcopy(outside)
    plain = Block(reference_outside)
    graphed = CUDAGraphedLayer(Block(outside), num_warmup_steps=0)
    graphed.layer.set_state_dict(plain.state_dict())
    xs = [paddle.randn([4, 8]) for _ in range(2)]
    dualpipe_like_step(plain, [x.clone() for x in xs], (True, True))
    dualpipe_like_step(graphed, [x.clone() for x in xs], (True, True))
    assert (outside.weight.grad.numpy() == reference_outside.weight.grad.numpy()).all()

    rt = FakePaddleRuntime()
    faked = FakeGraphedLayer(Block(zb.SplitBWLinear(8, 8, bias_attr=False)), rt, num_warmup_steps=0)
    dualpipe_like_step(faked, [paddle.randn([4, 8])], (True,))  # recorded (eager)
    with pytest.raises(split_backward.ForeignWeightError) as raised:
        dualpipe_like_step(faked, [paddle.randn([4, 8])], (True,))
    assert re.search(r"^FakeGraphedLayer\(Block\): raised while capturing the backward \(input half\): 1 "
                     r"weight-gradient closure.*not parameters of this graphed run.*mark_not_capturable",
                     str(raised.value), re.S)
    assert faked.engine.in_flight == 0 and faked.engine.captures == 1  # the forward; nothing left behind


def test_weight_half_adds_into_main_grad_where_fleet_keeps_one():
    p = paddle.create_parameter([2, 3], dtype="float32")
    q = paddle.create_parameter([2], dtype="float32")
    p.main_grad = None
    g = paddle.ones([2, 3])
    split_backward.accumulate([p, q], [g, paddle.full([2], 2.0)])
    split_backward.accumulate([p, q], [g, paddle.full([2], 2.0)])
    assert p.grad is None and (p.main_grad.numpy() == 2).all() and p.main_grad.dtype == paddle.float32
    assert (q.grad.numpy() == 4).all()


# ------------------------------------------------------------ fleet's DualPipeV on CPU ranks
def run_dualpipev(args, tmp_path):
    from workers.fleet_ranks import launch_workers

    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "paddle_dualpipev_worker.py")
    rc, seconds, logs, results = launch_workers(worker, 2, args, tmp_path, timeout=150)
    assert rc == 0, f"launch ended with {rc} after {seconds:.0f}s:\n{logs[-4000:]}"
    assert sorted(results) == [0, 1]
    return results


@pytest.mark.timeout(400)
@pytest.mark.parametrize("micro_batches", [4, 8])
def test_dualpipev_graphed_trains_exactly_like_dualpipev_eager(micro_batches, tmp_path):
    results = run_dualpipev(["--micro-batches", str(micro_batches), "--steps", "4"], tmp_path)
    for rank, data in results.items():
        eager, graphed = data["eager"], data["graphed"]
        assert eager["class"] == graphed["class"] == "DualPipeVParallel"
        assert len(eager["losses"]) == 4 and eager["losses"][-1] < eager["losses"][0], eager["losses"]
        assert graphed["losses"] == eager["losses"], f"rank {rank}"
        assert graphed["grads"] == eager["grads"], f"rank {rank}: gradients before an optimizer step differ"
        assert graphed["weights"] == eager["weights"], f"rank {rank}"
        assert graphed["graphed_layers"] == 2 and graphed["in_flight"] == 0  # one run per chunk
        # the zero-bubble backwards ran split: the store ran graphed runs' weight halves
        assert data["weight_halves_run"] > 0, f"rank {rank}: no weight half ran"


@pytest.mark.timeout(400)
def test_dualpipev_captures_and_replays_every_graphed_runs_positions(tmp_path):
    # Fake runtime: capture and replay are bookkeeping only (values after a replay are stale).
    results = run_dualpipev(["--micro-batches", "4", "--steps", "5", "--runtime", "fake"], tmp_path)
    split = 0
    for rank, data in results.items():
        for run in data["graphed"]["graphed_runs"]:
            assert run["captures"] > 0 and run["replays"] > 0 and run["in_flight"] == 0, (rank, run)
            kinds = run["positions"]
            assert kinds["full"] + kinds["split"] == 4, (rank, run)  # one position per micro-batch
            assert run["graphs"] == 2 * kinds["full"] + 3 * kinds["split"], (rank, run)
            split += kinds["split"]
    assert split > 0  # the backwards DualPipeV runs zero-bubble were captured as input and weight halves
