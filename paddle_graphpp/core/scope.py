"""Graph scopes that hold other graphed layers: while one is warming up or capturing, the layers
inside it run their plain call.

A whole-step graph (:class:`paddle_graphpp.torch.step.GraphedStep`) captures everything its step
launches, the graphed layers' work included. Those layers must neither keep their own graphs
(a graph cannot be replayed into another's capture, and their pools would sit beside the
step's) nor count the step's warmup calls as their own warmup. The step therefore runs its
warmup and its capture inside :func:`inline_layers`, and every graphed layer called there
runs its wrapped function directly (compiled code included), exactly as its eager path
would. A layer called while *any* capture is in progress on the current stream does the same
(:meth:`paddle_graphpp.core.engine.GraphedCallable.__call__` asks the runtime), so one graphed
module nested in another is captured as part of the outer one.

The state is per thread (kept in the process's :class:`Inlining`): a capture belongs to the
thread that runs it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from .process import current_process

__all__ = ["inline_layers", "layers_inlined"]


class Inlining(threading.local):
    """Per thread, the :func:`inline_layers` blocks open (a part of the process)."""

    def __init__(self) -> None:
        self.depth = 0


@contextlib.contextmanager
def inline_layers() -> Iterator[None]:
    """Inside this context, graphed layers of this thread run their wrapped call directly."""
    state = current_process().part(Inlining)
    state.depth += 1
    try:
        yield
    finally:
        state.depth -= 1


def layers_inlined() -> bool:
    """Whether an enclosing scope asked this thread's graphed layers to run directly."""
    return current_process().part(Inlining).depth > 0
