"""Engine bookkeeping over the numpy framework of ``nofw.py``: warmup, recording, capture in
order, replay, signatures, generations, the FIFO, static buffers and links between layers.

These tests check which path each call takes (the fake runtime's replays compute nothing).
Whether capture and replay compute the right numbers is checked on a GPU (unittests/gpu/).
"""
import warnings

import numpy as np
import pytest

import nofw
from nofw import Graphed, Linear, step
from paddle_graphpp.core import memory as memory_mod
from paddle_graphpp.core.engine import EngineOptions, Phase
from paddle_graphpp.core.errors import GraphScheduleError, StateReplacedError
from paddle_graphpp.core.runtime import StreamOrderedAllocator

INTERLEAVED = "f1 f2 f3 b1 f4 b2 b3 b4"


def report(rt):
    return memory_mod.plan_for(rt).report()


def positions(layer):
    (sig,) = layer.engine.signatures().values()
    return sig.positions


# ------------------------------------------------------------------ phases
def test_warmup_then_record_then_capture_in_order_then_replay(any_rt):
    rt = any_rt
    layer = Graphed(Linear(4, 3), rt, num_warmup_steps=3)
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
    assert report(rt)["pool_generations"] == 1 and report(rt)["graphs_captured"] == 8
    # replayed in the order the step ran: forwards of positions 0-2, backward 0, forward 3, ...
    done = positions(layer)
    expected = [done[0].fwd_graph, done[1].fwd_graph, done[2].fwd_graph, done[0].bwd_graph, done[3].fwd_graph,
                done[1].bwd_graph, done[2].bwd_graph, done[3].bwd_graph]
    assert rt.replayed[-8:] == expected and rt.captured == expected


@pytest.mark.parametrize("case,recorded_after", [("plain", 3), ("credited", 2), ("after_a_call", 3), ("reset", 3)])
def test_warmup_calls_made_outside_the_engine_count_for_its_first_signature_only(rt, case, recorded_after):
    # what a block graphed in parts credits its parts for the call that judged them (torch.layers):
    # with num_warmup_steps=2 a layer records its third call, a credited one its second
    layer = Graphed(Linear(4, 3), rt, num_warmup_steps=2)
    calls = 0
    if case == "after_a_call":
        step(layer)
        calls += 1
    if case != "plain":
        layer.engine.phases.credit_warmup(1)  # ignored where a signature exists
    if case == "reset":
        layer.engine.reset()  # as if newly wrapped: nothing credited
    while layer.engine.phase() is not Phase.RECORD and calls < 5:
        step(layer)
        calls += 1
    assert calls == recorded_after
    step(layer)  # captured at its start, then replayed
    assert layer.engine.captures == 2 and layer.engine.replays == 2


def test_graphs_are_captured_in_the_recorded_order_of_all_layers(rt):
    a = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    b = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    for _ in range(2):
        x = nofw.randn(2, 4, requires_grad=True)
        nofw.backward(b(a(x)).sum())  # recorded: a.f b.f b.b a.b; then captured and replayed
    pa, pb = positions(a)[0], positions(b)[0]
    assert rt.captured == [pa.fwd_graph, pb.fwd_graph, pb.bwd_graph, pa.bwd_graph]
    assert report(rt)["pool_generations"] == 1


def test_capture_waits_for_episode_start(rt):
    layer = Graphed(Linear(4, 3), rt, num_warmup_steps=1)
    outs = step(layer, "f1 f2")  # f1 warms up; f2 is mid-episode: must stay in warmup
    assert layer.engine.phase() is Phase.WARMUP
    nofw.backward(outs[1].sum())
    nofw.backward(outs[2].sum())
    step(layer, "f1 b1")  # recorded
    assert layer.engine.captures == 0
    step(layer, "f1 b1")
    assert layer.engine.captures == 2 and layer.engine.replays == 2


def test_recorded_step_results_come_from_the_eager_run(any_rt):
    lin = Linear(4, 3)
    layer = Graphed(lin, any_rt, num_warmup_steps=0)
    x = nofw.randn(2, 4, requires_grad=True)
    y = layer(x)
    assert layer.engine.phase() is Phase.RECORD
    np.testing.assert_array_equal(y.array, lin(x).array)
    nofw.backward(y.sum())
    ref = nofw.Tensor(x.array.copy(), requires_grad=True)
    grads = nofw.grad(lin(ref).sum(), [ref])
    np.testing.assert_array_equal(x.grad.array, grads[0].array)
    assert layer.engine.captures == 0


def test_replay_hands_off_copies_to_leaves_without_grad_and_accumulates_in_place(rt):
    lin = Linear(4, 3)
    layer = Graphed(lin, rt, num_warmup_steps=0, accumulate_grads=False)
    step(layer, "f1 b1")  # recorded
    lin.zero_grad()
    step(layer, "f1 b1")  # captured, replayed: grads are copies, not the static buffers
    buffers = layer.engine.param_grad_buffers
    assert all(p.grad.data_ptr() != b.data_ptr() for p, b in zip(lin.parameters(), buffers))
    before = [p.grad.data_ptr() for p in lin.parameters()]
    step(layer, "f1 b1")  # accumulation into the existing grads, in place
    assert [p.grad.data_ptr() for p in lin.parameters()] == before


# ------------------------------------------------------------- signatures
def test_new_signature_is_captured_anew_in_a_new_generation(rt):
    layer = Graphed(Linear(4, 3), rt, num_warmup_steps=1)
    for _ in range(3):
        step(layer, "f1 b1")  # warmup, record, capture + replay
    assert layer.engine.captures == 2 and layer.engine.replays == 2
    for _ in range(3):
        step(layer, "f1 b1", shape=(5, 4))
    assert layer.engine.captures == 4 and layer.engine.replays == 4
    assert len(layer.engine.signatures()) == 2 and report(rt)["pool_generations"] == 2


def test_a_position_seen_after_capture_is_recorded_and_captured_into_a_new_generation(rt):
    layer = Graphed(Linear(4, 3), rt, num_warmup_steps=0)
    step(layer, "f1 b1")
    step(layer, "f1 b1")  # position 0 captured
    step(layer, "f1 f2 b1 b2")  # position 1 is new: eager and recorded, position 0 replays
    assert layer.engine.graph_count() == 2 and layer.engine.replays == 4
    step(layer, "f1 f2 b1 b2")  # position 1 captured into a generation of its own
    assert layer.engine.graph_count() == 4 and layer.engine.replays == 8
    assert report(rt)["pool_generations"] == 2


def test_signature_cache_full_runs_eagerly_with_one_warning(rt):
    lin = Linear(4, 3)
    layer = Graphed(lin, rt, num_warmup_steps=0, max_signatures=1)
    for _ in range(3):
        step(layer, "f1 b1")
    replays = layer.engine.replays
    x = nofw.randn(7, 4, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="max_signatures"):
        y = layer(x)
    np.testing.assert_array_equal(y.array, lin(x).array)  # computed, not a stale replay
    nofw.backward(y.sum())
    assert layer.engine.replays == replays and x.grad is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nofw.backward(layer(nofw.randn(7, 4, requires_grad=True)).sum())  # warned once only


class Scale(nofw.Module):
    def __init__(self):
        super().__init__()
        self.w = nofw.Parameter(np.ones(3))

    def forward(self, x, factor):
        return x * self.w * factor


def test_non_tensor_argument_is_part_of_the_signature(rt):
    layer = Graphed(Scale(), rt, num_warmup_steps=0)
    for f in (2.0, 2.0, 3.0):
        nofw.backward(layer(nofw.ones(3, requires_grad=True), f).sum())
    assert len(layer.engine.signatures()) == 2
    assert layer.engine.graph_count() == 2  # 2.0 captured in the second call; 3.0 is recorded


def test_eval_mode_is_part_of_the_signature(rt):
    """A graph captured in training mode is never replayed in eval mode."""
    layer = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    for _ in range(3):
        step(layer, "f1 b1")
    replays = layer.engine.replays
    layer.module.eval()
    step(layer, "f1 b1")  # a new signature: recorded, not a replay of the training graph
    assert layer.engine.replays == replays and len(layer.engine.signatures()) == 2


def test_generators_are_passed_to_every_capture(rt):
    gens = [object(), object()]
    layer = Graphed(Linear(4, 3), rt, num_warmup_steps=1, generators=lambda: gens)
    for _ in range(3):
        step(layer, INTERLEAVED)
    assert layer.engine.captures == 8
    assert rt.generators_registered == [tuple(gens)] * 8


# ------------------------------------------------------------------ the FIFO
def test_replay_order_differing_from_capture_raises(rt):
    a = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    b = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    x = nofw.randn(2, 4, requires_grad=True)
    # (b reads a copy of a's output: b's graph has its own input buffer, so it can replay on
    # any input of that shape and only the order is checked here)
    for _ in range(3):  # recorded order a.f b.f b.b a.b; captured in that order; replayed in it
        nofw.backward(b(a(x) * 1.0).sum())
    # b first, then a (with b in flight): a takes position 0, whose forward graph was captured
    # before b's: replaying it now would run ahead of the capture order
    yb = b(nofw.randn(2, 4, requires_grad=True))  # noqa: F841 - held: its forward stays in flight
    with pytest.raises(GraphScheduleError, match="test:Linear: graphs are replayed in a different order"):
        a(x)


def test_per_graph_mode_has_no_order_constraint(rt):
    a = Graphed(Linear(4, 4), rt, num_warmup_steps=0, memory="per_graph")
    b = Graphed(Linear(4, 4), rt, num_warmup_steps=0, memory="per_graph")
    x = nofw.randn(2, 4, requires_grad=True)
    nofw.backward(b(a(x)).sum())  # recorded
    nofw.backward(b(a(x)).sum())  # captured, replayed
    yb = b(nofw.randn(2, 4, requires_grad=True))
    ya = a(x)
    nofw.backward(yb.sum() + ya.sum())
    assert a.engine.replays == 4 and b.engine.replays == 4
    assert report(rt)["pool_generations"] == 0 and report(rt)["per_graph_pools"] == 4


def test_per_graph_mode_recycles_one_pair_per_in_flight_slot_shared_has_one_per_position(rt):
    per_graph = Graphed(Linear(4, 4), rt, num_warmup_steps=0, memory="per_graph")
    shared = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    for layer in (per_graph, shared):
        step(layer, INTERLEAVED)  # recorded (at most 3 in flight)
        step(layer, INTERLEAVED)  # captured, replayed
        assert layer.engine.replays == 8
    assert per_graph.engine.graph_count() == 6  # 3 slots, not 4 positions
    assert shared.engine.graph_count() == 8


def test_positions_restart_per_process_wide_episode(rt):
    """A layer nested inside another's forward and backward never starts an episode itself, yet its
    positions restart every step: the episode is process-wide."""
    outer = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    inner = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    for _ in range(5):
        nofw.backward(inner(outer(nofw.randn(2, 4, requires_grad=True))).sum())
    assert inner.engine.graph_count() == 2 and outer.engine.graph_count() == 2
    assert inner.engine.replays == 8


def test_unpaired_backward_raises_schedule_error(rt):
    layer = Graphed(Linear(4, 3), rt, num_warmup_steps=0)
    y1 = layer(nofw.randn(2, 4, requires_grad=True))  # noqa: F841 - held: its forward stays in flight
    y2 = layer(nofw.randn(2, 4, requires_grad=True))
    with pytest.raises(GraphScheduleError, match="test:Linear: backwards must run in the order of their forwards"):
        nofw.backward(y2.sum())
    assert layer.engine.in_flight == 2  # refused before the FIFO changed


def test_a_second_backward_through_the_same_outputs_raises(rt):
    layer = Graphed(Linear(4, 3), rt, num_warmup_steps=0)
    y = layer(nofw.randn(2, 4, requires_grad=True))
    nofw.backward(y.sum(), retain_graph=True)
    with pytest.raises(GraphScheduleError, match="no forward in flight"):
        nofw.backward(y.sum())


def test_too_many_forwards_in_flight_raise(rt):
    layer = Graphed(Linear(4, 3), rt, num_warmup_steps=0, max_in_flight=2)
    held = [layer(nofw.randn(2, 4, requires_grad=True)) for _ in range(2)]
    with pytest.raises(GraphScheduleError, match="test:Linear: 2 forwards are waiting.*max_in_flight=2"):
        layer(nofw.randn(2, 4, requires_grad=True))
    for y in held:  # the refused forward left nothing behind: the two complete in order
        nofw.backward(y.sum())
    assert layer.engine.in_flight == 0


def test_no_grad_calls_bypass_the_fifo(rt):
    layer = Graphed(Linear(4, 3), rt, num_warmup_steps=0)
    with nofw.no_grad():
        for _ in range(100):
            layer(nofw.randn(2, 4))
    assert layer.engine.in_flight == 0 and layer.engine.captures == 0 and not layer.engine.signatures()


def test_bad_options_are_rejected_with_the_layer_name(rt):
    with pytest.raises(ValueError, match="test:Linear.*memory='pooled'"):
        Graphed(Linear(2, 2), rt, memory="pooled")
    with pytest.raises(ValueError, match="test:Linear: fallback"):
        Graphed(Linear(2, 2), rt, fallback="ignore")
    with pytest.raises(ValueError, match="test:Linear: num_warmup_steps"):
        Graphed(Linear(2, 2), rt, num_warmup_steps=-1)
    with pytest.raises(ValueError, match="test:Linear: max_signatures"):
        Graphed(Linear(2, 2), rt, max_signatures=0)
    with pytest.raises(ValueError, match="accumulate_grads must be a bool"):
        Graphed(Linear(2, 2), rt, accumulate_grads="yes")
    with pytest.raises(ValueError, match="generators must be a list or tuple"):
        EngineOptions(generators=object()).validate("test:layer")
    with pytest.raises(ValueError, match="test:Linear: accumulate_grads=True is not supported by the nofw runtime"):
        Graphed(Linear(2, 2), nofw.PlainRuntime(), accumulate_grads=True)


# ------------------------------------------------------------- static buffers
def test_static_buffers_are_shared_by_lifetime(rt):
    layer = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    step(layer, "f1 f2 b1 f3 b2 b3")  # recorded
    step(layer, "f1 f2 b1 f3 b2 b3")  # captured, replayed
    pairs = positions(layer)
    # position 2 is recorded after position 0's backward: it takes over one of position 0's
    # buffers of the same shape (its static input or its incoming-gradient buffer)
    released = [pairs[0].static_inputs[0], pairs[0].static_grad_outputs[0]]
    assert any(pairs[2].static_inputs[0] is b for b in released)
    # position 1 overlaps position 0 in time: its input buffer is its own
    assert not any(pairs[1].static_inputs[0] is b for b in released)
    assert pairs[0].static_grad_outputs[0] is not pairs[1].static_inputs[0]  # b1 runs while f2 is in flight
    assert pairs[1].static_grad_outputs[0] is not pairs[2].static_inputs[0]  # b2 runs while f3 is in flight
    # three positions, at most two in flight: three buffers in all, carved from one block
    buffers = {id(b): b for p in pairs.values() for b in p.static_inputs + p.static_grad_outputs}
    assert len(buffers) == 3
    assert len({b.storage_ptr() for b in buffers.values()}) == 1


def test_static_buffers_are_allocated_at_capture_not_while_recording(rt):
    layer = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    made = []
    real = rt.static_buffers
    rt.static_buffers = lambda specs: made.append(len(specs)) or real(specs)
    step(layer, "f1 f2 b1 b2")  # recorded: slots only
    assert made == [] and layer.engine.captures == 0
    step(layer, "f1 f2 b1 b2")  # captured: one call for the whole recording
    assert made == [3]  # two inputs in flight together, one incoming-gradient buffer


def test_eager_cache_of_the_recorded_step_is_released_before_capture(rt):
    layer = Graphed(Linear(4, 4), rt, num_warmup_steps=1)
    step(layer, "f1 f2 b1 b2")  # warmup
    step(layer, "f1 f2 b1 b2")  # recorded
    assert rt.released == 0
    for _ in range(3):
        step(layer, "f1 f2 b1 b2")  # released once, before the capture at the first
    assert rt.released == 1


# ------------------------------------------------------------ chained layers
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
    a = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    b = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    x = nofw.randn(2, 4, requires_grad=True)
    nofw.backward(b(a(x)).sum())  # recorded: b's input is a's output, a's incoming gradient b's input gradient
    made = []
    real = rt.static_buffers
    rt.static_buffers = lambda specs: made.append(len(specs)) or real(specs)
    copied = _copied_pairs(rt)
    nofw.backward(b(a(x)).sum())  # captured, replayed
    pa, pb = positions(a)[0], positions(b)[0]
    # b's graph reads a's static output; a's backward graph reads b's static input gradient
    assert pb.static_inputs[0].data_ptr() == pa.static_outputs[0].data_ptr()
    assert pa.static_grad_outputs[0].data_ptr() == pb.static_grad_inputs[0].data_ptr()
    assert made == [2]  # buffers only for x and for the loss's gradient into b
    nofw.backward(b(a(x)).sum())
    # per step: a's forward copies x, b's backward the loss gradient; b's forward and a's
    # backward copy nothing
    assert copied[-4:] == [1, 0, 1, 0]
    assert a.engine.replays == 4 and b.engine.replays == 4


def test_a_chained_layer_given_another_tensor_runs_eagerly_and_writes_no_graph_memory(rt):
    a = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    b = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    x = nofw.randn(2, 4, requires_grad=True)
    nofw.backward(b(a(x)).sum())  # recorded
    nofw.backward(b(a(x)).sum())  # captured, replayed
    pa = positions(a)[0]
    kept = pa.static_outputs[0].numpy()
    replays = b.engine.replays
    with pytest.warns(RuntimeWarning, match="test:Linear: input 0 is not the tensor the previous graphed layer"):
        h = a(x) * 2.0  # not a's output: copying it into b's static input would overwrite a's
        y = b(h)
    nofw.backward(y.sum())
    assert b.engine.replays == replays  # b ran eagerly, forward and backward
    np.testing.assert_array_equal(pa.static_outputs[0].array, kept)
    np.testing.assert_array_equal(y.array, b.module(h).array)  # (a's replayed values are stale)
    del h, y  # (held, they would keep a's output of this step referenced when it replays again)
    nofw.backward(b(a(x)).sum())  # the captured data flow again: replayed
    assert b.engine.replays == replays + 2


def test_an_output_still_held_when_its_position_replays_warns_once_without_output_release(rt):
    # This runtime cannot move an output to memory of its own (no OutputRelease): the layer says
    # so once, naming itself, instead of silently overwriting what the caller keeps.
    layer = Graphed(Linear(4, 3), rt, num_warmup_steps=0)
    step(layer, "f1 b1")
    step(layer, "f1 b1")  # captured, replayed
    kept = layer(nofw.randn(2, 4, requires_grad=True))
    nofw.backward(kept.sum())
    with pytest.warns(RuntimeWarning, match="test:Linear: outputs of an earlier micro-batch are still referenced.*"
                                            "nofw runtime cannot move them"):
        step(layer, "f1 b1")
    assert kept.data_ptr() == positions(layer)[0].static_outputs[0].data_ptr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(layer, "f1 b1")  # nothing held (and warned once only)


# ------------------------------------------------------- replaced parameters
def test_a_replaced_parameter_is_refused_at_replay_until_the_layer_is_reset(rt):
    lin = Linear(4, 3)
    layer = Graphed(lin, rt, num_warmup_steps=0)
    step(layer, "f1 b1")
    step(layer, "f1 b1")  # captured, replayed
    lin.weight.array[...] = 0.5  # in place: fine
    step(layer, "f1 b1")
    lin.weight = nofw.Parameter(lin.weight.numpy())  # a new tensor in its place
    with pytest.raises(StateReplacedError, match="test:Linear: parameter 'weight' was replaced"):
        step(layer, "f1")
    assert layer.engine.in_flight == 0
    held = step(layer, "f1", shape=(3, 4))  # a new signature: eager, in flight
    with pytest.raises(GraphScheduleError, match="test:Linear: reset with 1 micro-batch.*in flight"):
        layer.engine.reset()
    nofw.backward(held.pop(1).sum())
    layer.engine.reset()
    assert layer.engine.graph_count() == 0 and not layer.engine.signatures()
    for _ in range(3):
        step(layer, "f1 b1")  # recorded, captured against the new parameter, replayed
    assert positions(layer)[0].state is not None and layer.engine.phase() is Phase.READY


@pytest.mark.xfail(strict=True, raises=TypeError, reason=(
    "core limitation reported with this test: reset_graphs(model) finds its runtime with runtime_for(model), "
    "which knows torch and paddle objects only, though it uses the runtime only to walk the model (ModelTree)"))
def test_reset_graphs_resets_the_graphed_layers_of_a_model_of_any_runtime(rt):
    from paddle_graphpp.core.engine import reset_graphs

    layer = Graphed(Linear(4, 3), rt, num_warmup_steps=0)
    step(layer, "f1 b1")
    step(layer, "f1 b1")  # captured, replayed
    assert reset_graphs(layer) == 1
    assert layer.engine.graph_count() == 0


# ----------------------------------------------------------- deferred capture
def test_a_deferred_capture_records_the_next_episode_instead():
    rt = nofw.LendingRuntime(waits=["a test's reason", "a test's reason"])  # waits twice, then lets it go
    layer = Graphed(Linear(4, 3), rt, num_warmup_steps=1)
    step(layer, "f1 f2 b1 b2")  # warmup
    step(layer, "f1 f2 b1 b2")  # recorded
    for _ in range(2):  # each: the recording is dropped, this episode is recorded instead (eager)
        step(layer, "f1 f2 b1 b2")
        assert layer.engine.captures == 0 and layer.engine.phase() is Phase.RECORD
    assert rt.released == 0 and rt.prepared == []  # a dropped recording gives nothing back, captures nothing
    step(layer, "f1 f2 b1 b2")  # captured at its start, from the last recording
    assert layer.engine.captures == 4 and layer.engine.replays == 4
    assert layer.engine.process.deferred == 0
    # the pool was prepared before its first capture, and lent to eager work after the batch
    assert len(rt.prepared) == 1 and rt.lent == rt.prepared


def test_deferring_stops_after_the_limit(monkeypatch):
    from paddle_graphpp.core import capture as capture_mod

    monkeypatch.setattr(capture_mod, "MAX_DEFERRED_EPISODES", 2)
    rt = nofw.LendingRuntime(waits=["a test's reason"] * 100)
    layer = Graphed(Linear(4, 3), rt, num_warmup_steps=0)
    for _ in range(3):  # recorded, then two recordings dropped
        step(layer, "f1 b1")
    assert layer.engine.captures == 0
    step(layer, "f1 b1")  # the limit is reached: captured although the runtime still asks to wait
    assert layer.engine.captures == 2
    # and no later capture waits in this process: a second layer records, then captures at once
    other = Graphed(Linear(4, 3), rt, num_warmup_steps=0)
    step(other, "f1 b1")
    step(other, "f1 b1")
    assert other.engine.captures == 2


# ------------------------------------------------- the stream-ordered allocator
class AsyncAllocatorRuntime(nofw.NoFrameworkRuntime, StreamOrderedAllocator):
    """As if the stream-ordered allocator (cudaMallocAsync) were active."""

    def async_allocator_active(self):
        return True


def test_stream_ordered_allocator_captures_in_the_step_instead_of_recording():
    rt = AsyncAllocatorRuntime()
    lin = Linear(4, 3)
    layer = Graphed(lin, rt, num_warmup_steps=0)
    x = nofw.randn(2, 4, requires_grad=True)
    y = layer(x)  # captured, then the capture's launch gives the result
    assert layer.engine.phase() is Phase.READY
    assert layer.engine.captures == 1 and layer.engine.replays == 1
    assert y.shape == (2, 3)  # values come from the launch: checked on the GPU, not here
    nofw.backward(y.sum())
    assert layer.engine.captures == 2 and layer.engine.replays == 2
    assert x.grad is not None and all(p.grad is not None for p in lin.parameters())
    del y
    step(layer, "f1 b1")
    assert layer.engine.captures == 2 and layer.engine.replays == 4
    assert report(rt)["pool_generations"] == 0  # pools are the driver's: no generations


def test_a_custom_all_reduce_that_gave_up_raises_at_the_next_graphed_call_without_a_watchdog(rt):
    from paddle_graphpp.core import collectives as C
    from paddle_graphpp.core.errors import CollectiveTimeoutError

    class GaveUp(C.AllReduceBackend):
        """A group whose kernel gave up on rank 1; nothing else of it is used."""

        name, world_size = "gave up", 2
        custom_unavailable_reason = facts = is_capturing = empty_like = fallback = None
        reduce_staged = reduce_registered = exchange = close = None

        def arena_bytes(self):
            return 0

        def fault(self):
            return "waited 5 s for rank 1 and gave up"

    layer = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    step(layer, "f1 b1")
    step(layer, "f1 b1")
    replays = layer.engine.replays
    assert replays > 0 and layer.engine.process.replay_watch.watchdog is None  # one process: no watchdog
    dispatcher = C.AllReduceDispatcher(GaveUp())
    try:
        with pytest.raises(CollectiveTimeoutError, match="for rank 1 and gave up"):
            step(layer, "f1")
        assert layer.engine.replays == replays  # raised before anything was launched
    finally:
        dispatcher._closed = True  # (close() would release through the backend)
