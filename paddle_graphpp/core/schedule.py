"""The FIFO of in-flight micro-batches of one graphed layer.

Pipeline schedules (1F1B, interleaved) run the forwards of micro-batches 1..k before the
backward of micro-batch 1. Each forward pushes a record; each backward must pop the oldest
one. An *episode* runs from a moment when no micro-batch is in flight in *any* graphed layer
of the process to the next such moment (an interleaved stage's chunks each empty their own
FIFO mid-step while the other chunk still holds micro-batches: that is not an episode end).
A forward's *position* is its index within the episode, counted per layer and input
signature. Under a fixed schedule every episode has the same sequence, which is what lets
graphs be captured once in execution order and replayed safely from one shared memory pool.
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
        self._positions: dict[Hashable, int] = {}
        self._episode = 0
        self.episodes = 0

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def episode(self) -> int:
        """The number of the episode this queue's positions count in."""
        return self._episode

    @property
    def at_episode_start(self) -> bool:
        """True when nothing is in flight: the next forward starts an episode."""
        return not self._pending

    def push(self, record: Any, key: Hashable, episode: Optional[int] = None) -> int:
        """Enqueue a forward; returns its position. Raises when too many are in flight.

        ``episode`` is the process-wide episode number: positions restart when it changes.
        By default an episode starts whenever this queue is empty.
        """
        if len(self._pending) >= self.max_in_flight:
            raise GraphScheduleError(
                f"{self.owner}: {len(self._pending)} forwards are waiting for their backward, the "
                f"limit is max_in_flight={self.max_in_flight}. Run backward for each micro-batch "
                f"(inference belongs under no_grad, which runs eagerly), or raise max_in_flight if "
                f"your schedule really keeps this many micro-batches in flight."
            )
        if episode is None:
            episode = self._episode + (not self._pending)
        if episode != self._episode:
            self._episode = episode
            self._positions.clear()
            self.episodes += 1
        position = self._positions.get(key, 0)
        self._positions[key] = position + 1
        self._pending.append(record)
        return position

    def pop(self, record: Any) -> None:
        """Dequeue ``record`` for its backward; it must be the oldest forward in flight."""
        if not self._pending:
            raise GraphScheduleError(
                f"{self.owner}: a backward arrived with no forward in flight (a second backward "
                f"through the same outputs, or retain_graph=True?). Each forward's outputs may be "
                f"back-propagated once."
            )
        head = self._pending[0]
        if head is not record:
            ahead = next((i for i, r in enumerate(self._pending) if r is record), None)
            where = "is not in flight (already back-propagated)" if ahead is None else (
                f"is number {ahead + 1} in flight")
            raise GraphScheduleError(
                f"{self.owner}: backwards must run in the order of their forwards (FIFO, as 1F1B and "
                f"interleaved schedules do), but this backward's forward {where}, while the oldest "
                f"forward still waits. Run the backward of the oldest micro-batch first."
            )
        self._pending.popleft()

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
