"""Where parameter gradients go, over the numpy framework of ``nofw.py``: accumulation inside the
graphs (``accumulate_grads``), and backwards in two halves as zero-bubble schedules run them
(an input pass, then a weight pass), captured as three graphs per position."""
import numpy as np
import pytest

import nofw
from nofw import Graphed, Linear, step
from paddle_graphpp.core.errors import GraphScheduleError


# ------------------------------------------------------------ accumulate_grads
def test_accumulate_grads_binds_the_layers_buffers_as_grad(rt):
    lin = Linear(4, 3)
    layer = Graphed(lin, rt, num_warmup_steps=0, accumulate_grads=True)
    step(layer, "f1 b1")  # recorded: eager gradients reach .grad as the graphs will put them there
    eager = [p.grad.numpy() for p in lin.parameters()]
    step(layer, "f1 b1")  # replay: the buffers become .grad, keeping its value (fake replay adds nothing)
    buffers = layer.engine.param_grad_buffers
    assert all(p.grad is b and np.array_equal(b.array, e) for p, b, e in zip(lin.parameters(), buffers, eager))
    writes = layer.engine.process.grad_writes
    step(layer, "f1 b1")  # autograd gets no parameter gradient; .grad stays the buffer
    assert all(p.grad is b for p, b in zip(lin.parameters(), buffers))
    assert layer.engine.process.grad_writes == writes + 1  # .grad changed outside autograd: counted
    lin.zero_grad()
    step(layer, "f1 b1")  # unset .grad: the buffer is zeroed and bound again
    assert all(p.grad is b and not b.array.any() for p, b in zip(lin.parameters(), buffers))
    other = [nofw.Tensor(np.full(p.shape, 3.0, dtype=np.float32)) for p in lin.parameters()]
    for p, t in zip(lin.parameters(), other):
        p.grad = t
    step(layer, "f1 b1")  # a foreign .grad: its value is kept, in the buffer
    assert all(p.grad is b and np.array_equal(b.array, t.array) for p, b, t in zip(lin.parameters(), buffers, other))


def test_accumulate_grads_auto_is_on_where_the_runtime_can_and_off_where_it_cannot(any_rt):
    lin = Linear(4, 3)
    layer = Graphed(lin, any_rt, num_warmup_steps=0)
    for _ in range(3):
        step(layer, "f1 b1")
    (sig,) = layer.engine.signatures().values()
    can = isinstance(any_rt, nofw.NoFrameworkRuntime)
    assert sig.accumulate is can
    assert all((p.grad is b) is can for p, b in zip(lin.parameters(), layer.engine.param_grad_buffers))
    assert all(p.grad is not None for p in lin.parameters())


def test_accumulate_grads_auto_keeps_autograd_accumulation_where_hooks_run(rt):
    lin = Linear(4, 3)
    seen = []
    lin.weight.register_post_accumulate_grad_hook(lambda p: seen.append(1))
    layer = Graphed(lin, rt, num_warmup_steps=0)
    for _ in range(3):
        step(layer, "f1 f2 b1 b2")
    assert layer.engine.replays == 8 and len(seen) == 6  # the hook saw every micro-batch's gradient
    assert lin.weight.grad is not layer.engine.param_grad_buffers[0]
    refused = Graphed(lin, rt, num_warmup_steps=0, accumulate_grads=True)
    with pytest.raises(ValueError, match="test:Linear: accumulate_grads=True .* accumulation hooks"):
        step(refused, "f1 b1")
    assert refused.engine.in_flight == 0


class Tied(nofw.Module):
    """A head that uses another module's weight (as a tied embedding)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return x @ self.weight


def test_a_weight_two_graphed_layers_hold_gets_its_gradient_through_autograd_in_both(rt):
    # Eagerly autograd sums both parts before adding them to .grad (G + (h + e)); graphs adding
    # theirs into .grad would give (G + h) + e. Neither layer accumulates the shared weight.
    lin = Linear(4, 4)
    first = Graphed(lin, rt, num_warmup_steps=0)
    second = Graphed(Tied(lin.weight), rt, num_warmup_steps=0)
    for _ in range(3):
        x = nofw.randn(2, 4, requires_grad=True)
        nofw.backward(second(first(x)).sum())
    (sig_a,), (sig_b,) = first.engine.signatures().values(), second.engine.signatures().values()
    assert not sig_a.accumulate and not sig_b.accumulate
    assert not first.engine.accumulates_in_graphs(lin.weight) and not second.engine.accumulates_in_graphs(lin.weight)
    third = Graphed(Tied(lin.weight), rt, num_warmup_steps=0, accumulate_grads=True)
    with pytest.raises(ValueError, match=r"test:Tied: accumulate_grads=True, but a parameter of this layer \(shape "
                                         r"\(4, 4\)\) also gets gradient from outside it"):
        step(third, "f1 b1", shape=(2, 4))


def test_a_layer_graphed_after_another_began_accumulating_a_weight_they_share_says_so(rt):
    # The first layer's graphs add the weight's gradient into .grad already; the second's part
    # goes through autograd, which sums in eager's order only where the two run in separate
    # backwards (stage modules of one rank): a warning says to graph both before training.
    lin = Linear(4, 4)
    first = Graphed(lin, rt, num_warmup_steps=0)
    step(first, "f1 b1", shape=(2, 4))
    assert first.engine.accumulates_in_graphs(lin.weight)
    second = Graphed(Tied(lin.weight), rt, num_warmup_steps=0)
    with pytest.warns(RuntimeWarning, match=r"test:Tied: shares parameters with test:Linear, whose graphs began "
                                            r"adding their gradients into .grad before this layer was graphed"):
        step(second, "f1 b1", shape=(2, 4))
    (sig_b,) = second.engine.signatures().values()
    assert not sig_b.accumulate and first.engine.accumulates_in_graphs(lin.weight)
    third = Graphed(Tied(lin.weight), rt, num_warmup_steps=0, accumulate_grads=True)
    with pytest.raises(ValueError, match=r"test:Tied: accumulate_grads=True, but a parameter of this layer is "
                                         r"also one of test:Linear's"):
        step(third, "f1 b1", shape=(2, 4))


# ------------------------------------------------------------ split backward
class Block(nofw.Module):
    """Two matmuls, a residual, a second output that depends on a weight only, and a parameter
    the forward never uses."""

    def __init__(self):
        super().__init__()
        self.up = Linear(8, 16)
        self.down = Linear(16, 8)
        self.shift = nofw.Parameter(np.ones(8))
        self.unused = nofw.Parameter(np.ones(3))

    def forward(self, x):
        h = self.down(self.up(x).tanh()) + x
        return h * 2.0 + self.shift, self.shift.square().sum()


def loss_of(outputs):
    h, extra = outputs
    return h.square().sum() + extra


def zb_step(layer, order):
    """Run micro-batches as a zero-bubble stage does: ``f<n>`` forward, ``i<n>`` input pass
    (gradients of the stage input only), ``w<n>`` weight pass, ``b<n>`` full backward (``n`` from 0)."""
    xs = [nofw.randn(4, 8, requires_grad=True) for _ in range(3)]
    losses = {}
    for tok in order.split():
        n = int(tok[1:])
        if tok[0] == "f":
            losses[n] = loss_of(layer(xs[n]))
        elif tok[0] == "i":
            nofw.backward(losses[n], inputs=[xs[n]], retain_graph=True)
        elif tok[0] == "w":
            nofw.weight_pass(losses.pop(n), layer.parameters())
        else:
            nofw.backward(losses.pop(n))
    return xs


ZB_ORDER = "f0 f1 i0 f2 w0 i1 i2 w2 w1"  # several weight passes pending, the last two out of order


def test_split_positions_are_captured_as_three_graphs_and_replayed_in_order(rt):
    layer = Graphed(Block(), rt, num_warmup_steps=1)
    order = "f0 f1 i0 f2 w0 i1 b2 w1"  # positions 0 and 1 split, position 2 full
    zb_step(layer, order)  # warmup
    zb_step(layer, order)  # recorded
    assert layer.engine.captures == 0
    zb_step(layer, order)  # captured at its start, then replayed
    assert layer.engine.position_kinds() == {"full": 1, "split": 2}
    assert layer.engine.graph_count() == 3 + 3 + 2
    assert layer.engine.captures == 8 and layer.engine.replays == 8
    done = layer.engine.positions()
    expected = [done[0].fwd_graph, done[1].fwd_graph, done[0].bwd_graph, done[2].fwd_graph, done[0].weight_graph,
                done[1].bwd_graph, done[2].bwd_graph, done[1].weight_graph]
    assert rt.captured == expected and rt.replayed == expected  # the order the step ran them in
    for _ in range(2):
        zb_step(layer, order)
    assert layer.engine.captures == 8 and layer.engine.replays == 24
    assert rt.replayed[-8:] == expected and layer.engine.in_flight == 0


def test_the_eager_split_gives_the_gradients_of_a_whole_backward(rt):
    plain = Block()
    layer = Graphed(Block(), rt, num_warmup_steps=5)  # stays eager (warmup)
    for p, q in zip(plain.parameters(), layer.parameters()):
        q.array[...] = p.array
    for module, order in ((plain, "f0 f1 f2 b0 b1 b2"), (layer, ZB_ORDER)):
        nofw.manual_seed(3)
        xs = zb_step(module, order)
        module.grads = [x.grad for x in xs] + [p.grad for p in module.parameters()]
    assert layer.engine.in_flight == 0 and layer.engine.captures == 0
    for a, b in zip(plain.grads, layer.grads):
        if a is None:  # the unused parameter
            assert b is None
        else:
            np.testing.assert_allclose(b.array, a.array, rtol=1e-5, atol=1e-6)


def test_a_micro_batch_stays_in_flight_until_its_weight_pass(rt):
    layer = Graphed(Block(), rt, num_warmup_steps=0)
    x = nofw.randn(4, 8, requires_grad=True)
    h, extra = layer(x)
    loss = h.sum() + extra
    nofw.backward(loss, inputs=[x], retain_graph=True)
    assert layer.engine.in_flight == 1 and x.grad is not None  # its input pass ran; its weight pass has not
    assert all(p.grad is None for p in layer.parameters())
    nofw.weight_pass(loss, layer.parameters())
    assert layer.engine.in_flight == 0 and layer.module.up.weight.grad is not None


def test_a_position_captured_whole_refuses_an_input_only_backward(rt):
    layer = Graphed(Block(), rt, num_warmup_steps=1)
    for _ in range(3):
        zb_step(layer, "f0 f1 b0 b1")
    assert layer.engine.position_kinds() == {"full": 2, "split": 0}
    x = nofw.randn(4, 8, requires_grad=True)
    h, extra = layer(x)
    loss = h.sum() + extra
    with pytest.raises(GraphScheduleError, match=r"test:Block: micro-batch position 0 was captured with a full "
                                                 r"backward.*input gradients only.*same schedule every step"):
        nofw.backward(loss, inputs=[x], retain_graph=True)
    # refused before the FIFO was touched: the micro-batch is still in flight, and a full
    # backward, as it was captured, completes it
    assert layer.engine.in_flight == 1
    nofw.backward(loss)
    assert layer.engine.in_flight == 0
    del h, extra, loss
    zb_step(layer, "f0 f1 b0 b1")
    assert layer.engine.in_flight == 0


def test_a_failed_input_half_leaves_nothing_waiting_for_its_weight_half(rt, monkeypatch):
    layer = Graphed(Block(), rt, num_warmup_steps=0)
    x = nofw.randn(4, 8, requires_grad=True)
    h, extra = layer(x)

    def broken(*args, **kwargs):
        raise ValueError("input half failed")

    monkeypatch.setattr(rt, "backward_input", broken)
    with pytest.raises(ValueError, match="input half failed"):
        nofw.backward(h.sum() + extra, inputs=[x], retain_graph=True)
    assert layer.engine.in_flight == 0  # its backward is over: nothing waits for a weight pass
    monkeypatch.undo()
    for _ in range(3):  # the layer and the process's episode clock go on
        zb_step(layer, "f0 i0 f1 w0 i1 w1")
    assert layer.engine.in_flight == 0 and layer.engine.replays > 0


def test_a_position_captured_split_serves_a_full_backward(rt):
    # Both halves replay back to back (the pool's order check guards the rest).
    layer = Graphed(Block(), rt, num_warmup_steps=1)
    for _ in range(3):
        zb_step(layer, "f0 i0 w0")
    before = layer.engine.replays
    zb_step(layer, "f0 b0")
    assert layer.engine.replays == before + 3 and layer.engine.in_flight == 0


def test_per_graph_slots_are_recycled_only_after_the_weight_pass(rt):
    # per_graph reuses a position once its backward is over; a split backward is over at its
    # weight pass, so the second forward (after i0, before w0) needs a slot of its own.
    split = Graphed(Block(), rt, num_warmup_steps=1, memory="per_graph")
    for _ in range(3):
        zb_step(split, "f0 i0 f1 w0 i1 w1")
    assert split.engine.position_kinds() == {"full": 0, "split": 2}
    whole = Graphed(Block(), rt, num_warmup_steps=1, memory="per_graph")
    for _ in range(3):
        zb_step(whole, "f0 b0 f1 b1")
    assert whole.engine.position_kinds() == {"full": 1, "split": 0}
    assert split.engine.in_flight == whole.engine.in_flight == 0


def test_pending_weight_passes_count_against_max_in_flight(rt):
    layer = Graphed(Block(), rt, num_warmup_steps=0, max_in_flight=2)
    xs = [nofw.randn(4, 8, requires_grad=True) for _ in range(3)]
    for x in xs[:2]:
        h, extra = layer(x)
        nofw.backward(h.sum() + extra, inputs=[x], retain_graph=True)
    with pytest.raises(GraphScheduleError, match="2 of them ran the input-gradient half"):
        layer(xs[2])


def test_weight_graphs_accumulate_into_grad_without_a_second_set_of_buffers(rt):
    # accumulate_grads="auto": the weight graph adds into the layer's gradient buffers, which
    # the weight pass leaves as .grad; no weight-gradient buffers of its own exist
    layer = Graphed(Block(), rt, num_warmup_steps=1)
    for _ in range(4):
        layer.zero_grad()
        zb_step(layer, ZB_ORDER)
    engine = layer.engine
    assert engine.position_kinds() == {"full": 0, "split": 3} and engine.replays > 0
    assert engine.weight_grad_buffers is None
    used = [p for p in layer.module.parameters() if p is not layer.module.unused]
    assert all(any(p.grad is b for b in engine.param_grad_buffers) for p in used)
    # accumulate_grads=False: the weight half writes buffers of its own, .grad is autograd's
    plain = Graphed(Block(), rt, num_warmup_steps=1, accumulate_grads=False)
    for _ in range(4):
        plain.zero_grad()
        zb_step(plain, ZB_ORDER)
    own = plain.engine.weight_grad_buffers
    assert own is not None and plain.engine.param_grad_buffers is None
    assert not any(p.grad is b for p in plain.module.parameters() for b in own)


def test_a_weight_pass_of_ones_own_is_refused_before_anything_changes(rt):
    # Per-micro-batch parameter gradients do not exist when the graphs accumulate into .grad:
    # a weight pass other than the one that puts the sums back into .grad is refused, naming
    # the layer and the option; the micro-batch still awaits its weight pass.
    layer = Graphed(Block(), rt, num_warmup_steps=1)
    for _ in range(3):
        zb_step(layer, "f0 i0 w0")
    params = [p for p in layer.module.parameters() if p is not layer.module.unused]
    before = [p.grad.numpy() for p in params]
    x = nofw.randn(4, 8, requires_grad=True)
    h, extra = layer(x)
    loss = h.sum() + extra
    nofw.backward(loss, inputs=[x], retain_graph=True)
    with pytest.raises(GraphScheduleError, match=r"test:Block: adds its parameter gradients into \.grad.*"
                                                 r"nofw\.weight_pass.*accumulate_grads=False"):
        nofw.grad(loss, params, retain_graph=True)
    assert layer.engine.in_flight == 1
    assert all(np.array_equal(p.grad.array, b) for p, b in zip(params, before))
    nofw.weight_pass(loss, layer.parameters())
    assert layer.engine.in_flight == 0
    # accumulate_grads=False: per-micro-batch gradients exist, any weight pass gets them
    plain = Graphed(Block(), rt, num_warmup_steps=1, accumulate_grads=False)
    for _ in range(3):
        zb_step(plain, "f0 i0 w0")
    x = nofw.randn(4, 8, requires_grad=True)
    h, extra = plain(x)
    loss = h.sum() + extra
    nofw.backward(loss, inputs=[x], retain_graph=True)
    got = nofw.grad(loss, [p for p in plain.module.parameters() if p is not plain.module.unused])
    assert all(g is not None for g in got) and plain.engine.in_flight == 0
