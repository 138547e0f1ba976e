"""What the engine keeps about one graphed layer: signatures, positions, calls, and how each call ran.

A layer's calls are grouped by input *signature* (:class:`Signature`), each with a
:class:`Phase`. A call (:class:`Call`) lives in the layer's FIFO from its forward to its backward
and records how it ran as one immutable *run* object: :class:`RanEager` (eagerly, maybe recorded
for capture), :class:`Replayed` (its position's forward graph replayed) or :class:`Launched`
(captured and launched in the step, under the stream-ordered allocator). A captured position is
one :class:`Position`, built once after its graphs are captured and never changed; between the
capture of its forward and of its backward the forward's autograd graph is kept as a
:class:`Live`, and between the two halves of a split backward as an :class:`InputHalf`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .tree import unflatten

__all__ = ["Phase", "Tree", "CallShape", "Outputs", "PositionRecord", "Position", "Live", "InputHalf", "Signature",
           "SignatureView", "RanEager", "Replayed", "Launched", "Call", "UserError", "CaptureFailed", "with_layer"]


class Phase(enum.Enum):
    """Where one input signature of a layer stands (see :mod:`paddle_graphpp.core.engine`)."""

    WARMUP = "warmup"
    RECORD = "record"
    READY = "ready"
    EAGER = "eager"  # the scope (Lifecycle.eager_reason) or, in a scope without retry, the signature went eager


@dataclass(frozen=True, slots=True)
class Tree:
    """A nested structure with its tensors taken out: leaves (tensor slots ``None``), tree
    spec, and which leaves are tensors."""

    leaves: tuple
    spec: Any
    tensor_index: tuple

    def rebuild(self, tensors: Sequence[Any]) -> Any:
        """The structure with ``tensors`` put back in their slots."""
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_index, tensors):
            leaves[i] = t
        return unflatten(self.spec, leaves)


@dataclass(frozen=True, slots=True)
class CallShape(Tree):
    """The argument structure of a signature, and its tensors' specs."""

    specs: tuple


@dataclass(frozen=True, slots=True)
class Outputs(Tree):
    """A call's output structure, and which of its tensors carry a gradient."""

    differentiable: tuple


@dataclass(frozen=True, slots=True)
class PositionRecord:
    """What capturing one recorded position needs, kept without the eager tensors: its static
    buffers as slots of the episode's :class:`~paddle_graphpp.core.recording.Recording` and its
    output structure."""

    input_slots: tuple  # a slot index, or a recording.Link to the tensor's producer
    outputs: Outputs
    grad_slots: Optional[tuple] = None  # set when its backward is recorded
    grad_specs: Optional[tuple] = None


@dataclass(frozen=True, slots=True)
class Position:
    """The graphs of one (signature, position) and their static buffers. Built once, after
    its graphs are captured; never changed."""

    generation: Any
    fwd_graph: Any
    bwd_graph: Any
    static_inputs: tuple
    static_outputs: tuple  # detached aliases of the forward graph's outputs
    static_grad_outputs: tuple
    static_grad_inputs: tuple  # one per tensor input (None: no gradient)
    param_grad_used: tuple  # per parameter: does the backward graph produce its gradient
    outputs: Outputs
    accumulate: bool
    keepalive: Any = None  # stream-ordered allocator: the forward capture's tensors (see in_step)
    # Inputs whose static tensor is another position's static output (a recorded link): their
    # index and alias key. A replay is only right when the call passes exactly that tensor.
    linked: tuple = ()
    state: Any = None  # the layer's parameters and buffers the graphs read (core.state.StateWatch)
    # Split backward (zero-bubble schedules): bwd_graph is the input half, weight_graph the
    # weight half, which writes the gradients of the parameters marked in param_grad_used into
    # weight_buffers; input_param_used marks those the input half wrote into the layer's
    # parameter-gradient buffers (handed to autograd with the input gradients).
    weight_graph: Any = None
    weight_buffers: tuple = ()
    input_param_used: tuple = ()
    # Per output: the tensor owning its memory where static_outputs holds an alias that does not
    # (an output the recorded step freed within the episode), until its release point in the
    # capture order sets it to None (core.batch); None where static_outputs owns it
    owned: Any = ()
    # recompute=True: the forward graph kept no activations; the backward graph runs the forward
    # again, drawing from the layer's RNG mirrors (set from the forward replay's note first)
    recomputes: bool = False


@dataclass(frozen=True, slots=True)
class Live:
    """A captured forward's autograd graph, held until its backward is captured."""

    generation: Any
    graph: Any
    static_inputs: tuple
    inputs: list
    outputs: list
    params: list
    outputs_shape: Outputs
    linked: tuple = ()  # see Position.linked
    state: Any = None  # see Position.state
    static_outputs: tuple = ()  # see Position.static_outputs
    owned: Any = ()  # see Position.owned
    recomputes: bool = False  # see Position.recomputes: ``inputs``/``outputs`` carry no autograd graph


@dataclass(frozen=True, slots=True)
class InputHalf:
    """A captured input half (B) of a split backward, held until its weight half is captured."""

    live: Live
    graph: Any
    static_grads: tuple
    static_grad_inputs: tuple
    weight_state: Any  # the runtime's backward_input state: what the weight half needs
    param_used: tuple = ()  # per parameter: did the input half write its gradient (see Position)

    @property
    def generation(self) -> Any:
        return self.live.generation


class Signature:
    """One input signature of a layer: its phase, parameters and captured positions (its phase
    changes only through :class:`~paddle_graphpp.core.lifecycle.Lifecycle`)."""

    __slots__ = ("key", "describe", "shape", "phase", "warm", "params", "accumulate", "positions",
                 "recordings", "busy", "graph", "eager_reason")

    def __init__(self, key: Any, describe: str, shape: CallShape):
        self.key = key
        self.describe = describe
        self.shape = shape
        self.phase = Phase.WARMUP
        self.warm = 0
        self.params: Optional[tuple] = None  # fixed when the signature leaves warmup
        self.accumulate = False
        self.positions: dict[int, Position] = {}
        self.recordings: dict[int, PositionRecord] = {}
        self.busy: set = set()  # per_graph mode: slots whose backward has not run
        self.graph: Any = None  # a scope with one graph per signature (a step, a graph_process slot): that graph
        self.eager_reason: Optional[str] = None  # a scope without retry: why this signature runs eagerly for good

    def free_slot(self) -> int:
        """Lowest slot not in flight: ``per_graph`` recycles a position once its backward ran."""
        slot = 0
        while slot in self.busy:
            slot += 1
        return slot

    def reset(self) -> None:
        """Forget graphs and recordings and warm up again (see :class:`~paddle_graphpp.core.lifecycle.Lifecycle`)."""
        self.phase, self.warm, self.graph, self.eager_reason = Phase.WARMUP, 0, None, None
        self.positions.clear()
        self.recordings.clear()

    def view(self, phase: Phase) -> "SignatureView":
        """A copy for inspection, showing ``phase`` (the layer's ``EAGER`` overrides the signature's own)."""
        return SignatureView(self.key, self.describe, phase, self.accumulate, dict(self.positions))


@dataclass(frozen=True, slots=True)
class SignatureView:
    """What a signature holds, for inspection (a copy: changing it changes nothing)."""

    key: Any
    describe: str
    phase: Phase
    accumulate: bool
    positions: dict


# ------------------------------------------------------------------ how a call ran
@dataclass(frozen=True, slots=True)
class RanEager:
    """The call ran eagerly: its autograd graph over ``inputs`` (detached aliases of the call's
    inputs) and ``params`` (aliases of the parameters) to ``outputs``. ``recorded``: recorded
    for capture at the next episode start. ``weight_state``: an eager split backward's state
    between its input half and its weight half (``outputs`` are dropped by then)."""

    inputs: Sequence[Any]
    outputs: Optional[Sequence[Any]]
    params: Sequence[Any]
    recorded: bool = False
    weight_state: Any = None


@dataclass(frozen=True, slots=True)
class Replayed:
    """The call replayed ``position``'s forward graph; ``rng``: where the generators stood for
    it, when the position recomputes (:meth:`~paddle_graphpp.core.runtime.RngMirror.note`)."""

    position: Position
    rng: Any = None


@dataclass(frozen=True, slots=True)
class Launched:
    """Stream-ordered allocator: the call's forward was captured this step and launched; its
    backward is captured from ``live`` (``None`` once it was)."""

    live: Optional[Live]


ENDED = RanEager((), None, ())  # a call whose backward is over keeps no tensor


class Call:
    """One forward call and, later, its backward: a record of the call (the engine that made it
    runs both; see :func:`~paddle_graphpp.core.engine.node_forward`). Lives in the layer's FIFO
    in between."""

    __slots__ = ("engine", "key", "shape", "tensors", "params", "force_eager", "position", "run", "outputs", "anchor")

    def __init__(self, engine: Any, key: Any, shape: CallShape, tensors: list, params: tuple,
                 force_eager: bool):
        self.engine = engine
        self.key = key
        self.shape = shape
        self.tensors = tensors
        self.params = params
        self.force_eager = force_eager
        self.position = -1
        self.run: Any = None  # RanEager, Replayed or Launched, once the forward ran
        self.outputs: Optional[Outputs] = None
        self.anchor: Any = None  # set by a runtime: keeps the call's autograd node alive until its backward is over

    @property
    def differentiable(self) -> tuple:
        return self.outputs.differentiable

    @property
    def recorded(self) -> bool:
        return isinstance(self.run, RanEager) and self.run.recorded

    def end(self) -> None:
        """The call's backward is over: it keeps no tensor. (Its autograd node keeps the call,
        and the node lives as long as anyone holds the call's outputs: the inputs, often
        another graphed layer's outputs, would be held with them.)"""
        self.tensors = ()
        if isinstance(self.run, RanEager):
            self.run = ENDED


# ------------------------------------------------------------------ capture failures
class UserError(Exception):
    """Wraps an exception raised by the layer's own code during a capture."""

    def __init__(self, phase: str, error: BaseException):
        super().__init__(phase)
        self.phase = phase
        self.error = error


class CaptureFailed(Exception):
    """Wraps a failure of capture itself."""

    def __init__(self, phase: str, error: BaseException, generation: Any):
        super().__init__(phase)
        self.phase = phase
        self.error = error
        self.generation = generation


def with_layer(error: BaseException, context: str) -> BaseException:
    """``error``'s type with the layer named, chained to ``error``; the original (with a
    note) where the type cannot be rebuilt from a message."""
    try:
        new = type(error)(f"{context}: {error}")
    except Exception:  # noqa: BLE001 - a constructor that wants other arguments
        error.add_note(context)
        return error
    new.__cause__ = error
    return new
