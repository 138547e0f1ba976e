"""Under the stream-ordered allocator (cudaMallocAsync): capture a position in the step it first runs in.

Graph memory exists only once a graph has run, so nothing is recorded for a later batch: a
signature goes from warmup straight to ready, and each new position's forward is captured over
a copy of the call's inputs and launched (its launch gives the call's results); its backward is
captured and launched in the same way when the call's backward comes.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import TYPE_CHECKING, Any, Optional

from .errors import CaptureError
from .records import Call, Launched, Signature
from .runtime import clone_many

if TYPE_CHECKING:
    from .engine import GraphedCallable

__all__ = ["InStepCapture"]


class InStepCapture:
    """The stream-ordered allocator's path of one :class:`~paddle_graphpp.core.engine.GraphedCallable`."""

    def __init__(self, layer: GraphedCallable):
        self.layer = layer

    def forward(self, call: Call, sig: Signature) -> list:
        """Capture this position's forward and launch the capture; the call's outputs."""
        layer, rt = self.layer, self.layer.runtime
        static_inputs = clone_many(rt, call.tensors)  # before capture: a later copy would bump versions
        try:
            live = layer.capture.capture_forward(sig, static_inputs, None)
        except BaseException as exc:  # noqa: BLE001
            error = self._failed(call.key, exc)
            if error is not None:
                raise error from None
            return layer.run_eager(call)  # fallback="eager"
        call.outputs = live.outputs_shape
        layer.plan.note_replay(live.generation, id(live.graph), True, layer.name)
        layer.replay.keep_held_outputs(call)
        layer.replay.launch(call, live.graph, "forward")
        call.run = Launched(live)
        return layer.replay.hand_out(call, live.outputs)

    def backward(self, call: Call, sig: Signature, diff_grads: list) -> list:
        """Capture the backward of the forward launched this step, then replay it."""
        layer, rt = self.layer, self.layer.runtime
        live, call.run = call.run.live, Launched(None)
        static_grads = [rt.static_like(g) for g in diff_grads]
        try:
            done = layer.capture.capture_backward(sig, live, static_grads)
        except BaseException as exc:  # noqa: BLE001
            error = self._failed(call.key, exc)
            raise (error or CaptureError(
                f"{layer.name}: capturing the backward failed under the stream-ordered allocator, where no "
                f"eager run stands beside the capture; the layer runs eagerly from the next call on.")) from None
        # The capture's own launches allocated its saved tensors; the graphs are instantiated
        # to free them on relaunch. Keep the tensors referenced so they are not freed twice.
        sig.positions[call.position] = dataclasses.replace(done, keepalive=live)
        return layer.backward.replay(call, done, diff_grads)

    def _failed(self, key: Any, exc: BaseException) -> Optional[BaseException]:
        error = self.layer.capture.failed(key, exc)
        exc = None  # drop the traceback's frames: they hold the capture's tensors
        gc.collect()
        self.layer.runtime.release_cached_memory()
        return error
