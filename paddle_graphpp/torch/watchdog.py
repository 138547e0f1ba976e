"""``watch_replays``: the PyTorch switch of the replay watchdog (:mod:`paddle_graphpp.core.watchdog`).

What the watchdog needs from PyTorch (replay events, the process group's timeout, aborting
communicators) is the runtime's :class:`~paddle_graphpp.torch.collectives.watch.TorchReplayEvents`.
"""

from __future__ import annotations

from typing import Optional

from ..core.capture import capture_for
from .runtime import active_runtime

__all__ = ["watch_replays"]


def watch_replays(timeout: Optional[float], *, grace: float = 30.0) -> None:
    """Time every graph replay of this process: one that has not completed ``timeout`` seconds
    after its launch raises :class:`paddle_graphpp.ReplayTimeoutError` at the next graphed call;
    ``grace`` seconds later the process groups are aborted, and ``grace`` seconds after that the
    process exits (code :data:`paddle_graphpp.core.watchdog.EXIT_CODE`) if it is still stuck.

    By default (without this call) replays are timed with the default process group's timeout
    where a group of several ranks exists (``FLAGS_graphpp_replay_timeout`` overrides it; 0 turns
    it off). ``timeout=None`` or ``0`` turns timing off here (a peer's failed capture is still
    reported where several ranks exist, unless ``FLAGS_graphpp_capture_agreement=0``).

    Raises:
        ValueError: a negative or non-numeric ``timeout``, or ``grace`` not > 0.
    """
    if not grace > 0:
        raise ValueError(f"watch_replays: grace must be > 0 seconds, got {grace!r}")
    capture_for(active_runtime()).replay_watch.watch(0 if timeout is None else timeout, grace=grace)
