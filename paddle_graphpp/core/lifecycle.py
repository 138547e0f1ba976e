"""A graph per signature: the one lifecycle of every graphed scope, and its one key function.

Every scope that graphs calls (a layer's :class:`~paddle_graphpp.core.engine.GraphedCallable`, a
whole step's ``GraphedStep``, a :func:`~paddle_graphpp.graph_process` slot) keys each call with
:func:`signature_key` and keeps one :class:`Lifecycle`: its signatures, at most ``max_signatures``
(one warning past that), each in phase ``WARMUP``, ``RECORD`` or ``READY``, the scope's one
``EAGER`` state, its capture and replay counts, and the one report of a failed capture
(:class:`~paddle_graphpp.CaptureError`, or ``fallback="eager"`` and one
:class:`~paddle_graphpp.CaptureFallbackWarning`). A signature changes phase only through the
lifecycle's transitions; docs/architecture.md has their table.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from .errors import CaptureError, CaptureFallbackWarning
from .records import Phase, Signature, SignatureView
from .warn import warn

__all__ = ["Lifecycle", "SignatureKey", "signature_key", "describe"]

logger = logging.getLogger("paddle_graphpp")


# ------------------------------------------------------------------ the key
class SignatureKey(tuple):
    """A signature's key: a tuple that hashes its parts once. A graphed call's key goes into
    several tables on every call (its signature, its queue position, the outputs it handed
    out); a plain tuple of tensor specs would be hashed anew each time. A scope gives every
    call of a known signature the signature's own key object, so those lookups also compare
    by identity. Parts: the tensors' parts, the other leaves, the argument structure, then the
    scope's ``context`` parts."""

    def __new__(cls, parts):
        self = super().__new__(cls, parts)
        self._hash = tuple.__hash__(self)
        return self

    def __hash__(self):
        return self._hash

    def __reduce__(self):  # hashed anew where it is loaded (string hashes differ per process)
        return SignatureKey, (tuple(self),)

    @property
    def recompute(self) -> bool:
        """Whether the signature's calls recompute their forward in the backward (a layer's last
        context part)."""
        return len(self) > 4 and bool(self[4])


def _const_key(x):
    try:
        hash(x)
        return (type(x).__name__, x)
    except TypeError:
        return (type(x).__name__, repr(x))


def signature_key(runtime: Any, leaves: Sequence[Any], spec: Any, *, context: tuple = (),
                  by_address: bool = False) -> tuple:
    """The key of a call whose arguments flatten to ``leaves`` (tree ``spec``):
    ``(SignatureKey, tensor_index, tensor_parts)``.

    A tensor leaf contributes its :class:`~paddle_graphpp.core.runtime.TensorSpec` (shape, dtype,
    device, requires-grad): its values are copied into the graph's static buffers at each call.
    With ``by_address`` it contributes its address, shape and dtype instead: the graph reads the
    tensor where it lies (``graph_process``). Any other leaf contributes itself (by value where it
    is hashable, else its ``repr``); ``context`` adds what the scope's graphs also depend on
    (train/eval mode, autocast, which parameters train)."""
    is_tensor = runtime.is_tensor
    tensor_index = [i for i, x in enumerate(leaves) if is_tensor(x)]
    if by_address:
        parts = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in (leaves[i] for i in tensor_index))
    else:
        parts = tuple(runtime.spec(leaves[i]) for i in tensor_index)
    slots = set(tensor_index)
    consts = tuple(_const_key(x) for i, x in enumerate(leaves) if i not in slots)
    return SignatureKey((parts, consts, spec, *context)), tensor_index, parts


def describe(specs: Sequence[Any]) -> str:
    return "(" + "; ".join(s.describe() for s in specs) + ")"


# ------------------------------------------------------------------ the lifecycle
class Lifecycle:
    """The signatures of one graphed scope, named ``name`` in messages (``noun`` says what it is:
    "the layer", "the step"), and the only code that moves them.

    ``num_warmup_steps`` eager calls precede a signature's capture. A failed capture raises
    :class:`~paddle_graphpp.CaptureError` (``fallback="error"``) after which the signature warms up
    again (``retry``: a layer's capture can fail for a passing reason, such as memory) or runs
    eagerly from then on (a whole step, whose host reads do not pass); or it turns the scope eager
    for good with one :class:`~paddle_graphpp.CaptureFallbackWarning` (``fallback="eager"``).
    ``captures`` and ``replays`` count graphs captured and launched."""

    def __init__(self, name: str, *, max_signatures: int, num_warmup_steps: int, fallback: str,
                 noun: str = "the layer", retry: bool = True):
        self.name = name
        self.noun = noun
        self.retry = retry
        self.max_signatures = max_signatures
        self.num_warmup_steps = num_warmup_steps
        self.fallback = fallback
        self._table: dict[Any, Signature] = {}
        self._warned: set = set()
        self._credited = 0  # eager calls made outside the engine, for the first signature (credit_warmup)
        #: Why the scope runs eagerly for good (phase ``EAGER``), or ``None``.
        self.eager_reason: Optional[str] = None
        self.captures = 0
        self.replays = 0

    # ------------------------------------------------------------ the table
    def get(self, key: Any) -> Optional[Signature]:
        """The signature ``key``, or ``None``."""
        return self._table.get(key)

    def all(self) -> list:
        """Every signature, in the order they were first seen."""
        return list(self._table.values())

    def add(self, key: Any, shape: Any) -> Optional[Signature]:
        """The signature ``key`` (its arguments' ``shape``, a
        :class:`~paddle_graphpp.core.records.CallShape`, or ``None`` for a scope that reads its
        tensors where they lie), new in phase ``WARMUP`` if unseen;
        ``None`` (with one warning) when ``max_signatures`` are taken."""
        sig = self._table.get(key)
        if sig is not None:
            return sig
        text = describe(shape.specs) if shape is not None else "(by address)"
        if self.full():
            self.warn_once(("full", key), f"{self.name}: input signature {text} is new and "
                                          f"{self.max_signatures} signatures are already captured "
                                          f"(max_signatures); it runs eagerly. Pad inputs to a few fixed "
                                          f"shapes, or raise max_signatures.")
            return None
        if self._table:
            logger.info("%s: new input signature %s; it will be warmed up and captured anew", self.name, text)
        sig = self._table[key] = Signature(key, text, shape)
        sig.warm, self._credited = self._credited, 0
        return sig

    def credit_warmup(self, calls: int) -> None:
        """``calls`` eager training calls of the scope ran outside the engine (a block graphed in
        parts runs its parts as their own code in the call that judges them): the scope's first
        signature counts them as warmup calls already made. Ignored once the scope has a signature;
        :meth:`reset` and :meth:`fall_back` drop it. A part judged in its block's first training
        call then captures in the same episode as the blocks graphed whole beside it, with the same
        ``num_warmup_steps`` (1 or more), so that they share one pool generation."""
        if not self._table:
            self._credited = calls

    def full(self) -> bool:
        """Whether a new signature would pass ``max_signatures``."""
        return len(self._table) >= self.max_signatures

    def warmed(self, sig: Signature) -> bool:
        """Whether ``sig`` ran its ``num_warmup_steps`` eager calls."""
        return sig.warm >= self.num_warmup_steps

    # ------------------------------------------------------------ transitions
    def leave_warmup(self, sig: Signature, params: tuple = (), accumulate: bool = False, *, in_step: bool) -> None:
        """``WARMUP -> RECORD``: the signature's parameters and gradient path are fixed, and it is
        recorded from this episode on; ``in_step``: ``-> READY``, captured in the call it runs in."""
        sig.params, sig.accumulate = params, accumulate
        sig.phase = Phase.READY if in_step else Phase.RECORD

    def captured(self) -> None:
        """``RECORD -> READY``: the batch that captured the recording is over; recorded
        positions replay from now on."""
        for sig in self._table.values():
            sig.recordings.clear()
            if sig.phase is Phase.RECORD:
                sig.phase = Phase.READY

    def dropped(self) -> None:
        """The recording is not captured (the runtime asked to wait): the signatures stay in
        ``RECORD`` and the next episode is recorded instead."""
        for sig in self._table.values():
            sig.recordings.clear()

    def capture_failed(self, key: Any, what: str, cause: BaseException, hint: str, *,
                       cause_text: Optional[str] = None, instead: bool = False) -> Optional[CaptureError]:
        """Capturing ``what`` ("the forward", "the step") of signature ``key`` failed with ``cause``
        (told as ``cause_text``, by default its type and message): the signature forgets its graphs.
        Returns the :class:`~paddle_graphpp.CaptureError` to raise (the signature warms up again, or
        without ``retry`` runs eagerly from now on), or ``None`` when ``fallback="eager"`` turned
        the scope eager for good (one :class:`~paddle_graphpp.CaptureFallbackWarning`). With
        ``instead``, ``hint`` says the other way the front door takes (``EngineHooks.another_way``):
        the scope runs eagerly until then, whatever ``fallback`` says, with one such warning."""
        self.warm_up_again(key)
        text = cause_text or f"{type(cause).__name__}: {cause}"
        if instead:
            self.fall_back(f"capturing {what} failed: {text}")
            self.warn_once("instead", f"{self.name}: capturing {what} failed ({text}); {hint}", CaptureFallbackWarning)
            self._warned.add("unavailable")  # its eager calls until then say nothing more
            return None
        if self.fallback == "eager":
            self.fall_back(f"capturing {what} failed: {text}")
            self.warn_once("fallback", f"{self.name}: capturing {what} failed ({text}); {self.noun} runs eagerly "
                                       f"from now on (fallback='eager'). {hint}", CaptureFallbackWarning)
            return None
        then = f"{self.noun} warms up again"
        sig = self._table.get(key)
        if not self.retry and sig is not None:
            sig.eager_reason = f"capturing {what} failed ({text})"
            then = f"{self.noun} runs eagerly from now on for these arguments"
        error = CaptureError(f"{self.name}: capturing {what} failed: {text}. The capture's memory was released; "
                             f"{then}. {hint}")
        error.__cause__ = cause
        return error

    def warm_up_again(self, key: Any) -> None:
        """Signature ``key`` forgets its graphs and warms up again (its capture was interrupted,
        or the scope's own code raised in it)."""
        sig = self._table.get(key)
        if sig is not None:
            sig.reset()

    def fall_back(self, reason: str) -> None:
        """The scope runs eagerly from now on (``EAGER``), every signature's graphs forgotten."""
        self.eager_reason = reason
        self._credited = 0
        for sig in self._table.values():
            sig.reset()

    def forget(self, key: Any) -> None:
        """Forget signature ``key`` and its graphs (a call may bring it back, to warm up anew)."""
        self._table.pop(key, None)

    def reset(self) -> None:
        """Forget every signature (and ``EAGER``): the scope starts as newly made."""
        self._table.clear()
        self._credited = 0
        self.eager_reason = None
        self._warned.clear()

    def drop_generation(self, gen: Any) -> None:
        """Forget the positions captured into pool generation ``gen`` (they are recorded again
        when they run; their signatures stay ``READY``)."""
        for sig in self._table.values():
            for pos in [p for p, done in sig.positions.items() if done.generation is gen]:
                del sig.positions[pos]

    # ------------------------------------------------------------ reporting
    def warn_once(self, key: Any, message: str, category: type = RuntimeWarning) -> None:
        """One warning per ``key`` (until :meth:`reset`), at the user's line."""
        if key not in self._warned:
            self._warned.add(key)
            warn(message, category)

    # ------------------------------------------------------------ reading
    def phase(self, key: Any = None) -> Optional[Phase]:
        """The phase of signature ``key`` (default: the only signature), or ``None``; ``EAGER``
        once the scope went eager for good."""
        if self.eager_reason is not None and (key is None or key in self._table):
            return Phase.EAGER
        if key is None:
            if len(self._table) != 1:
                return None
            key = next(iter(self._table))
        sig = self._table.get(key)
        if sig is None:
            return None
        return Phase.EAGER if sig.eager_reason is not None else sig.phase

    def views(self) -> dict[Any, SignatureView]:
        """``{key: SignatureView}`` (copies, for inspection)."""
        eager = self.eager_reason is not None
        return {key: sig.view(Phase.EAGER if eager or sig.eager_reason is not None else sig.phase)
                for key, sig in self._table.items()}

    def positions(self) -> list:
        """Every captured position, by signature in the order they were first seen, then by position."""
        return [sig.positions[p] for sig in self._table.values() for p in sorted(sig.positions)]

    def accumulates(self, param: Any) -> bool:
        """Whether a signature past warmup that accumulates holds ``param`` (the scope not eager)."""
        return self.eager_reason is None and any(
            sig.accumulate and any(q is param for q in sig.params or ()) for sig in self._table.values())
