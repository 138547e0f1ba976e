"""Engine bookkeeping over the PyTorch runtime with fake graphs: warmup, capture, replay, what
goes through torch (leaves, .grad, storages, generators, autocast, eval mode), errors.

These tests check which path each call takes. The engine's scheduling alone (capture order,
episodes, signatures, generations, options, deferral) is tested without any framework in
unittests/core/. Whether capture and replay compute the right numbers is checked on a GPU
(unittests/gpu/test_engine_gpu.py).
"""
import gc
import weakref

import pytest
import torch

from fake_runtime import FakeGraphRuntime, Graphed
from paddle_graphpp.core import memory as memory_mod
from paddle_graphpp.core.engine import EngineOptions, Phase
from paddle_graphpp.core.errors import CaptureError, StateReplacedError
from paddle_graphpp.core.process import current_process
from paddle_graphpp.torch.memory import handout as handout_mod


def step(layer, order, shape=(2, 4)):
    """Run an order like 'f1 f2 b1 b2'; returns the call kinds in order of forwards."""
    outs = {}
    for tok in order.split():
        n = int(tok[1:])
        if tok[0] == "f":
            x = torch.randn(*shape, requires_grad=True)
            outs[n] = layer(x)
        else:
            outs[n].sum().backward()
    return outs


INTERLEAVED = "f1 f2 f3 b1 f4 b2 b3 b4"


def test_warmup_then_record_then_capture_in_order_then_replay(rt):
    layer = Graphed(torch.nn.Linear(4, 3), rt, num_warmup_steps=3)
    step(layer, INTERLEAVED)  # warmup: 3 calls, but recording waits for the episode to end
    assert layer.engine.phase() is Phase.WARMUP
    step(layer, INTERLEAVED)  # recorded: eager, nothing captured yet
    assert layer.engine.phase() is Phase.RECORD and layer.engine.captures == 0
    step(layer, INTERLEAVED)  # captured at its start (one pair per position), then replayed
    assert layer.engine.phase() is Phase.READY
    assert layer.engine.captures == 8 and layer.engine.graph_count() == 8
    assert layer.engine.replays == 8
    for _ in range(2):
        step(layer, INTERLEAVED)
    assert layer.engine.replays == 3 * 8 and layer.engine.captures == 8
    assert layer.engine.in_flight == 0
    plan = memory_mod.plan_for(rt)
    assert len(plan._generations) == 1 and plan.graphs_captured == 8


def test_recorded_step_results_come_from_the_eager_run(rt):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    layer = Graphed(lin, rt, num_warmup_steps=0)
    x = torch.randn(2, 4, requires_grad=True)
    y = layer(x)
    assert layer.engine.phase() is Phase.RECORD
    torch.testing.assert_close(y, lin(x), rtol=0, atol=0)
    y.sum().backward()
    ref = x.detach().clone().requires_grad_(True)
    lin.zero_grad()
    lin(ref).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=0, atol=0)
    assert layer.engine.captures == 0


def test_replay_hands_off_copies_to_leaves_without_grad_and_accumulates_in_place(rt):
    lin = torch.nn.Linear(4, 3)
    layer = Graphed(lin, rt, num_warmup_steps=0, accumulate_grads=False)
    step(layer, "f1 b1")  # recorded
    lin.zero_grad(set_to_none=True)
    step(layer, "f1 b1")  # captured, replayed: grads are copies, not the static buffers
    buffers = layer.engine.param_grad_buffers
    assert all(p.grad.data_ptr() != b.data_ptr() for p, b in zip(lin.parameters(), buffers))
    before = [p.grad.data_ptr() for p in lin.parameters()]
    step(layer, "f1 b1")  # accumulation into the existing grads, in place
    assert [p.grad.data_ptr() for p in lin.parameters()] == before


class SyncsInCapture(torch.nn.Module):
    """Stands in for a host sync: fails only while the (fake) stream captures."""

    error = RuntimeError("operation not permitted when stream is capturing")

    def __init__(self, runtime):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.runtime = runtime

    def forward(self, x):
        if self.runtime.is_capturing():
            raise type(self.error)(*self.error.args)
        return self.lin(x)


def test_capture_failure_names_layer_releases_memory_and_training_goes_on(rt):
    layer = Graphed(SyncsInCapture(rt), rt, num_warmup_steps=0)
    step(layer, "f1 b1")  # recorded (eager: the sync only fails under capture)
    released = rt.released
    with pytest.raises(CaptureError, match=r"test:SyncsInCapture.*capturing the forward failed.*not permitted") as err:
        layer(torch.randn(2, 4, requires_grad=True))
    assert isinstance(err.value.__cause__, RuntimeError)
    assert rt.released >= released + 2  # before the capture, and after the failure
    assert layer.engine.in_flight == 0 and layer.engine.graph_count() == 0
    assert layer.engine.phase() is Phase.WARMUP  # it warms up again
    step(layer, "f1 b1")  # training goes on (recorded again)


def test_a_failed_captures_buffers_are_freed_while_its_error_is_held(rt, monkeypatch):
    made = []
    allocate = rt.static_buffers

    def tracked(specs):
        buffers = allocate(specs)
        made.extend(weakref.ref(b) for b in buffers)
        return buffers

    monkeypatch.setattr(rt, "static_buffers", tracked)
    layer = Graphed(SyncsInCapture(rt), rt, num_warmup_steps=0)
    step(layer, "f1 b1")
    with pytest.raises(CaptureError) as err:
        layer(torch.randn(2, 4, requires_grad=True))
    gc.collect()
    assert made and all(ref() is None for ref in made)  # err (and its traceback) still held
    assert "SyncsInCapture" in str(err.value)


class RaisesInCapture(SyncsInCapture):
    """User code that raises a ValueError only while the (fake) stream captures."""

    error = ValueError("bad value")


def test_an_error_of_the_layers_own_code_during_capture_keeps_its_type(rt):
    layer = Graphed(RaisesInCapture(rt), rt, num_warmup_steps=0, fallback="eager")
    step(layer, "f1 b1")
    with pytest.raises(ValueError, match=r"test:RaisesInCapture: raised while capturing the forward: bad value") as err:
        layer(torch.randn(2, 4, requires_grad=True))
    assert not isinstance(err.value, CaptureError) and isinstance(err.value.__cause__, ValueError)
    assert layer.engine.in_flight == 0


def test_capture_failure_with_eager_fallback_keeps_training(rt):
    torch.manual_seed(0)
    mod = SyncsInCapture(rt)
    layer = Graphed(mod, rt, num_warmup_steps=0, fallback="eager")
    step(layer, "f1 b1")  # recorded
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="runs eagerly from now on"):
        y = layer(x)
    torch.testing.assert_close(y, mod.lin(x), rtol=0, atol=0)
    y.sum().backward()
    for _ in range(2):
        layer(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert layer.engine.replays == 0 and layer.engine.captures == 0
    assert all(p.grad is not None for p in mod.parameters())


def test_a_forward_without_backward_is_not_captured(rt):
    layer = Graphed(torch.nn.Linear(4, 3), rt, num_warmup_steps=0)
    outs = step(layer, "f1 f2 b1")  # position 1 never gets its backward in this episode
    del outs
    layer.engine.queue._pending.clear()  # as if that step had been abandoned
    layer.engine.process.clock.in_flight = 0
    step(layer, "f1 f2 b1 b2")  # position 0 captured; position 1 runs eagerly and is recorded
    assert layer.engine.graph_count() == 2


def _positions(layer):
    return next(iter(layer.engine.signatures().values())).positions


@pytest.mark.parametrize("memory", ["shared", "shared_reuse"])
def test_static_buffers_are_shared_by_lifetime(rt, memory):
    layer = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0, memory=memory)
    step(layer, "f1 f2 b1 f3 b2 b3")  # recorded
    step(layer, "f1 f2 b1 f3 b2 b3")  # captured, replayed
    pairs = _positions(layer)
    # position 2 is recorded after position 0's backward: it takes over one of position 0's
    # buffers of the same shape (its static input or its incoming-gradient buffer)
    released = [pairs[0].static_inputs[0], pairs[0].static_grad_outputs[0]]
    assert any(pairs[2].static_inputs[0] is b for b in released)
    # position 1 overlaps position 0 in time: its input buffer is its own
    assert not any(pairs[1].static_inputs[0] is b for b in released)
    # while a position is in flight, no other position's copy writes its input buffer:
    # inputs of positions in flight together differ, and a backward's incoming-gradient
    # buffer is no input of a position in flight when it runs
    assert pairs[0].static_inputs[0] is not pairs[1].static_inputs[0]
    assert pairs[1].static_inputs[0] is not pairs[2].static_inputs[0]
    assert pairs[0].static_grad_outputs[0] is not pairs[1].static_inputs[0]  # b1 runs while f2 is in flight
    assert pairs[1].static_grad_outputs[0] is not pairs[2].static_inputs[0]  # b2 runs while f3 is in flight
    # three positions, at most two in flight: three buffers in all (two inputs and one
    # gradient buffer in flight at once), carved from one block
    buffers = {id(b) for p in pairs.values() for b in p.static_inputs + p.static_grad_outputs}
    assert len(buffers) == 3
    blocks = {b.untyped_storage().data_ptr() for p in pairs.values() for b in p.static_inputs}
    assert len(blocks) == 1


def test_static_buffers_are_allocated_at_capture_not_while_recording(rt):
    layer = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    made = []
    real = rt.static_buffers
    rt.static_buffers = lambda specs: made.append(len(specs)) or real(specs)
    step(layer, "f1 f2 b1 b2")  # recorded: slots only
    assert made == [] and layer.engine.captures == 0
    step(layer, "f1 f2 b1 b2")  # captured: one call for the whole recording
    assert made == [3]  # two inputs in flight together, one incoming-gradient buffer


def test_per_graph_positions_keep_their_own_buffers(rt):
    layer = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0, memory="per_graph")
    step(layer, "f1 b1 f2 b2")
    step(layer, "f1 b1 f2 b2")
    (only,) = _positions(layer).values()  # per_graph recycles slot 0
    assert only.static_inputs[0] is not only.static_grad_outputs[0]


def test_no_grad_calls_bypass_the_fifo(rt):
    layer = Graphed(torch.nn.Linear(4, 3), rt, num_warmup_steps=0)
    with torch.no_grad():
        for _ in range(100):
            layer(torch.randn(2, 4))
    assert layer.engine.in_flight == 0 and layer.engine.captures == 0


def test_per_graph_mode_recycles_one_pair_per_in_flight_slot(rt):
    layer = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0, memory="per_graph")
    order = "f1 f2 f3 b1 f4 b2 b3 b4"  # at most 3 in flight
    step(layer, order)  # recorded
    step(layer, order)  # captured, replayed
    assert layer.engine.graph_count() == 6  # 3 slots, not 4 positions
    assert layer.engine.replays == 8


def test_shared_mode_has_one_pair_per_position(rt):
    layer = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    step(layer, "f1 f2 f3 b1 f4 b2 b3 b4")
    step(layer, "f1 f2 f3 b1 f4 b2 b3 b4")
    assert layer.engine.graph_count() == 8


def test_eager_cache_of_the_recorded_step_is_released_before_capture(rt):
    layer = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=1)
    step(layer, "f1 f2 b1 b2")  # warmup
    step(layer, "f1 f2 b1 b2")  # recorded
    assert rt.released == 0
    for _ in range(3):
        step(layer, "f1 f2 b1 b2")  # released once, before the capture at the first
    assert rt.released == 1


class AsyncAllocatorRuntime(FakeGraphRuntime):
    """The fake runtime, as if the stream-ordered allocator (cudaMallocAsync) were active."""

    def async_allocator_active(self):
        return True


def test_stream_ordered_allocator_runs_the_capture_instead_of_an_eager_run():
    rt = AsyncAllocatorRuntime()
    current_process().reset(rt.name)
    try:
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 3)
        layer = Graphed(lin, rt, num_warmup_steps=0)
        x = torch.randn(2, 4, requires_grad=True)
        y = layer(x)  # capture, then the capture's launch gives the result
        assert layer.engine.captures == 1 and layer.engine.replays == 1
        assert y.shape == (2, 3)  # values come from the launch: checked on the GPU, not here
        y.sum().backward()
        assert layer.engine.captures == 2 and layer.engine.replays == 2
        assert x.grad is not None and all(p.grad is not None for p in lin.parameters())
        step(layer, "f1 b1")
        assert layer.engine.captures == 2 and layer.engine.replays == 4
        assert memory_mod.plan_for(rt)._generations == []  # pools are the driver's: no generations
    finally:
        current_process().reset(rt.name)


def test_eval_mode_is_part_of_the_signature(rt):
    """A graph captured in training mode (dropout on) is never replayed in eval mode."""
    layer = Graphed(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)), rt, num_warmup_steps=0)
    for _ in range(3):
        step(layer, "f1 b1")
    replays = layer.engine.replays
    layer.module.eval()
    step(layer, "f1 b1")  # a new signature: captured anew, not a replay of the training graph
    assert layer.engine.replays == replays and len(layer.engine.signatures()) == 2


def test_autocast_is_part_of_the_signature(rt):
    layer = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    step(layer, "f1 b1")
    key_plain = next(iter(layer.engine.signatures()))
    rt_key = rt.mode_key
    rt.mode_key = lambda: ("autocast", "bfloat16")  # as torch reports it inside autocast
    try:
        step(layer, "f1 b1")
    finally:
        rt.mode_key = rt_key
    assert len(layer.engine.signatures()) == 2 and key_plain in layer.engine.signatures()


def test_accumulate_grads_binds_the_layers_buffers_as_grad(rt):
    lin = torch.nn.Linear(4, 3)
    layer = Graphed(lin, rt, num_warmup_steps=0, accumulate_grads=True)
    step(layer, "f1 b1")  # recorded: eager gradients reach .grad through autograd
    eager = [p.grad.clone() for p in lin.parameters()]
    step(layer, "f1 b1")  # replay: the buffers become .grad, keeping its value (fake replay adds nothing)
    buffers = layer.engine.param_grad_buffers
    assert all(p.grad is b and torch.equal(b, e) for p, b, e in zip(lin.parameters(), buffers, eager))
    step(layer, "f1 b1")  # autograd gets no parameter gradient; .grad stays the buffer
    assert all(p.grad is b for p, b in zip(lin.parameters(), buffers))
    lin.zero_grad(set_to_none=True)
    step(layer, "f1 b1")  # unset .grad: the buffer is zeroed and bound again
    assert all(p.grad is b and not b.any() for p, b in zip(lin.parameters(), buffers))
    other = [torch.full_like(p, 3.0) for p in lin.parameters()]
    for p, t in zip(lin.parameters(), other):
        p.grad = t
    step(layer, "f1 b1")  # a foreign .grad: its value is kept, in the buffer
    assert all(p.grad is b and torch.equal(b, t) for p, b, t in zip(lin.parameters(), buffers, other))


def test_accumulate_grads_auto_is_on_by_default(rt):
    lin = torch.nn.Linear(4, 3)
    layer = Graphed(lin, rt, num_warmup_steps=0)
    for _ in range(3):
        step(layer, "f1 b1")
    assert all(p.grad is b for p, b in zip(lin.parameters(), layer.engine.param_grad_buffers))


def test_accumulate_grads_auto_keeps_autograd_accumulation_where_hooks_run(rt):
    lin = torch.nn.Linear(4, 3)
    seen = []
    lin.weight.register_post_accumulate_grad_hook(lambda p: seen.append(1))
    layer = Graphed(lin, rt, num_warmup_steps=0)
    for _ in range(3):
        step(layer, "f1 f2 b1 b2")
    assert layer.engine.replays == 8 and len(seen) == 6  # the hook saw every micro-batch's gradient
    assert lin.weight.grad is not layer.engine.param_grad_buffers[0]


def test_accumulate_grads_true_refuses_parameters_with_accumulation_hooks(rt):
    lin = torch.nn.Linear(4, 3)
    lin.weight.register_post_accumulate_grad_hook(lambda p: None)
    layer = Graphed(lin, rt, num_warmup_steps=0, accumulate_grads=True)
    with pytest.raises(ValueError, match="test:Linear: accumulate_grads=True .* accumulation hooks"):
        step(layer, "f1 b1")
    assert layer.engine.in_flight == 0


class Tied(torch.nn.Module):
    """A head that uses another module's weight (as a tied embedding)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return x @ self.weight


def test_a_weight_two_graphed_layers_hold_gets_its_gradient_through_autograd_in_both(rt):
    # Eagerly autograd sums both parts before adding them to .grad (G + (h + e)); graphs adding
    # theirs into .grad would give (G + h) + e. Neither layer accumulates the shared weight.
    lin = torch.nn.Linear(4, 4)
    first = Graphed(lin, rt, num_warmup_steps=0)
    second = Graphed(Tied(lin.weight), rt, num_warmup_steps=0)
    for _ in range(3):
        x = torch.randn(2, 4, requires_grad=True)
        second(first(x)).sum().backward()
    (sig_a,), (sig_b,) = first.engine.signatures().values(), second.engine.signatures().values()
    assert not sig_a.accumulate and not sig_b.accumulate
    assert not first.engine.accumulates_in_graphs(lin.weight) and not second.engine.accumulates_in_graphs(lin.weight)
    third = Graphed(Tied(lin.weight), rt, num_warmup_steps=0, accumulate_grads=True)
    with pytest.raises(ValueError, match=r"test:Tied: accumulate_grads=True, but a parameter of this layer \(shape "
                                         r"\(4, 4\)\) also gets gradient from outside it"):
        step(third, "f1 b1", shape=(2, 4))


def test_a_layers_signatures_all_accumulate_or_none_as_sharing_changes(rt):
    # A layer's signatures share its gradient buffers: one accumulating into .grad and one handing
    # the same buffer to autograd would overwrite .grad and then add it to itself. A weight-sharing
    # layer made after the first signature is fixed leaves the layer as it is (with a warning) ...
    lin = torch.nn.Linear(4, 4)
    first = Graphed(lin, rt, num_warmup_steps=0)
    step(first, "f1 b1", shape=(2, 4))
    second = Graphed(Tied(lin.weight), rt, num_warmup_steps=0)
    with pytest.warns(RuntimeWarning, match=r"test:Linear: a parameter of this layer \(shape \(4, 4\)\) is held by "
                                            r"another graphed layer made after this layer's graphs began adding"):
        step(first, "f1 b1", shape=(3, 4))  # a second signature
    assert [v.accumulate for v in first.engine.signatures().values()] == [True, True]
    # ... and one that began handing its gradients out goes on doing so once the other is gone
    third_lin = torch.nn.Linear(4, 4)
    third = Graphed(third_lin, rt, num_warmup_steps=0)
    fourth = Graphed(Tied(third_lin.weight), rt, num_warmup_steps=0)
    step(third, "f1 b1", shape=(2, 4))
    fourth.engine.retire("test")
    step(third, "f1 b1", shape=(3, 4))
    assert [v.accumulate for v in third.engine.signatures().values()] == [False, False]


def test_accumulate_grads_needs_a_runtime_that_supports_it(rt, monkeypatch):
    import dataclasses

    from paddle_graphpp.core import runtime as runtime_mod

    without = dataclasses.replace(runtime_mod.capabilities(rt), accumulation=None)
    monkeypatch.setitem(runtime_mod.runtime_table().capabilities, rt, without)
    with pytest.raises(ValueError, match="accumulate_grads=True is not supported"):
        Graphed(torch.nn.Linear(4, 3), rt, accumulate_grads=True)
    with pytest.raises(ValueError, match="accumulate_grads must be a bool"):
        Graphed(torch.nn.Linear(4, 3), FakeGraphRuntime(), accumulate_grads="yes")


# ------------------------------------------------------------------ generators
def test_generators_are_passed_to_every_capture(rt):
    gens = [object(), object()]
    layer = Graphed(torch.nn.Linear(4, 3), rt, num_warmup_steps=1, generators=gens)
    for _ in range(3):
        step(layer, INTERLEAVED)
    assert layer.engine.captures == 8
    assert rt.generators_registered == [tuple(gens)] * 8


def test_generators_callable_is_read_at_each_capture(rt):
    reads = []

    def current():
        reads.append(1)
        return [f"state-{len(reads)}"]

    layer = Graphed(torch.nn.Linear(4, 3), rt, num_warmup_steps=1, generators=current)
    for _ in range(3):
        step(layer, INTERLEAVED)
    assert [g for (g,) in rt.generators_registered] == [f"state-{i}" for i in range(1, 9)]


def test_generators_option_rejects_other_types():
    with pytest.raises(ValueError, match="generators must be a list or tuple"):
        EngineOptions(generators=torch.Generator()).validate("test:layer")


class DrawsFromUnregistered(torch.nn.Module):
    """Fails in capture the way torch does when a generator was not registered."""

    def __init__(self, runtime):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.runtime = runtime

    def forward(self, x):
        if self.runtime.capturing:
            raise RuntimeError("Attempt to increase offset for a CUDA generator not in capture mode.")
        return self.lin(x)


def test_unregistered_generator_failure_names_the_fix(rt):
    layer = Graphed(DrawsFromUnregistered(rt), rt, num_warmup_steps=1)
    with pytest.raises(CaptureError) as info:
        for _ in range(3):
            step(layer, INTERLEAVED)
    msg = str(info.value)
    assert "test:DrawsFromUnregistered" in msg and "did not register" in msg and "generators=[...]" in msg
    assert "host synchronisation" not in msg


def _copied_pairs(rt):
    """Wrap the runtime's copy so that it counts the pairs it really copies."""
    copied = []
    real = rt.copy_many

    def counting(dsts, srcs):
        if dsts:  # (calls with nothing to copy are not counted)
            copied.append(sum(d.data_ptr() != s.data_ptr() for d, s in zip(dsts, srcs)))
        return real(dsts, srcs)

    rt.copy_many = counting
    return copied


def test_chained_layers_read_the_previous_graphs_outputs_without_copies(rt):
    a = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    b = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    x = torch.randn(2, 4, requires_grad=True)
    b(a(x)).sum().backward()  # recorded: b's input is a's output, a's incoming gradient b's input gradient
    made = []
    real = rt.static_buffers
    rt.static_buffers = lambda specs: made.append(len(specs)) or real(specs)
    copied = _copied_pairs(rt)
    b(a(x)).sum().backward()  # captured, replayed
    pa, pb = _positions(a)[0], _positions(b)[0]
    # b's graph reads a's static output; a's backward graph reads b's static input gradient
    assert pb.static_inputs[0].data_ptr() == pa.static_outputs[0].data_ptr()
    assert pa.static_grad_outputs[0].data_ptr() == pb.static_grad_inputs[0].data_ptr()
    assert made == [2]  # buffers only for x and for the loss's gradient into b
    b(a(x)).sum().backward()
    # per step: a's forward copies x, b's backward the loss gradient; b's forward and a's
    # backward copy nothing
    assert copied[-4:] == [1, 0, 1, 0]
    assert a.engine.replays == 4 and b.engine.replays == 4


def test_a_chained_layer_given_another_tensor_runs_eagerly_and_writes_no_graph_memory(rt):
    a = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    b = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    x = torch.randn(2, 4, requires_grad=True)
    b(a(x)).sum().backward()  # recorded
    b(a(x)).sum().backward()  # captured, replayed
    pa = _positions(a)[0]
    # the fake runtime's replays compute nothing: a's static output holds whatever the buffer
    # held (uninitialised memory, NaN at times), so give it known values to watch
    pa.static_outputs[0].fill_(7.0)
    kept = pa.static_outputs[0].clone()
    replays = b.engine.replays
    with pytest.warns(RuntimeWarning, match="test:Linear: input 0 is not the tensor the previous graphed layer"):
        h = a(x) * 2  # not a's output: copying it into b's static input would overwrite a's
        y = b(h)
    y.sum().backward()
    assert b.engine.replays == replays  # b ran eagerly, forward and backward
    assert torch.equal(pa.static_outputs[0], kept)
    assert torch.equal(y, b.module(h))  # (the fake runtime's replays leave a's values stale)
    b(a(x)).sum().backward()  # the captured data flow again: replayed
    assert b.engine.replays == replays + 2


def test_a_layer_after_one_whose_capture_failed_is_captured_and_replays(rt):
    a = Graphed(SyncsInCapture(rt), rt, num_warmup_steps=0)
    b = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    x = torch.randn(2, 4, requires_grad=True)
    b(a(x)).sum().backward()  # recorded: b reads a's output
    with pytest.raises(CaptureError, match="test:SyncsInCapture"):
        b(a(x)).sum().backward()
    # b was captured with an input buffer of its own (a's output was never captured) and
    # replays; a warms up again and fails each time it is captured
    for _ in range(3):
        try:
            y = b(a(x))
        except CaptureError:
            continue
        y.sum().backward()
    assert b.engine.replays > 0 and a.engine.replays == 0
    pb = _positions(b)[0]
    assert pb.static_inputs[0] is not None


def megatron_style_hooks(module, main_grad=torch.zeros_like):
    """Megatron-Core's DDP on ``module``: a ``main_grad`` per parameter and a hook on each
    gradient accumulator node that adds ``.grad`` into it and drops ``.grad``. Returns the list of
    what each hook call found in ``.grad`` (was it all zeros) and the nodes (kept alive, as
    Megatron keeps them)."""
    seen, accs = [], []
    for p in module.parameters():
        p.main_grad = main_grad(p)
        p.grad_added_to_main_grad = False  # as Megatron's DDP marks every parameter it hooks
        acc = p.expand_as(p).grad_fn.next_functions[0][0]

        def hook(*_, p=p):
            seen.append(bool((p.grad == 0).all()))
            p.main_grad.add_(p.grad.view_as(p.main_grad))
            p.grad = None

        acc.register_hook(hook)
        accs.append(acc)
    return seen, accs


def test_graphs_add_into_megatron_style_main_grad_and_hand_the_hooks_zeros(rt):
    """Where Megatron-Core's DDP hooks a parameter's accumulation and adds into its main_grad,
    the graphs add there themselves (no gradient buffers of their own) and hand autograd zeros,
    so the hook still runs for every micro-batch (bucket readiness) and adds nothing."""
    lin = torch.nn.Linear(4, 4)
    seen, accs = megatron_style_hooks(lin)
    layer = Graphed(lin, rt, num_warmup_steps=1)
    for _ in range(4):
        step(layer, "f1 f2 b1 b2")
    sig = next(iter(layer.engine.signatures().values()))
    assert sig.accumulate is True and layer.engine.buffers.hooked
    assert all(b is p.main_grad for p, b in zip(lin.parameters(), layer.engine.param_grad_buffers))
    assert layer.engine.replays == 8  # forwards and backwards of the last two steps
    assert len(seen) == 2 * 8  # two parameters, every micro-batch of the four steps
    assert seen[:8] == [False] * 8  # warmup and the recorded step: eager gradients
    assert seen[8:] == [True] * 8  # replays: zeros, the graphs added the gradient themselves
    assert all(p.grad is None for p in lin.parameters())


def test_accumulate_grads_auto_steps_aside_for_hooks_without_a_buffer_of_the_parameters_shape(rt):
    """A hooked parameter whose main_grad is not one the graphs could add into (flattened):
    every micro-batch's gradient goes through autograd to the hook, as before."""
    lin = torch.nn.Linear(4, 4)
    seen, accs = megatron_style_hooks(lin, main_grad=lambda p: torch.zeros(p.numel()))
    layer = Graphed(lin, rt, num_warmup_steps=1)
    for _ in range(4):
        step(layer, "f1 f2 b1 b2")
    sig = next(iter(layer.engine.signatures().values()))
    assert sig.accumulate is False and not layer.engine.buffers.hooked
    assert layer.engine.replays == 8 and len(seen) == 2 * 8 and not any(seen[:8])  # replays: stale values here


def test_a_main_grad_without_megatrons_mark_goes_through_autograd(rt):
    """A ``main_grad`` that Megatron-Core's DDP did not set up (no ``grad_added_to_main_grad`` on
    the parameter: some other code's buffer, whose hooks may not add into it): the graphs do not
    add there, and every gradient reaches the hooks through autograd."""
    lin = torch.nn.Linear(4, 4)
    seen, accs = megatron_style_hooks(lin)
    for p in lin.parameters():
        del p.grad_added_to_main_grad
    layer = Graphed(lin, rt, num_warmup_steps=1)
    for _ in range(3):
        step(layer, "f1 b1")
    assert layer.engine.replays == 2 and not layer.engine.buffers.hooked


def test_fused_weight_gradient_accumulation_is_refused_at_build():
    from paddle_graphpp.torch import CUDAGraphedModule, graph_layers

    block = torch.nn.Sequential(torch.nn.Linear(4, 4))
    block[0].gradient_accumulation_fusion = True  # as Megatron-Core's linear layers carry their config's
    with pytest.raises(TypeError, match=r"0 has gradient_accumulation_fusion=True.*Turn gradient_accumulation_fusion off"):
        CUDAGraphedModule(block)
    with pytest.raises(TypeError, match="gradient_accumulation_fusion=True"):
        graph_layers([block])


def test_a_main_grad_replaced_after_capture_is_refused_naming_reset_graphs(rt):
    lin = torch.nn.Linear(4, 4)
    _, accs = megatron_style_hooks(lin)
    layer = Graphed(lin, rt, num_warmup_steps=1)
    for _ in range(3):
        step(layer, "f1 b1")
    assert layer.engine.replays == 2  # the third step's forward and backward
    lin.weight.main_grad = torch.zeros_like(lin.weight)  # a rebuilt data-parallel wrapper
    out = layer(torch.randn(2, 4, requires_grad=True))
    with pytest.raises(StateReplacedError, match="main_grad.*reset_graphs"):
        out.sum().backward()


def test_an_output_held_when_its_position_replays_again_moves_to_memory_of_its_own(rt):
    # Forward then backward per call: every call is an episode of its own and replays position
    # 0, as the last stage of a 1F1B pipeline does; the schedule keeps each output to the end
    # of the step (to return them merged). The held ones are moved before the buffer is reused.
    layer = Graphed(torch.nn.Linear(4, 3), rt, num_warmup_steps=1)
    for _ in range(3):
        step(layer, "f1 b1")
    (static,) = next(iter(layer.engine.signatures().values())).positions[0].static_outputs
    kept = [step(layer, "f1 b1")[1] for _ in range(4)]
    assert kept[-1].data_ptr() == static.data_ptr()  # the newest one still aliases the graph's buffer
    assert len({t.data_ptr() for t in kept}) == 4  # each earlier one was moved to memory of its own
    # nothing held: nothing moved
    moved = []
    original = rt.move_to_copies
    rt.move_to_copies = lambda held, message: moved.append(len(held)) or original(held, message)
    for _ in range(3):
        step(layer, "f1 b1")
    kept.clear()
    step(layer, "f1 b1")
    assert moved == [1]  # only the last of the kept ones was still held at the first replay


def same_storage(held, tensor):
    """Whether what a watch found (a :class:`~paddle_graphpp.torch.memory.handout.Held`) is
    ``tensor``'s memory: the storage handed out with it."""
    return held.storage._cdata == tensor.untyped_storage()._cdata


def test_holding_the_last_layers_output_does_not_hold_the_earlier_layers_outputs(rt):
    # A chained layer's call keeps its input (the previous layer's output) only until its
    # backward is over: an output kept with its autograd graph moves alone.
    a = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    b = Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=0)
    moved = []
    original = rt.move_to_copies
    rt.move_to_copies = lambda held, message: moved.append(held) or original(held, message)
    kept = []
    for _ in range(5):
        x = torch.randn(2, 4, requires_grad=True)
        out = b(a(x))
        out.sum().backward()
        kept.append(out)  # with its grad_fn: the node and its call stay alive
    assert a.engine.replays and b.engine.replays
    assert moved and all(any(same_storage(h, k) for k in kept) for hs in moved for h in hs)
    assert sum(len(ts) for ts in moved) == len(moved)  # one tensor each time: b's output, never a's


# ------------------------------------- outputs whose memory the recorded step freed early
def run_dropping(layer, order, hold=()):
    """Like :func:`step`, but a micro-batch's output is dropped once its backward ran, as a
    pipeline schedule does (unless its number is in ``hold``); returns the outputs still held."""
    outs, held = {}, {}
    for tok in order.split():
        n = int(tok[1:])
        if tok[0] == "f":
            outs[n] = layer(torch.randn(2, 4, requires_grad=True))
        elif n in hold:
            held[n] = outs.pop(n)
            held[n].sum().backward()
        else:
            outs.pop(n).sum().backward()
    return held


def positions_of(layer):
    (sig,) = layer.engine.signatures().values()
    return sig.positions


def test_an_output_the_recorded_step_freed_gives_its_memory_back_where_it_was_freed(rt):
    # f1 f2 b1 f3 b2 b3: micro-batch 1's output is dropped after b1 (Linear's backward does not
    # save it), so the capture gives it back before f3's graph, which may take that memory;
    # the outputs still alive when the episode ends stay their positions' for good.
    layer = Graphed(torch.nn.Linear(4, 3), rt, num_warmup_steps=1)
    order = "f1 f2 b1 f3 b2 b3"
    for _ in range(3):
        run_dropping(layer, order)
    done = positions_of(layer)
    assert set(done) == {0, 1, 2}
    assert done[0].owned[0] is None  # given back at its release point
    assert done[1].owned[0] is None  # dropped after b2, before b3's graph
    assert done[2].owned == [None]  # dropped after the last graph: never watched to a release point
    proc = layer.engine.process
    checks = {k[2:]: [link.position for link in links] for k, links in proc.outputs.checks.items()}
    assert checks == {(2, "forward"): [0], (2, "backward"): [1]}


def test_an_output_held_longer_than_in_the_recorded_step_moves_before_its_memory_is_reused(rt):
    layer = Graphed(torch.nn.Linear(4, 3), rt, num_warmup_steps=1)
    order = "f1 f2 b1 f3 b2 b3"
    for _ in range(3):
        run_dropping(layer, order)
    moved = []
    original = rt.move_to_copies
    rt.move_to_copies = lambda held, message: moved.append(list(held)) or original(held, message)
    run_dropping(layer, order)
    assert moved == []  # dropped as in the recorded step: nothing to move
    static = positions_of(layer)[0].static_outputs[0]
    held = run_dropping(layer, order, hold=(1,))
    assert len(moved) == 1 and same_storage(moved[0][0], held[1])  # before f3's replay
    assert held[1].data_ptr() != static.data_ptr()  # its values now live in memory of its own


# ------------------------- tensors sharing a handed-out output's memory (watched per storage)
# The fake replay writes nothing (and its capture ran over uninitialised buffers): each test
# writes the graph's output buffer itself where a real replay would (``replayed``).
def replayed(static):
    """Write what a replay would into the output buffer ``static`` (distinct values)."""
    static.copy_(torch.randn(static.shape))


def kept_views(out):
    """What a training loop keeps of an output without copying it."""
    return {"detach": out.detach(), "slice": out[:, 1:], "view": out.view(-1), "row": out[0]}


def assert_kept(views, expected):
    """Each of ``views`` (by :func:`kept_views` name; any other name: the whole output) equals
    the same view of ``expected``."""
    refs = kept_views(expected)
    for name, v in views.items():
        assert torch.equal(v, refs.get(name, expected)), name


@pytest.mark.skipif(not handout_mod.views_keep_values(), reason="this torch cannot re-point a storage")
def test_views_of_an_output_keep_their_values_when_its_position_replays_again(rt):
    layer = Graphed(torch.nn.Linear(4, 3), rt, num_warmup_steps=1)
    hooked = []
    layer.register_forward_hook(lambda module, args, output: hooked.append(output.detach()))
    for _ in range(3):
        step(layer, "f1 b1")
    (static,) = positions_of(layer)[0].static_outputs
    out = step(layer, "f1 b1")[1]
    replayed(static)
    expected, views = out.detach().clone(), {**kept_views(out), "hook": hooked[-1]}
    del out  # only tensors made from it are left: the object itself is gone
    hooked.clear()
    step(layer, "f1 b1")
    replayed(static)
    assert_kept(views, expected)
    assert all(v.data_ptr() != static.data_ptr() for v in views.values())
    assert hooked[0].data_ptr() == static.data_ptr()  # the newest output still aliases the buffer


def test_nothing_is_moved_once_every_tensor_over_an_output_is_gone(rt):
    layer = Graphed(torch.nn.Linear(4, 3), rt, num_warmup_steps=1)
    for _ in range(3):
        step(layer, "f1 b1")
    moved = []
    original = rt.move_to_copies
    rt.move_to_copies = lambda held, message: moved.append(message) or original(held, message)
    out = step(layer, "f1 b1")[1]
    view = out[0]
    del out
    step(layer, "f1 b1")
    assert len(moved) == 1 and "test:Linear" in moved[0] and "clone" in moved[0]  # the view held it
    del view
    step(layer, "f1 b1")
    step(layer, "f1 b1")
    assert len(moved) == 1  # each newest output was dropped with all its views


@pytest.mark.skipif(not handout_mod.views_keep_values(), reason="this torch cannot re-point a storage")
def test_a_view_held_past_its_release_point_keeps_its_values(rt):
    # f1 f2 b1 f3 b2 b3: micro-batch 1's output dies after b1 in the recorded step, so f3's graph
    # may take its memory; a loop that keeps a view of it (a logged loss.detach()) keeps values.
    layer = Graphed(torch.nn.Linear(4, 3), rt, num_warmup_steps=1)
    order = "f1 f2 b1 f3 b2 b3"
    for _ in range(3):
        run_dropping(layer, order)
    static = positions_of(layer)[0].static_outputs[0]
    outs, views, expected = {}, None, None
    for tok in order.split():
        n = int(tok[1:])
        if tok[0] == "f":
            outs[n] = layer(torch.randn(2, 4, requires_grad=True))
            if n == 1:
                replayed(static)
            if n == 3:
                replayed(static)  # f3's graph wrote over micro-batch 1's released output
        else:
            out = outs.pop(n)
            out.sum().backward()
            if n == 1:
                expected, views = out.detach().clone(), kept_views(out)
            del out
    assert_kept(views, expected)


def test_without_a_storage_swap_the_output_moves_and_its_views_raise_when_read(rt, monkeypatch):
    # torch 2.11 cannot re-point a storage: the handed-out object keeps its values (moved, as
    # the object it is), and the storage its views share is marked to raise the engine's message
    # when read (torch's own call, recorded here: a CPU build lacks it).
    poisoned = []
    monkeypatch.setattr(handout_mod, "_SWAP", False)
    monkeypatch.setattr(handout_mod, "_POISON", lambda cdata, message: poisoned.append((cdata, message)))
    layer = Graphed(torch.nn.Linear(4, 3), rt, num_warmup_steps=1)
    for _ in range(3):
        step(layer, "f1 b1")
    (static,) = positions_of(layer)[0].static_outputs
    out = step(layer, "f1 b1")[1]
    replayed(static)
    expected, view = out.detach().clone(), out[0]
    storage = view.untyped_storage()._cdata
    step(layer, "f1 b1")
    replayed(static)
    assert torch.equal(out, expected) and out.data_ptr() != static.data_ptr()
    assert [cdata for cdata, _ in poisoned] == [storage]
    assert "test:Linear" in poisoned[0][1] and "clone" in poisoned[0][1]


def test_an_output_dlpack_cannot_carry_is_watched_as_the_object(rt):
    # (a tensor subclass: handed out as a detached alias of the graph's buffer, moved when held)
    class Tagged(torch.Tensor):
        pass

    class Tags(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x).as_subclass(Tagged)

    layer = Graphed(Tags(), rt, num_warmup_steps=1)
    for _ in range(3):
        step(layer, "f1 b1")
    (static,) = positions_of(layer)[0].static_outputs
    out = step(layer, "f1 b1")[1]
    assert type(out) is Tagged and out.data_ptr() == static.data_ptr()
    replayed(static)
    expected = out.detach().clone()
    step(layer, "f1 b1")
    replayed(static)
    assert torch.equal(out.detach(), expected)


def test_outputs_alive_to_the_end_of_the_recorded_step_or_sharing_memory_stay_owned(rt):
    layer = Graphed(torch.nn.Linear(4, 3), rt, num_warmup_steps=1)
    for _ in range(3):
        run_dropping(layer, "f1 f2 b1 f3 b2 b3", hold=(1, 2, 3))
    assert all(p.owned == [None] and not p.static_outputs[0] is None for p in positions_of(layer).values())
    assert layer.engine.process.outputs.checks == {}

    class Passthrough(torch.nn.Module):  # returns a view of its input: its memory is the input's
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.w, x[0]

    views = Graphed(Passthrough(), rt, num_warmup_steps=1)
    for _ in range(3):
        outs = {}
        for tok in "f1 f2 b1 f3 b2 b3".split():
            n = int(tok[1:])
            if tok[0] == "f":
                outs[n] = views(torch.randn(2, 4, requires_grad=True))
            else:
                y, _ = outs.pop(n)
                y.sum().backward()
    (sig,) = views.engine.signatures().values()
    assert sig.positions and all(p.owned == [None, None] for p in sig.positions.values())


def test_a_capture_batch_that_raises_early_leaves_no_output_marked_to_go_back(rt):
    # The static buffers cannot be allocated (out of memory, say): the recorded deaths of that
    # episode must not carry over into the next recording's capture, where they would name
    # outputs that do not die there.
    layer = Graphed(torch.nn.Linear(4, 3), rt, num_warmup_steps=1)
    order = "f1 f2 b1 f3 b2 b3"
    run_dropping(layer, order)
    run_dropping(layer, order)  # recorded: outputs 1 and 2 die within the episode
    proc = layer.engine.process
    assert proc.recording.deaths
    original = rt.static_buffers

    def no_memory(specs):
        raise RuntimeError("out of memory (simulated)")

    rt.static_buffers = no_memory
    with pytest.raises(RuntimeError, match="simulated"):
        run_dropping(layer, order)
    rt.static_buffers = original
    assert proc.recording is None  # the recording is gone with the batch that failed; nothing carries over
    run_dropping(layer, order)  # recorded again
    run_dropping(layer, order)  # captured from this recording only, then replayed
    assert layer.engine.captures == 6 and layer.engine.replays > 0


def test_a_step_abandoned_between_forwards_and_backwards_is_dropped_and_training_goes_on(rt):
    import paddle_graphpp
    from paddle_graphpp.core.errors import GraphScheduleError

    layer = Graphed(torch.nn.Linear(4, 3), rt, num_warmup_steps=1)
    step(layer, INTERLEAVED)  # warmup
    step(layer, "f1 f2 f3 b1 f4")  # the recorded step raises before its last backwards
    with pytest.raises(GraphScheduleError, match=r"paddle_graphpp\.drop_in_flight\(model\)"):
        step(layer, INTERLEAVED)  # without the drop, the next step's first backward is refused
    assert layer.engine.in_flight == 3 + 3  # the abandoned step's f2 f3 f4, the refused one's f1 f2 f3
    assert paddle_graphpp.drop_in_flight(layer) == 6
    assert layer.engine.in_flight == 0 and paddle_graphpp.drop_in_flight(layer) == 0
    # The abandoned recording held one complete position (f1 b1): captured at the next step's
    # start and replayed there, the others recorded in that step and captured at the one after.
    step(layer, INTERLEAVED)
    assert layer.engine.captures == 2 and layer.engine.replays == 2
    step(layer, INTERLEAVED)
    assert layer.engine.captures == 8 and layer.engine.replays == 10 and layer.engine.in_flight == 0
    # abandoned while replaying: the capture order starts again at the next step
    step(layer, "f1 f2 f3 b1 f4 b2")
    assert paddle_graphpp.drop_in_flight(layer) == 2
    for _ in range(2):
        step(layer, INTERLEAVED)
    assert layer.engine.replays == 10 + 6 + 2 * 8 and layer.engine.captures == 8 and layer.engine.in_flight == 0


def test_drop_in_flight_takes_several_models_and_warns_of_layers_it_was_not_given(rt, caplog):
    import paddle_graphpp

    a, b = (Graphed(torch.nn.Linear(4, 4), rt, num_warmup_steps=1) for _ in range(2))
    x = torch.randn(2, 4, requires_grad=True)
    ys = [b(a(x)) for _ in range(2)]  # the step raises here
    with caplog.at_level("WARNING", logger="paddle_graphpp"):
        assert paddle_graphpp.drop_in_flight(a) == 2
    assert "still in flight in graphed layers outside the models given" in caplog.text
    assert paddle_graphpp.drop_in_flight([a, b]) == 2 and b.engine.in_flight == 0
    del ys
    for _ in range(3):  # recorded (the abandoned step was the warmup), captured and replayed, replayed
        b(a(x)).sum().backward()
    assert a.engine.captures == b.engine.captures == 2 and a.engine.replays == b.engine.replays == 4
    # without naming the layers: every one of the process that holds micro-batches (in a whole
    # test run, layers that earlier tests left in flight too)
    ys = [b(a(x)) for _ in range(3)]
    assert paddle_graphpp.drop_in_flight() >= 6 and a.engine.in_flight == b.engine.in_flight == 0
