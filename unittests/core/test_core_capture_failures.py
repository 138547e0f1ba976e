"""Capture failures over the numpy framework of ``nofw.py``: what the user sees (the layer
named, the error's type kept or a CaptureError), what is given back, and that training goes on."""
import gc
import weakref

import numpy as np
import pytest

import nofw
from nofw import Graphed, Linear, step
from paddle_graphpp.core.engine import Phase
from paddle_graphpp.core.errors import CaptureError
from paddle_graphpp.core.runtime import CaptureHints


class SyncsInCapture(nofw.Module):
    """Stands in for a host sync: its forward fails only while the (fake) stream captures."""

    error = RuntimeError("operation not permitted when stream is capturing")

    def __init__(self, runtime):
        super().__init__()
        self.lin = Linear(4, 4)
        self.runtime = runtime

    def forward(self, x):
        if self.runtime.is_capturing():
            raise type(self.error)(*self.error.args)
        return self.lin(x)


class RaisesInCapture(SyncsInCapture):
    """User code that raises a ValueError only while the (fake) stream captures."""

    error = ValueError("bad value")


class SyncsInBackwardCapture(SyncsInCapture):
    """Its forward captures; its backward fails while the stream captures."""

    def forward(self, x):
        def check():
            if self.runtime.is_capturing():
                raise RuntimeError("operation not permitted when stream is capturing")

        return self.lin(nofw.on_backward(x, check))


class DeviceErrorAsOSError(SyncsInCapture):
    """A framework that raises the device's errors as OSError (as Paddle does)."""

    error = OSError("(External) CUDA error(900), operation not permitted when stream is capturing")


class RuntimeNamingOSErrors(nofw.NoFrameworkRuntime, CaptureHints):
    def capture_failure_hint(self, error, generators):
        return None

    def is_capture_failure(self, error):
        return isinstance(error, (RuntimeError, OSError))


@pytest.mark.parametrize("says_so", [True, False], ids=["runtime-names-its-errors", "default-runtime-error-only"])
def test_the_runtime_decides_which_errors_are_failures_of_capture(says_so):
    rt = RuntimeNamingOSErrors() if says_so else nofw.NoFrameworkRuntime()
    layer = Graphed(DeviceErrorAsOSError(rt), rt, num_warmup_steps=0, fallback="eager")
    step(layer)  # recorded
    if says_so:  # a failure of capture: fallback='eager' applies
        with pytest.warns(RuntimeWarning, match=r"test:DeviceErrorAsOSError: capturing the forward failed \(OSError"):
            step(layer)
        assert layer.engine.phase() is Phase.EAGER
    else:  # the layer's own error: it keeps its type, with the layer named
        with pytest.raises(OSError, match="test:DeviceErrorAsOSError: raised while capturing the forward"):
            step(layer)
        assert layer.engine.phase() is not Phase.EAGER


def test_capture_failure_names_layer_releases_memory_and_training_goes_on(any_rt):
    rt = any_rt
    layer = Graphed(SyncsInCapture(rt), rt, num_warmup_steps=0)
    step(layer)  # recorded (eager: the sync only fails under capture)
    released = rt.released
    with pytest.raises(CaptureError, match=r"test:SyncsInCapture: capturing the forward failed.*not permitted"
                                           r".*pass fallback='eager'") as err:
        layer(nofw.randn(2, 4, requires_grad=True))
    assert isinstance(err.value.__cause__, RuntimeError)
    assert rt.released >= released + 2  # before the capture, and after the failure
    assert rt.aborted == 1  # the broken capture was ended
    assert layer.engine.in_flight == 0 and layer.engine.graph_count() == 0
    assert layer.engine.phase() is Phase.WARMUP  # it warms up again
    step(layer)  # training goes on (recorded again)
    assert layer.engine.phase() is Phase.RECORD and layer.engine.in_flight == 0


def test_a_failed_captures_buffers_are_freed_while_its_error_is_held(rt, monkeypatch):
    made = []
    allocate = rt.static_buffers

    def tracked(specs):
        buffers = allocate(specs)
        made.extend(weakref.ref(b) for b in buffers)
        return buffers

    monkeypatch.setattr(rt, "static_buffers", tracked)
    layer = Graphed(SyncsInCapture(rt), rt, num_warmup_steps=0)
    step(layer)
    with pytest.raises(CaptureError) as err:
        layer(nofw.randn(2, 4, requires_grad=True))
    gc.collect()
    assert made and all(ref() is None for ref in made)  # err (and its traceback) still held
    assert "SyncsInCapture" in str(err.value)


def test_an_error_of_the_layers_own_code_during_capture_keeps_its_type(rt):
    layer = Graphed(RaisesInCapture(rt), rt, num_warmup_steps=0, fallback="eager")
    step(layer)
    with pytest.raises(ValueError, match=r"test:RaisesInCapture: raised while capturing the forward: bad value") as err:
        layer(nofw.randn(2, 4, requires_grad=True))
    assert not isinstance(err.value, CaptureError) and isinstance(err.value.__cause__, ValueError)
    assert layer.engine.in_flight == 0
    assert layer.engine.phase() is Phase.WARMUP  # not the capture's failure: no fallback, warms up again


def test_capture_failure_with_eager_fallback_keeps_training(rt):
    mod = SyncsInCapture(rt)
    layer = Graphed(mod, rt, num_warmup_steps=0, fallback="eager")
    step(layer)  # recorded
    x = nofw.randn(2, 4, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="test:SyncsInCapture: capturing the forward failed.*runs eagerly from now on"):
        y = layer(x)
    np.testing.assert_array_equal(y.array, mod.lin(x).array)
    nofw.backward(y.sum())
    assert layer.engine.phase() is Phase.EAGER
    mod.zero_grad()
    with pytest.warns(RuntimeWarning, match=r"test:SyncsInCapture: CUDA graphs are not used \(capturing the forward "
                                            r"failed: RuntimeError"):
        for _ in range(2):
            step(layer)
    assert layer.engine.replays == 0 and layer.engine.captures == 0 and layer.engine.phase() is Phase.EAGER
    assert all(p.grad is not None for p in mod.parameters())


def test_a_backward_capture_failure_says_so_and_drops_the_forward_graph(rt):
    layer = Graphed(SyncsInBackwardCapture(rt), rt, num_warmup_steps=0)
    step(layer)  # recorded
    with pytest.raises(CaptureError, match=r"test:SyncsInBackwardCapture: capturing the backward failed"):
        layer(nofw.randn(2, 4, requires_grad=True))
    assert layer.engine.captures == 1  # the forward was captured, then dropped with the position
    assert layer.engine.graph_count() == 0 and layer.engine.phase() is Phase.WARMUP
    assert layer.engine.in_flight == 0
    step(layer)  # training goes on


def test_a_failed_capture_sends_the_graphs_waiting_in_its_pool_to_a_new_one(rt, recwarn):
    a = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    b = Graphed(SyncsInCapture(rt), rt, num_warmup_steps=0)
    x = nofw.randn(2, 4, requires_grad=True)
    nofw.backward(b(a(x)).sum())  # recorded: a.f b.f b.b a.b
    # a's forward was captured, b's failed: the pool takes no more captures (as a real
    # allocator's would not), so a's position is dropped instead of failing at its backward
    with pytest.raises(CaptureError, match="test:SyncsInCapture: capturing the forward failed") as err:
        a(x)
    assert not [w for w in recwarn if "another capture failed" in str(w.message)]  # a's backward was not tried
    assert isinstance(err.value.__cause__, RuntimeError)
    assert a.engine.captures == 1 and a.engine.graph_count() == 0 and a.engine.in_flight == 0
    assert b.engine.graph_count() == 0 and b.engine.in_flight == 0
    assert len(rt.poisoned) == 1
    nofw.backward(b(a(x)).sum())  # both recorded again (a at a position it has no graph for)
    assert b.engine.phase() is Phase.RECORD and a.engine.graph_count() == 0 and a.engine.replays == 0


def test_after_a_failed_capture_the_other_layers_are_captured_into_a_new_pool(rt):
    a = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    b = Graphed(SyncsInCapture(rt), rt, num_warmup_steps=0, fallback="eager")
    c = Graphed(Linear(4, 4), rt, num_warmup_steps=0)
    x = nofw.randn(2, 4, requires_grad=True)
    nofw.backward(c(b(a(x))).sum())  # recorded
    with pytest.warns(RuntimeWarning, match="test:SyncsInCapture: capturing the forward failed.*runs eagerly"):
        nofw.backward(c(b(a(x))).sum())  # a dropped with the pool; c captured into a new pool
    assert a.engine.graph_count() == 0 and c.engine.graph_count() == 2 and c.engine.replays == 2
    for _ in range(2):
        nofw.backward(c(b(a(x))).sum())  # a (recorded in the step above) captured into a third pool
    assert a.engine.graph_count() == 2 and a.engine.replays == 4 and b.engine.phase() is Phase.EAGER
    pools = {pos.generation.pool for layer in (a, c) for sig in layer.engine.phases.all()
             for pos in sig.positions.values()}
    assert len(pools) == 2 and not pools & set(rt.poisoned)




def test_release_frames_clears_the_frames_of_the_cause_and_of_the_context_both():
    import gc
    import weakref

    from paddle_graphpp.core.errors import release_frames

    class Held:  # stands in for a failed capture's pool, a local of a frame below the capture
        pass

    refs = []

    def fails(kind):
        held = Held()
        refs.append(weakref.ref(held))
        raise RuntimeError(kind)

    def caught(kind):
        try:
            fails(kind)
        except RuntimeError as exc:
            return exc

    cause = caught("cause")  # outside any handler: it has no context of its own
    try:
        try:
            fails("context")
        except RuntimeError:  # while handling it, an error raised from another one
            raise ValueError("the capture failed") from cause
    except ValueError as err:
        kept = err  # the caller keeps the error, as a test's pytest.raises does
    del cause
    assert str(kept.__cause__) == "cause" and str(kept.__context__) == "context"
    assert kept.__cause__.__context__ is None  # two chains: following the cause alone misses the context
    gc.disable()  # only the frames' locals may hold them, not garbage the collector has yet to see
    try:
        release_frames(kept)
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()
