"""The process's replay watchdog, configured from its flags and the runtime, at first use.

:class:`ReplayWatch` is the one place that decides whether the process's replays are followed
by a :class:`~paddle_graphpp.core.watchdog.ReplayWatchdog` (and with which timeout), tells the
other ranks when a capture of this process failed, and raises in the main thread what the
watchdog found or what a custom all-reduce that gave up on a peer reported.

Flags (read at first use, and again at each :meth:`ReplayWatch.watch` without a timeout):
``FLAGS_graphpp_replay_timeout`` (seconds; 0: off; default: the runtime's, the process group's
timeout where a group of several ranks exists) and ``FLAGS_graphpp_capture_agreement`` (default
on: where several ranks exist, a peer's failed capture becomes an error here too).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

from . import collectives as _collectives
from .errors import CollectiveTimeoutError
from .flags import env_flag
from .runtime import ReplayEvents
from .watchdog import ReplayWatchdog, parse_timeout

if TYPE_CHECKING:
    from .participant import CaptureParticipant

__all__ = ["ReplayWatch"]

_UNRESOLVED = object()  # the watchdog is decided at first use


class ReplayWatch:
    """The replay watchdog of one runtime's process (``events``: the runtime's
    :class:`~paddle_graphpp.core.runtime.ReplayEvents`, or ``None``: no watchdog)."""

    def __init__(self, events: Optional[ReplayEvents]):
        self.events = events
        self._watchdog: Any = _UNRESOLVED  # a ReplayWatchdog, None, or not decided yet
        self._published_failure = False  # this process told its peers a capture failed: it stops anyway

    @property
    def watchdog(self) -> Optional[ReplayWatchdog]:
        """The replay watchdog (:mod:`paddle_graphpp.core.watchdog`), decided at first use from
        the flags (see the module docstring)."""
        if self._watchdog is _UNRESOLVED:
            self._watchdog = None
            self.watch()
        return self._watchdog

    def watch(self, timeout: Any = _UNRESOLVED, *, grace: float = 30.0) -> Optional[ReplayWatchdog]:
        """(Re)configure the watchdog: ``timeout`` seconds (``None`` or 0: replays are not timed;
        default: the flag, else the runtime's default). Returns the watchdog, or ``None``.

        Raises:
            ValueError: a negative, NaN or non-numeric timeout (or flag).
        """
        events = self.events
        if self._watchdog not in (None, _UNRESOLVED):
            self._watchdog.stop()
        self._watchdog = None
        if events is None:
            return None
        distributed = events.default_replay_timeout()
        if timeout is _UNRESOLVED:
            flag = os.environ.get("FLAGS_graphpp_replay_timeout")
            timeout = parse_timeout(flag, "FLAGS_graphpp_replay_timeout") if flag is not None else distributed
        else:
            timeout = parse_timeout(timeout, "watch_replays(timeout)")
        agree = distributed is not None and env_flag("FLAGS_graphpp_capture_agreement", True)
        if timeout is None and not agree:
            return None
        self._watchdog = ReplayWatchdog(events, timeout if timeout is not None else float("inf"), grace=grace,
                                        peer_failure=self._peer_failure if agree else None,
                                        faults=_collectives.collective_fault)
        return self._watchdog

    def _peer_failure(self) -> Optional[str]:
        """A peer's published capture failure (the watchdog's thread asks), unless this process
        published one of its own (its own error reaches its user)."""
        return None if self._published_failure else self.events.peer_capture_failure()

    def launched(self, participant: "CaptureParticipant", position: int, kind: str, graph: Any) -> None:
        """A graph of ``participant`` was replayed: the watchdog follows it."""
        watchdog = self.watchdog
        if watchdog is not None:
            watchdog.launched(lambda: _describe_graph(participant, position, kind, graph))

    def check(self) -> None:
        """Raise the watchdog's error, if it has one, in the calling (main) thread; and a custom
        all-reduce's give-up (:func:`~paddle_graphpp.core.collectives.collective_fault`), asked
        here too, so that it raises without a watchdog and without its thread's delay."""
        watchdog = self._watchdog
        if watchdog is not None and watchdog is not _UNRESOLVED:
            watchdog.raise_pending()
        fault = _collectives.collective_fault()
        if fault is not None:
            raise CollectiveTimeoutError(fault)

    def publish_failure(self, error: BaseException) -> None:
        """A capture of this process failed and its error reaches the user: where a watchdog
        follows peers, tell them (their watchdogs raise it), and stop listening for theirs."""
        if self.events is not None and self.watchdog is not None:
            self._published_failure = True
            self.events.publish_capture_failure(f"{type(error).__name__}: {error}"[:500])


def _describe_graph(participant: "CaptureParticipant", position: int, kind: str, graph: Any) -> str:
    found = _collectives.collectives_in(graph)
    held = f"captured with {', '.join(found)}" if found else "no collective recorded in its capture"
    return f"the {kind} graph of {participant.name} (micro-batch position {position}; {held})"
