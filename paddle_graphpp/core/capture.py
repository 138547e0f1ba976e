"""Record, then capture: the process-wide side of the graph engine.

Every graphed layer of a process reports to one :class:`EpisodeCapture` per runtime (in its
section of :mod:`paddle_graphpp.core.process`): the episode clock, the memory plan, the episode
being recorded and the services replays share (handed-out outputs, the replay watch, gradient
owners). The first graphed forward of an episode calls :meth:`EpisodeCapture.capture_if_due`,
which captures the last recorded episode, every position in the order the step ran it, into one
pool generation, unless the runtime asks to wait (``PoolLending.defer_capture``; at most
:data:`MAX_DEFERRED_EPISODES` times in a row, recording anew each time, and then no more in
the process). A capture executes
nothing: the episode that follows replays. A failed capture is handed to its layer (fallback
or :class:`~paddle_graphpp.core.errors.CaptureError`) and releases its memory. Under the
stream-ordered allocator nothing is recorded (:mod:`paddle_graphpp.core.in_step`).
The walk of one micro-batch: docs/architecture.md.
"""

from __future__ import annotations

import gc
import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

from . import memory as _memory
from .batch import CaptureBatch
from .errors import CaptureError
from .grad_owners import GradOwners
from .handout import HandedOutputs
from .process import current_process
from .recording import Recording
from .replay_watch import ReplayWatch
from .runtime import GraphRuntime, capabilities
from .schedule import EpisodeClock
from .warn import warn

if TYPE_CHECKING:
    from .participant import CaptureParticipant

__all__ = ["EpisodeCapture", "capture_for"]

logger = logging.getLogger("paddle_graphpp")

# Recordings dropped in a row at most while the runtime asks to wait: more than the micro-batches
# of a first training step (each one an episode on a pipeline's last stage).
MAX_DEFERRED_EPISODES = 256
# (episodes, not steps: on the last stage of a 1F1B pipeline every micro-batch is one)


class EpisodeCapture:
    """The record-then-capture side of one runtime in this process: episode clock, memory
    plan, the episode being recorded, and the services replays use after a capture. Layers
    take part as :class:`~paddle_graphpp.core.participant.CaptureParticipant` objects (their
    ``capture``)."""

    def __init__(self, plan: "_memory.MemoryPlan"):
        self.runtime: GraphRuntime = plan.runtime
        self.caps = capabilities(plan.runtime)
        self.plan = plan
        self.clock = EpisodeClock()
        self.recording: Optional[Recording] = None  # the episode being recorded, if any call was
        self.outputs = HandedOutputs(self.runtime, self.caps.release)
        self.replay_watch = ReplayWatch(self.caps.events)
        self.grad_owners = GradOwners()
        self._layers = weakref.WeakValueDictionary()  # id -> participant with captured graphs
        self.deferred = 0  # recordings dropped in a row because the runtime asked to wait
        self.waited_out = False  # the limit was reached once: captures no longer wait in this process
        #: Backward graph replays (and eager recorded backwards) so far that changed parameter
        #: gradients in ``.grad`` outside autograd (gradient accumulation inside graphs). A
        #: replay's writes do not bump tensors' version counters, so code that skips work on
        #: gradients nobody wrote (``GraphedOptimizer.zero_grad``) compares this count as well.
        self.grad_writes = 0
        #: Set by a framework's capture-agreement helper (torch: ``agree_on_captures``): called at
        #: the end of every batch of captures with whether an error of this process's captures is
        #: about to reach the user; returns the ranks of the agreement group whose captures failed
        #: (empty: none), or raises :class:`~paddle_graphpp.CaptureError` when the peers do not
        #: answer in time. ``None``: each process decides alone.
        self.agreement: Optional[Callable[[bool], list]] = None

    def recorder(self) -> Recording:
        """The episode being recorded, opened by its first recorded call."""
        if self.recording is None:
            self.recording = Recording(self.runtime, self.caps.release)
        return self.recording

    def poll_watches(self) -> None:
        """At the start of every graphed call: see :meth:`Recording.poll_watches`."""
        if self.recording is not None:
            self.recording.poll_watches()

    def forget(self, participant: "CaptureParticipant") -> None:
        """``participant`` was reset: drop its calls from the recording, its graphs from the
        services, and it from the layers whose graphs a dropped generation concerns."""
        if self.recording is not None:
            self.recording.forget(participant)
        self.outputs.forget(participant)
        self._layers.pop(id(participant), None)

    # --------------------------------------------------------------- capture
    def capture_if_due(self) -> None:
        """At a graphed forward that may start an episode: when the last episode was recorded and
        nothing is in flight now, capture it before the new episode starts."""
        if self.recording and self.clock.between_episodes:
            self.capture_recorded()

    def capture_recorded(self) -> None:
        """Capture every position recorded in the last episode, in recorded order.

        Positions whose backward was not recorded are dropped (they are recorded again when
        they next run). A failure is handled by its layer (``fallback``); the first error
        that must reach the user is raised after the other layers' graphs are captured, and
        after the failed captures' memory is released.
        """
        recording, self.recording = self.recording, None
        recording.poll_watches()  # what died after the episode's last call
        if self._defer(recording):
            return
        # The recorded episode's activations are free but cached by the allocator: return them
        # so the graphs' pool can take that memory instead of adding to it.
        gc.collect()
        self.runtime.release_cached_memory()
        # The static buffers, in one block allocated on the emptied cache (allocated while the
        # recorded episode ran, they would pin pieces of its activations' cached blocks).
        batch = CaptureBatch(self.runtime, self.caps.release, recording)
        layers = recording.participants()
        self._prepare_pool(layers)
        try:
            batch.run()
            self.outputs.checks.update(batch.checks)
        finally:
            batch.close()  # also when the batch escapes (an interrupt, a warning raised as an error)
        recording.captured()
        self._finish(layers, batch)

    def _defer(self, recording: Recording) -> bool:
        """Whether the runtime asks to wait: the recording is dropped and the next episode recorded."""
        lending = self.caps.lending
        if self.deferred >= MAX_DEFERRED_EPISODES and not self.waited_out:
            self.waited_out = True
            logger.info("paddle_graphpp: captures no longer wait (%s runtime), after %d episodes recorded instead",
                        self.runtime.name, self.deferred)
        wait = lending.defer_capture() if lending is not None and not self.waited_out else None
        if not wait:
            self.deferred = 0
            return False
        if not self.deferred:
            logger.info("paddle_graphpp: captures wait (%s runtime: %s); the next episode is recorded instead",
                        self.runtime.name, wait)
        self.deferred += 1
        recording.dropped()
        return True

    def _prepare_pool(self, layers: list) -> None:
        if self.caps.lending is None or not any(p.memory_mode is _memory.MemoryMode.SHARED for p in layers):
            return
        gen = self.plan.generation_for_capture(_memory.MemoryMode.SHARED)
        if gen is not None and not gen.order:
            self.caps.lending.prepare_pool(gen.pool)

    def _finish(self, layers: list, batch: CaptureBatch) -> None:
        self._layers.update({id(layer): layer for layer in layers})
        gen = self.plan.newest_generation()
        if gen is not None and gen.order and self.caps.lending is not None:
            self.caps.lending.lend_pool(gen.pool, lambda: self.clock.between_episodes,
                                        lambda: self._drop_generation(gen))
        if batch.failed:
            gc.collect()
            self.runtime.release_cached_memory()
        self.plan.log_summary()
        if batch.errors:
            self.replay_watch.publish_failure(batch.errors[0])
        errors = _agree(self.agreement, batch.errors)
        for extra in errors[1:]:
            warn(f"another capture failed as well: {extra}")
        if errors:
            raise errors[0]

    def _drop_generation(self, gen: Any) -> None:
        """Eager work left memory allocated in ``gen``'s pool, which its graphs use as
        scratch: drop them (their positions are recorded and captured again, into a new pool)."""
        self.plan.note_aborted(gen)
        for layer in self._layers.values():
            layer.drop_generation(gen)
        logger.warning("paddle_graphpp: graphs of pool generation %d dropped; they are captured anew", gen.index)


def _agree(agreement: Optional[Callable[[bool], list]], errors: list) -> list:
    """With a capture agreement set (:attr:`EpisodeCapture.agreement`), every rank of the group raises
    when any rank's captures raise, so that no rank goes on into a collective that waits for a
    peer that stopped."""
    if agreement is None:
        return errors
    failed = agreement(bool(errors))
    if errors:
        errors[0].add_note(f"paddle_graphpp: every rank of the capture agreement group raises with it "
                           f"(ranks whose captures failed: {failed}).")
    elif failed:
        errors = [CaptureError(
            f"capturing CUDA graphs failed on rank(s) {failed} of the capture agreement group, so this rank "
            f"raises too instead of going on into collectives they will not join. The cause is in those "
            f"ranks' CaptureError; fallback='eager' on the failing layers keeps every rank training.")]
    return errors


def capture_for(runtime: GraphRuntime) -> EpisodeCapture:
    """The record-then-capture side of ``runtime``, kept in its section of the process (renewed
    when its memory plan is)."""
    section = current_process().section(runtime.name)
    found = section.capture
    if found is not None and found.plan is section.plan and found.plan.runtime is runtime:
        return found  # asked several times per graphed call: the usual answer without plan_for
    plan = _memory.plan_for(runtime)
    if found is None or found.plan is not plan:
        found = section.capture = EpisodeCapture(plan)
    return found
