"""A watchdog of the host's own for graph replays: no hang without an error.

:class:`ReplayWatchdog` follows one process's replays from a daemon thread (an event after a
replay, at most one every ``min_gap`` seconds). A replay not complete ``timeout`` seconds after its
launch is logged at once, naming the layer, the graph and the collectives captured in it, and
raised as :class:`~paddle_graphpp.core.errors.ReplayTimeoutError` by the next graphed call
(:meth:`ReplayWatchdog.raise_pending`); still stuck ``grace`` seconds later, the runtime aborts its
communicators; another ``grace`` later the process exits with :data:`EXIT_CODE`. The same thread
turns a peer's failed capture
(:meth:`~paddle_graphpp.core.runtime.ReplayEvents.peer_capture_failure`) and a custom all-reduce
that gave up on a peer (:func:`~paddle_graphpp.core.collectives.collective_fault`, raised as
:class:`~paddle_graphpp.core.errors.CollectiveTimeoutError`) into errors here. Why, and the
settings: docs/collectives.md#capture-agreement-and-the-replay-watchdog-pytorch.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

from .errors import CollectiveTimeoutError, ReplayTimeoutError

__all__ = ["ReplayWatchdog", "EXIT_CODE", "parse_timeout"]

logger = logging.getLogger("paddle_graphpp")

EXIT_CODE = 75  # the process stopped because a graph replay (or a peer's capture) never completed
_POLL = 0.05  # seconds between the thread's checks
_PEER_POLL = 1.0  # seconds between two questions about peers' failed captures


def parse_timeout(raw: Any, where: str, what: str = "the replay timeout",
                  zero: str = "to turn the watchdog off") -> Optional[float]:
    """A timeout in seconds from a flag or argument ``where``: ``None``/``0`` give ``None`` (off).
    ``what`` and ``zero`` name the setting and what 0 means in the error.

    Raises:
        ValueError: a negative, NaN or non-numeric value.
    """
    if raw is None:
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{where}={raw!r}: give {what} in seconds (e.g. 600), or 0 {zero}") from None
    if value < 0 or value != value:
        raise ValueError(f"{where}={raw!r}: {what} must be >= 0 seconds (0 {zero})")
    return value or None


_UNFOLLOWED_KEPT = 4  # launches not followed, named (the earliest) with the one that timed out


def _text(what: Any) -> str:
    return what() if callable(what) else what


def _asked(question: Optional[Callable[[], Optional[str]]]) -> Optional[str]:
    """``question()`` from the watchdog's thread; an error in it is logged, not raised (the
    thread must go on timing replays)."""
    if question is None:
        return None
    try:
        return question()
    except Exception:  # noqa: BLE001
        logger.exception("paddle_graphpp: the replay watchdog's check %r failed", question)
        return None


class ReplayWatchdog:
    """Watches the replays of one process (the module docstring says what it does when).

    Args:
        events: the runtime's :class:`~paddle_graphpp.core.runtime.ReplayEvents` capability.
        timeout: seconds a replay may run before it is an error.
        grace: seconds between the error, the abort of the communicators and the exit.
        peer_failure: returns a peer's published capture failure (text), or ``None``.
        faults: returns why a collective cannot go on (a custom all-reduce that gave up on a
            peer: text), or ``None``.
        exit: what ends the process (``os._exit`` by default; tests pass their own).
    """

    def __init__(self, events: Any, timeout: float, *, grace: float = 30.0,
                 peer_failure: Optional[Callable[[], Optional[str]]] = None,
                 faults: Optional[Callable[[], Optional[str]]] = None, min_gap: float = 0.01,
                 exit: Callable[[int], None] = os._exit):
        self.events, self.timeout, self.grace, self.min_gap = events, timeout, grace, min_gap
        self.peer_failure, self.faults = peer_failure, faults
        self._peer_asked = 0.0  # when peer_failure was last called
        self._exit = exit
        # (launch time, event, what, the launches not followed just before it), oldest first
        self._pending: collections.deque = collections.deque()
        self._last = 0.0  # when the last followed launch was recorded
        self._tail: Optional[tuple] = None  # (launch time, recorder, what) of a launch not followed yet
        self._unfollowed: list = []  # what of the first launches not followed since the last followed one
        self._unfollowed_more = 0  # and how many more
        self._lock = threading.Lock()
        self.error: Optional[str] = None  # set once: the process cannot go on after it
        self._error_type: type = ReplayTimeoutError
        self._raised = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paddle_graphpp-replay-watchdog", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ main thread
    def launched(self, what: Any) -> None:
        """After a replay was launched on the current stream: ``what`` (a callable giving the
        description, evaluated only on a timeout) for the graph."""
        now = time.monotonic()
        record = self.events.event_recorder()
        if record is None:
            return
        with self._lock:
            if self._tail is not None:  # the launch before this one was not followed
                self._note_unfollowed(self._tail[2])
            if now - self._last < self.min_gap:
                # Not followed now; the thread records it if no later launch is (see _check).
                self._tail = (now, record, what)
                return
            self._tail = None
            self._last = now
            self._pending.append((now, record(), what, self._take_unfollowed()))

    def _note_unfollowed(self, what: Any) -> None:
        if len(self._unfollowed) < _UNFOLLOWED_KEPT:
            self._unfollowed.append(what)
        else:
            self._unfollowed_more += 1

    def _take_unfollowed(self) -> tuple:
        taken = (self._unfollowed, self._unfollowed_more)
        self._unfollowed, self._unfollowed_more = [], 0
        return taken

    def raise_pending(self) -> None:
        """Raise the watchdog's error in the calling (main) thread, once it has one."""
        if self.error is not None:
            self._raised = True
            raise self._error_type(self.error)

    def stop(self) -> None:
        self._stop.set()

    # --------------------------------------------------------------- thread
    def _run(self) -> None:
        while not self._stop.wait(_POLL):
            if self.error is None and (fault := _asked(self.faults)) is not None:
                # The kernel gave up and returned: raised at the next graphed call, nothing to
                # abort; replays are still timed (something else may hang on the dead peer).
                self._error_type, self.error = CollectiveTimeoutError, fault
                logger.error("%s", fault)
            message = self._check()
            if message is not None:
                self._fail(message)
                return

    def _check(self) -> Optional[str]:
        """The replay timeout's or a peer's failed capture's error to report now, or ``None``."""
        with self._lock:
            tail = self._tail
            if tail is not None and time.monotonic() - self._last >= self.min_gap:
                # The last launch was skipped and nothing launched since: follow it from here (a
                # host that blocks right after it would otherwise wait with nothing pending).
                self._tail, self._last = None, time.monotonic()
                self._pending.append((tail[0], tail[1](), tail[2], self._take_unfollowed()))
            while self._pending and self.events.event_done(self._pending[0][1]):
                self._pending.popleft()
            oldest = self._pending[0] if self._pending else None
        if oldest is not None and time.monotonic() - oldest[0] > self.timeout:
            what = _text(oldest[2])
            # Replays on a stream run in order: the one that hangs may be one launched before it,
            # since the last replay known to have completed; the earliest of them first.
            unfollowed, more = oldest[3]
            before = [_text(w) for w in unfollowed]
            if before:
                what += (f" (or one launched before it, after the last replay known to have completed: "
                         f"{'; '.join(before)}{f'; and {more} more' if more else ''})")
            return (f"paddle_graphpp: {what} has not completed {self.timeout:g} s after its replay was launched. "
                    f"A collective in it waits for a peer that died or stalled, or a kernel hangs. Check the "
                    f"other ranks' logs for the first error; raise the timeout (FLAGS_graphpp_replay_timeout, or "
                    f"the runtime's watch_replays) if the step is that slow.")
        failure = None
        if self.peer_failure is not None and time.monotonic() - self._peer_asked >= _PEER_POLL:
            self._peer_asked = time.monotonic()
            failure = _asked(self.peer_failure)
        if failure is not None:
            return (f"paddle_graphpp: {failure}; this rank stops too instead of waiting in collectives its peer "
                    f"will not join. The cause is in that rank's CaptureError; fallback='eager' on the failing "
                    f"layers keeps every rank training.")
        return None

    def _fail(self, message: str) -> None:
        self._error_type, self.error = ReplayTimeoutError, message
        logger.error("%s", message)
        if self._stop.wait(self.grace) or self._raised:
            return
        aborted = self.events.abort_collectives(message)
        if aborted:
            logger.error("paddle_graphpp: aborted this process's communicators (%s)", aborted)
        if self._stop.wait(self.grace) or self._raised:
            return
        print(f"{message}\npaddle_graphpp: the process is still waiting on the device {2 * self.grace:g} s later; "
              f"exiting with code {EXIT_CODE}.", file=sys.stderr, flush=True)
        self._exit(EXIT_CODE)
