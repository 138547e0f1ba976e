"""The warmup guard: make compiled code trace the branch that will be captured.

Code compiled by Paddle SOT (``paddle.jit.to_static(full_graph=False)``) or ``torch.compile``
specialises on the Python state it reads. A forward that branches on "is this the capture
phase?" (a custom all-reduce does: registered buffer, allocation mimic or copy-in) is safe
while the compilers evaluate their guards, since a changed state recompiles. Production
settings skip that check once a function has hit its cache often enough
(``SOT_UNSAFE_CACHE_FASTPATH=1`` in Paddle, ``torch.compiler.set_stance(
skip_guard_eval_unsafe=True)`` in PyTorch). Code compiled before the capture phase then keeps
its non-capturing branch when the graph is captured, and every replay runs the wrong path:
an illegal address or wrong sums.

The fix (from FastDeploy) is to compile inside the capture phase: the engine runs its
capture under ``sot_warmup_guard(True)``, and forwards wrapped by :func:`compile_in_warmup`
run eagerly until that guard is active, then compile once, in the capture state.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from typing import Any, Callable, Optional

from .process import current_process

__all__ = ["sot_warmup_guard", "in_sot_warmup_mode", "compile_in_warmup", "warmup_epoch"]


class _GuardState(threading.local):
    def __init__(self) -> None:
        self.stack: list[tuple[object, bool]] = []


class WarmupGuards:
    """The guards' state in this process (a part of the process): the warmup epoch, and per
    thread the guards entered."""

    def __init__(self) -> None:
        self.thread = _GuardState()
        self.lock = threading.Lock()
        self.epochs = itertools.count(1)
        self.epoch = 0  # the latest entry into warmup mode from outside it (0: never)


def _guards() -> WarmupGuards:
    return current_process().part(WarmupGuards)


class sot_warmup_guard(contextlib.ContextDecorator):
    """Mark the code inside as the compile warmup of the capture phase (or take the mark off).

    Usable as a context manager (``with sot_warmup_guard(True): ...``) and as a decorator
    (``@sot_warmup_guard(True)`` on a model-capture function). Nesting is safe: the innermost
    guard decides, and leaving it restores the outer state. The state is thread-local, so a
    capture on one thread does not change what another thread compiles.

    Args:
        enabled: ``True`` inside the capture phase's warmup, ``False`` to suspend it (e.g. for
            an eager profiling run nested inside a capture function).

    Ways to break it:
        * Passing something other than a ``bool`` raises ``TypeError`` (``"0"`` would be true).
        * Leaving guards out of order (entering ``a`` then ``b``, exiting ``a`` first) raises
          ``RuntimeError``: use ``with`` blocks rather than calling ``__enter__`` by hand.
        * The guard only marks the phase. Compiled functions follow it only when wrapped by
          :func:`compile_in_warmup` (or when their compiler evaluates guards on every call).
    """

    def __init__(self, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(
                f"sot_warmup_guard(enabled) takes a bool, got {type(enabled).__name__} {enabled!r}")
        self.enabled = enabled

    def __enter__(self) -> "sot_warmup_guard":
        guards = _guards()
        if self.enabled and not in_sot_warmup_mode():
            with guards.lock:
                guards.epoch = next(guards.epochs)
        # The owner in each entry lets __exit__ catch out-of-order exits.
        guards.thread.stack.append((self, self.enabled))
        return self

    def __exit__(self, *exc: Any) -> None:
        stack = _guards().thread.stack
        if not stack or stack[-1][0] is not self:
            raise RuntimeError(
                "sot_warmup_guard: exited out of order on this thread (or never entered); "
                "nest guards with `with` blocks or decorators instead of calling __enter__/__exit__")
        stack.pop()
        return None


def in_sot_warmup_mode() -> bool:
    """True inside the innermost active ``sot_warmup_guard(True)`` of the calling thread."""
    stack = _guards().thread.stack
    return bool(stack) and stack[-1][1]


def warmup_epoch() -> int:
    """A number that changes each time a thread enters warmup mode from outside it (0: never)."""
    return _guards().epoch


class _CompiledInWarmup:
    def __init__(self, fn: Callable, compile: Callable[[Callable], Callable]) -> None:
        self._fn = fn
        self._compile = compile
        self._compiled: Optional[Callable] = None
        self._compiled_epoch = -1
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn)

    @property
    def compiled(self) -> Optional[Callable]:
        """The compiled function, or ``None`` before the first warmup."""
        return self._compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if in_sot_warmup_mode():
            epoch = warmup_epoch()
            with self._lock:
                if self._compiled_epoch != epoch:
                    self._compiled = self._compile(self._fn)
                    self._compiled_epoch = epoch
            return self._compiled(*args, **kwargs)
        if self._compiled is None:
            return self._fn(*args, **kwargs)
        return self._compiled(*args, **kwargs)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        # Bound use as a method: ``forward = compile_in_warmup(forward, compiler)`` in a class body.
        if obj is None:
            return self
        return functools.partial(self.__call__, obj)


def compile_in_warmup(fn: Callable, compile: Callable[[Callable], Callable]) -> Callable:
    """Defer compiling ``fn`` to the capture phase's warmup.

    Outside warmup mode and before any warmup, calls run ``fn`` eagerly (no compilation, so no
    stale branch can be frozen). Inside ``sot_warmup_guard(True)`` the first call of each
    warmup compiles ``compile(fn)`` afresh and runs it; later calls, inside or outside, run
    that compiled function, whose branches were traced in the capture state.

    Args:
        fn: the function or unbound method to compile (e.g. a layer's ``forward``).
        compile: the compiler, e.g. ``lambda f: paddle.jit.to_static(f, full_graph=False)``
            or ``torch.compile``. It must return a new callable each time it is called.

    Ways to break it:
        * Compilers cache by code object (SOT and dynamo both do). If ``fn`` was already
          compiled elsewhere with guard checks skipped, that cached code may be reused:
          compile the forward only through this wrapper.
        * After the warmup, eager calls outside graphs run the code traced for the capture
          phase; that is what a graphed layer replays, but an eager caller that needs the
          non-capturing branch must call ``fn`` itself.
    """
    if not callable(fn) or not callable(compile):
        raise TypeError("compile_in_warmup(fn, compile): both arguments must be callable")
    return _CompiledInWarmup(fn, compile)
