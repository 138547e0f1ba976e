"""Graph memory: which pool a capture allocates from, the capture-order check, and telemetry.

:class:`MemoryMode` parses ``memory=`` (``"shared"``, the default: every graph of the process in
one pool; ``"per_graph"``: a pool per graph, upstream Paddle's behaviour; ``"shared_reuse"``, a
former name, means ``"shared"``; anything else raises ``ValueError``). :class:`MemoryPlan` (one per
runtime and process, :func:`plan_for`) hands out pools by *generation*, the graphs captured back to
back into one pool, and checks every replay against its generation's capture order
(:class:`~paddle_graphpp.core.errors.GraphScheduleError` where the order changed); a capture after
replays began opens a new generation. Under the stream-ordered allocator no pool is passed and the
figures are the driver's. :func:`memory_report` returns the figures. Why this is safe and what it
saves: docs/memory.md.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Any, Optional

from .errors import GraphScheduleError
from .process import current_process
from .runtime import capabilities

__all__ = ["MemoryMode", "MemoryPlan", "memory_report", "plan_for"]

logger = logging.getLogger("paddle_graphpp")


class MemoryMode(str, enum.Enum):
    """How graphs of a layer share memory (docs/memory.md#memory-modes)."""

    SHARED = "shared"
    PER_GRAPH = "per_graph"

    @classmethod
    def parse(cls, value: Any, owner: str = "graphed layer") -> "MemoryMode":
        if isinstance(value, cls):
            return value
        if value == "shared_reuse":  # the former name of shared's buffer sharing, now always on
            return cls.SHARED
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"{owner}: memory={value!r} is not a memory mode; choose one of {choices}") from None


class _Generation:
    """Graphs captured back to back into one pool, and the order they were captured in."""

    def __init__(self, index: int, pool: Any):
        self.index = index
        self.pool = pool
        self.order: dict[int, int] = {}  # graph id -> capture index
        self.sealed = False  # a replay happened: later captures need a new generation
        self.cursor = -1  # capture index of the last graph run
        self.in_flight = 0  # forward graphs whose backward graph has not run yet


class MemoryPlan:
    """Pools, capture order and telemetry for all graphs of one runtime in this process."""

    def __init__(self, runtime):
        self.runtime = runtime
        self._generations: list[_Generation] = []
        self._opened = 0  # generations opened so far (numbers them in logs)
        self.graphs_captured = 0
        self.capture_seconds = 0.0
        self._pending_log = False
        self._per_graph_pools: list = []
        self._async: Optional[bool] = None

    # ------------------------------------------------------------ allocation
    def generation_for_capture(self, mode: MemoryMode) -> Optional[_Generation]:
        """The generation a new capture joins (``None`` in ``per_graph`` mode)."""
        if mode is MemoryMode.PER_GRAPH or self.async_allocator:
            return None  # no pool is shared: no order to keep
        gen = self._generations[-1] if self._generations else None
        if gen is None or gen.sealed:
            gen = _Generation(self._opened, self.runtime.new_pool(shared=True))
            self._opened += 1
            self._generations.append(gen)
            if gen.index > 0:
                logger.info("paddle_graphpp: capture after replays began; opening memory pool generation %d "
                            "so the new graphs cannot alias memory that earlier graphs still use", gen.index)
        return gen

    def newest_generation(self) -> Optional[_Generation]:
        return self._generations[-1] if self._generations else None

    @property
    def async_allocator(self) -> bool:
        """Whether the stream-ordered allocator is active (asked once, at the first capture)."""
        if self._async is None:
            ordered = capabilities(self.runtime).stream_ordered
            self._async = bool(ordered is not None and ordered.async_allocator_active())
            if self._async:
                logger.info("paddle_graphpp: the stream-ordered allocator is active: graph memory is the "
                            "driver's graph memory and memory modes do not select pools")
        return self._async

    def pool_for(self, gen: Optional[_Generation]) -> Any:
        if self.async_allocator:
            return None  # private pools are ignored by cudaMallocAsync; graph memory nodes instead
        if gen is None:
            pool = self.runtime.new_pool()
            self._per_graph_pools.append(pool)
            return pool
        return gen.pool

    # --------------------------------------------------------- capture order
    def note_capture(self, gen: Optional[_Generation], graph_id: int, seconds: float) -> None:
        """A graph was captured into ``gen`` (``None``: a pool of its own). Captures into a
        generation happen between episodes (core.capture): nothing is in flight after them."""
        self.graphs_captured += 1
        self.capture_seconds += seconds
        self._pending_log = True
        if gen is None:
            return
        gen.order[graph_id] = len(gen.order)

    def note_replay(self, gen: Optional[_Generation], graph_id: int, forward: bool, owner: str, *,
                    finishes: bool = True) -> None:
        """Check that a replay follows the capture order of its pool; raise if it cannot be safe.
        A backward graph after which the micro-batch stays in flight (the input-gradient half of
        a split backward) passes ``finishes=False``."""
        if self._pending_log:
            self.log_summary()
        if gen is None:
            return
        gen.sealed = True
        index = gen.order[graph_id]
        if index <= gen.cursor and gen.in_flight != 0:
            raise GraphScheduleError(
                f"{owner}: graphs are replayed in a different order than they were captured in, while "
                f"{gen.in_flight} micro-batch(es) are still in flight. Graphs sharing one memory pool "
                f"are only safe under a schedule that repeats the order of the capture step. Use the "
                f"same schedule every step, or memory='per_graph' for schedules that change."
            )
        gen.cursor = index
        gen.in_flight += 1 if forward else (-1 if finishes else 0)

    def note_dropped(self, gen: Optional[_Generation]) -> None:
        """A micro-batch replayed (or launched) from ``gen`` left the flight without its
        backward (:func:`paddle_graphpp.drop_in_flight`): the next step may start the capture
        order again."""
        if gen is not None and gen.in_flight > 0:
            gen.in_flight -= 1

    def reset_flight(self) -> None:
        """Nothing is in flight in the process (after :func:`paddle_graphpp.drop_in_flight`):
        every generation's capture order starts again, whatever a backward that raised midway
        left in its counts."""
        for gen in self._generations:
            gen.in_flight, gen.cursor = 0, -1

    def note_aborted(self, gen: Optional[_Generation]) -> None:
        """A capture failed: graphs captured later must not share its pool. A generation that
        holds no graph (it failed at its first capture) is dropped, and its pool's memory given
        back (the failed capture's allocations were freed into it)."""
        if gen is None:
            return
        gen.sealed = True
        if not gen.order and gen in self._generations:
            self._generations.remove(gen)
            pool, gen.pool = gen.pool, None
            lending = capabilities(self.runtime).lending
            if lending is not None:
                lending.release_pool(pool)
            del pool  # the last reference, unless the runtime keeps it
            self.runtime.release_cached_memory()

    # -------------------------------------------------------------- telemetry
    def report(self) -> dict:
        telemetry = capabilities(self.runtime).telemetry
        zeros = {"reserved_bytes": 0, "allocated_bytes": 0}
        stats = telemetry.memory_stats() if telemetry is not None else zeros
        pools = [g.pool for g in self._generations] + self._per_graph_pools
        if self._async:
            pools = [None]  # graph memory is the driver's: the runtime reports it as a whole
        pool_stats = telemetry.memory_stats(pools) if pools and telemetry is not None else zeros
        return {
            "runtime": self.runtime.name,
            "graphs_captured": self.graphs_captured,
            "capture_seconds": round(self.capture_seconds, 4),
            "pool_generations": len(self._generations),
            "per_graph_pools": len(self._per_graph_pools),
            "pool_reserved_bytes": pool_stats["reserved_bytes"],
            "pool_allocated_bytes": pool_stats["allocated_bytes"],
            "device_reserved_bytes": stats["reserved_bytes"],
            "device_allocated_bytes": stats["allocated_bytes"],
        }

    def log_summary(self) -> None:
        """Log the graph memory figures once after captures (INFO)."""
        if not self._pending_log:
            return
        self._pending_log = False
        if not logger.isEnabledFor(logging.INFO):
            return
        r = self.report()
        logger.info(
            "paddle_graphpp: %d graphs captured in %.2f s; graph pools reserve %.1f MiB, %.1f MiB allocated",
            r["graphs_captured"], r["capture_seconds"],
            r["pool_reserved_bytes"] / 2**20, r["pool_allocated_bytes"] / 2**20,
        )


def plan_for(runtime) -> MemoryPlan:
    """The process-wide plan of ``runtime``, kept in its section of the process (a new one when
    another runtime object takes its name)."""
    section = current_process().section(runtime.name)
    plan = section.plan
    if plan is None or plan.runtime is not runtime:
        plan = section.plan = MemoryPlan(runtime)
    return plan


def memory_report() -> dict:
    """Graph memory figures of this process, per runtime that has captured graphs.

    Returns ``{runtime_name: {...}}`` with ``graphs_captured``, ``capture_seconds``,
    ``pool_generations``, ``per_graph_pools``, ``pool_reserved_bytes``,
    ``pool_allocated_bytes``, ``device_reserved_bytes`` and ``device_allocated_bytes``;
    an empty dict when nothing was captured.
    """
    return {section.name: section.plan.report() for section in current_process().sections()
            if section.plan is not None and section.plan.graphs_captured}


def now() -> float:
    return time.perf_counter()
