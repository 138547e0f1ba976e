"""What the replay watchdog (:mod:`paddle_graphpp.core.watchdog`) needs from PyTorch.

* events after replays on the current stream, queried from the watchdog's thread;
* the default timeout: the default process group's own, where a group of several ranks exists
  (so a graph's collectives wait as long as eager ones would, and no longer);
* aborting the process groups' communicators, as PyTorch's NCCL watchdog does on a timeout;
* capture failures published through the default group's store (one key set by the failed
  rank; the others read one counter, from the watchdog's thread, which asks about once a
  second);
* the collectives a capture ran (``torch.distributed`` calls are noted while a graph captures,
  for the watchdog's message).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from ...core import collectives as _collectives
from ...core.runtime import ReplayEvents

__all__ = ["TorchReplayEvents", "noting_collectives", "group_timeout"]

_FAILED_KEY = "paddle_graphpp/capture_failed"
_COUNT_KEY = "paddle_graphpp/capture_failures"
# torch.distributed calls noted while a graph captures (looked up on the module at call time).
_NOTED = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
          "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier")


class TorchReplayEvents(ReplayEvents):
    """Mixed into :class:`~paddle_graphpp.torch.runtime.TorchRuntime`; holds no state."""

    def event_recorder(self):
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        stream = torch.cuda.current_stream()

        def record():
            event = torch.cuda.Event()
            event.record(stream)  # on that stream's device, from whichever thread calls it
            return event
        return record

    def event_done(self, event) -> bool:
        return event.query()

    def default_replay_timeout(self) -> Optional[float]:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return group_timeout(dist.distributed_c10d._get_default_group())

    def abort_collectives(self, reason: str) -> Optional[str]:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as exc:  # noqa: BLE001 - best effort from the watchdog's thread
            return f"aborting the process groups failed: {exc}"
        return "the default process group and its subgroups"

    def publish_capture_failure(self, text: str) -> None:
        store = _store()
        if store is None:
            return
        with contextlib.suppress(Exception):
            store.set(_FAILED_KEY, f"rank {dist.get_rank()}: {text}")
            store.add(_COUNT_KEY, 1)

    def peer_capture_failure(self) -> Optional[str]:
        store = _store()
        if store is None:
            return None
        try:
            if store.add(_COUNT_KEY, 0) == 0:
                return None
            found = store.get(_FAILED_KEY).decode(errors="replace")
        except Exception:  # noqa: BLE001 - a store that went away: nothing to report from here
            return None
        if found.startswith(f"rank {dist.get_rank()}:"):
            return None  # this rank's own failure, raised here already
        return f"capturing CUDA graphs failed on {found}"


def group_timeout(group) -> float:
    """Seconds a collective of ``group`` waits before its backend gives up (its options'
    timeout where the backend tells, else torch's default for process groups)."""
    with contextlib.suppress(Exception):
        device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
        timeout = group._get_backend(device).options._timeout
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout.total_seconds()
    return float(dist.default_pg_timeout.total_seconds())


def _store():
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    with contextlib.suppress(Exception):
        return dist.distributed_c10d._get_default_store()
    return None


@contextlib.contextmanager
def noting_collectives() -> Iterator[None]:
    """While a graph captures: the ``torch.distributed`` collectives called (through the module)
    are noted for the graph (:func:`paddle_graphpp.core.collectives.note_collective`)."""
    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    saved = {name: getattr(dist, name) for name in _NOTED if hasattr(dist, name)}

    def noted(name, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            group = kwargs.get("group")
            size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            _collectives.note_collective(f"torch.distributed.{name} ({size} ranks)")
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, noted(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
