"""The FIFO of in-flight micro-batches of one graphed layer, and the process's episode clock.

:class:`InFlightQueue` pairs each backward with the oldest forward still waiting and gives each
forward its position in the episode (per layer and input signature); a backward out of that order,
with no forward waiting, or past ``max_in_flight`` forwards raises
:class:`~paddle_graphpp.core.errors.GraphScheduleError` naming the layer and the fix. Under a
zero-bubble schedule a micro-batch stays in flight until its weight half has run, in any order
among those pending. :class:`EpisodeClock` counts the micro-batches in flight in every graphed
layer of the process: an episode ends when none is. Why episodes and positions:
docs/architecture.md#episodes-recordings-and-handed-out-outputs.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Hashable, Optional

from .errors import GraphScheduleError

__all__ = ["InFlightQueue", "EpisodeClock"]


class InFlightQueue:
    """FIFO pairing of forwards and backwards, with episode positions.

    Args:
        owner: the layer's name, for messages.
        max_in_flight: how many forwards may wait for their backward before it is an error.
    """

    def __init__(self, owner: str, max_in_flight: int):
        if max_in_flight < 1:
            raise ValueError(f"{owner}: max_in_flight must be >= 1, got {max_in_flight}")
        self.owner = owner
        self.max_in_flight = max_in_flight
        self._pending: deque = deque()
        self._awaiting_weight: list = []  # B ran, W not yet (zero-bubble schedules)
        self._positions: dict[Hashable, int] = {}
        self._episode = 0
        self.episodes = 0

    def __len__(self) -> int:
        return len(self._pending) + len(self._awaiting_weight)

    @property
    def episode(self) -> int:
        """The number of the episode this queue's positions count in."""
        return self._episode

    @property
    def at_episode_start(self) -> bool:
        """True when nothing is in flight: the next forward starts an episode."""
        return not self._pending and not self._awaiting_weight

    def push(self, record: Any, key: Hashable, episode: Optional[int] = None) -> int:
        """Enqueue a forward; returns its position. Raises when too many are in flight.

        ``episode`` is the process-wide episode number: positions restart when it changes.
        By default an episode starts whenever this queue is empty.
        """
        if len(self) >= self.max_in_flight:
            waiting = (f" ({len(self._awaiting_weight)} of them ran the input-gradient half of their backward "
                       f"and wait for the weight-gradient half: a backward that asks for input gradients only "
                       f"leaves that half to a later pass, as zero-bubble schedules' stage_backward_weight does)"
                       if self._awaiting_weight else "")
            raise GraphScheduleError(
                f"{self.owner}: {len(self)} forwards are waiting for their backward{waiting}, the "
                f"limit is max_in_flight={self.max_in_flight}. Run backward for each micro-batch "
                f"(inference belongs under no_grad, which runs eagerly), call paddle_graphpp.drop_in_flight"
                f"(model) after a step that raised before its backwards, or raise max_in_flight if "
                f"your schedule really keeps this many micro-batches in flight."
            )
        if episode is None:
            episode = self._episode + self.at_episode_start
        if episode != self._episode:
            self._episode = episode
            self._positions.clear()
            self.episodes += 1
        position = self._positions.get(key, 0)
        self._positions[key] = position + 1
        self._pending.append(record)
        return position

    def pop(self, record: Any, *, weight_later: bool = False) -> None:
        """Dequeue ``record`` for its backward; it must be the oldest forward in flight. With
        ``weight_later`` the backward is the input-gradient half: ``record`` stays in flight
        until :meth:`pop_weight`."""
        if not self._pending:
            raise GraphScheduleError(
                f"{self.owner}: a backward arrived with no forward in flight (a second backward "
                f"through the same outputs, or retain_graph=True?). Each forward's outputs may be "
                f"back-propagated once."
            )
        head = self._pending[0]
        if head is not record:
            ahead = next((i for i, r in enumerate(self._pending) if r is record), None)
            where = "is not in flight (already back-propagated, or dropped by drop_in_flight)" if ahead is None else (
                f"is number {ahead + 1} in flight")
            raise GraphScheduleError(
                f"{self.owner}: backwards must run in the order of their forwards (FIFO, as 1F1B and "
                f"interleaved schedules do), but this backward's forward {where}, while the oldest "
                f"forward still waits. Run the backward of the oldest micro-batch first; if a step raised "
                f"between forwards and their backwards, call paddle_graphpp.drop_in_flight(model) before "
                f"the next step."
            )
        self._pending.popleft()
        if weight_later:
            self._awaiting_weight.append(record)

    def awaits_weight(self, record: Any) -> bool:
        """True when ``record``'s input-gradient half ran and its weight-gradient half has not."""
        return any(r is record for r in self._awaiting_weight)

    def pop_weight(self, record: Any) -> None:
        """The weight-gradient half of ``record``'s backward runs: it leaves the flight."""
        for i, r in enumerate(self._awaiting_weight):
            if r is record:
                del self._awaiting_weight[i]
                return
        raise GraphScheduleError(
            f"{self.owner}: the weight-gradient half of a backward was asked for a micro-batch whose "
            f"input-gradient half has not run (or whose weight half already ran). Run the input pass "
            f"(stage_backward_input) of each micro-batch before its weight pass.")

    def drop_all(self) -> list:
        """Forget every micro-batch in flight (their backwards will not run); returns them,
        the ones waiting for their whole backward first."""
        dropped = list(self._pending) + self._awaiting_weight
        self._pending.clear()
        self._awaiting_weight = []
        return dropped

    def discard(self, record: Any) -> None:
        """Remove ``record`` if present (its forward raised before returning)."""
        try:
            self._pending.remove(record)
        except ValueError:
            pass


class EpisodeClock:
    """Process-wide count of micro-batches in flight in any graphed layer, and the episode
    number. One per runtime; every graphed layer of the process reports to it."""

    __slots__ = ("in_flight", "episode")

    def __init__(self):
        self.in_flight = 0
        self.episode = 0

    @property
    def between_episodes(self) -> bool:
        """True when nothing is in flight anywhere: the next forward starts an episode."""
        return self.in_flight == 0

    def forward_started(self) -> int:
        """Count a forward; returns the episode it belongs to."""
        if self.in_flight == 0:
            self.episode += 1
        self.in_flight += 1
        return self.episode

    def forward_done(self) -> None:
        """Its backward ran, or the forward raised before returning."""
        self.in_flight -= 1
