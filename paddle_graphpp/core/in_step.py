"""Under the stream-ordered allocator (cudaMallocAsync): capture a position in the step it first runs in.

Graph memory exists only once a graph has run, so nothing is recorded for a later batch: a
signature goes from warmup straight to ready, and each new position's forward is captured over
a copy of the call's inputs and launched (its launch gives the call's results); its backward is
captured and launched in the same way when the call's backward comes.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any, Optional

from .errors import CaptureError
from .layer import Layer
from .layer_capture import LayerCapture
from .records import Call, Launched, Position, Signature
from .replay import Replays
from .runtime import clone_many

__all__ = ["InStepCapture"]


class InStepCapture:
    """The stream-ordered allocator's path of one graphed ``layer``: its ``capture`` side captures,
    its ``replay`` side launches."""

    def __init__(self, layer: Layer, *, capture: LayerCapture, replay: Replays):
        self.layer = layer
        self.capture = capture
        self.replay = replay

    def forward(self, call: Call, sig: Signature) -> Optional[list]:
        """Capture this position's forward and launch the capture; the call's outputs (``None``:
        the capture failed and ``fallback="eager"`` turned the layer eager; run it eagerly)."""
        layer, rt = self.layer, self.layer.runtime
        static_inputs = clone_many(rt, call.tensors)  # before capture: a later copy would bump versions
        try:
            live = self.capture.capture_forward(sig, static_inputs, None)
        except BaseException as exc:  # noqa: BLE001
            error = self._failed(call.key, exc)
            if error is not None:
                raise error from None
            return None  # fallback="eager"
        call.outputs = live.outputs_shape
        proc = layer.process()
        proc.plan.note_replay(live.generation, id(live.graph), True, layer.name)
        self.replay.keep_held_outputs(call, proc)
        self.replay.launch(call, live.graph, "forward", proc)
        call.run = Launched(live)
        return self.replay.hand_out(call, live.outputs, proc)

    def backward(self, call: Call, sig: Signature, diff_grads: list) -> Position:
        """Capture the backward of the forward launched this step (to be replayed now)."""
        layer, rt = self.layer, self.layer.runtime
        live, call.run = call.run.live, Launched(None)
        static_grads = [rt.static_like(g) for g in diff_grads]
        try:
            done = self.capture.capture_backward(sig, live, static_grads)
        except BaseException as exc:  # noqa: BLE001
            error = self._failed(call.key, exc)
            raise (error or CaptureError(
                f"{layer.name}: capturing the backward failed under the stream-ordered allocator, where no "
                f"eager run stands beside the capture; the layer runs eagerly from the next call on.")) from None
        # The capture's own launches allocated its saved tensors; the graphs are instantiated
        # to free them on relaunch. Keep the tensors referenced so they are not freed twice.
        sig.positions[call.position] = done = dataclasses.replace(done, keepalive=live)
        return done

    def _failed(self, key: Any, exc: BaseException) -> Optional[BaseException]:
        error = self.capture.failed(key, exc)
        exc = None  # drop the traceback's frames: they hold the capture's tensors
        gc.collect()
        self.layer.runtime.release_cached_memory()
        return error
