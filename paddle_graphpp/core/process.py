"""The one owner of this process's graph state: :class:`GraphProcess`.

Whatever the package remembers between calls that no object of the user's holds (graphed
layers, steps and optimizers keep their own) lives in the one :class:`GraphProcess`, reached
through :func:`current_process`. No other module keeps state in a global
(``unittests/test_process_state.py`` reads every module's globals). The owner holds:

* per runtime name (``"torch"``, ``"paddle"``, a test's fake runtime), a :class:`RuntimeSection`:
  the runtime's memory plan (:class:`~paddle_graphpp.core.memory.MemoryPlan`, made by
  :func:`~paddle_graphpp.core.memory.plan_for`) and its record-then-capture side
  (:class:`~paddle_graphpp.core.capture.EpisodeCapture`, made by
  :func:`~paddle_graphpp.core.capture.capture_for`: the episode clock, the recording, the
  services replays use), both renewed when another runtime object takes the name; and the parts
  of that runtime's package (PyTorch: its runtime object with its pools and pool lending, the
  optimizers pool lending watches, the expandable-segments window, the classes of blocks graphed
  in place, what the installed torch's weight pass does; Paddle: its runtime object, ``install()``,
  the CPU fleet patches and hop groups, the zero-bubble store's owner, the compiled functions' serial);
* the live engines (:class:`~paddle_graphpp.core.engine.GraphedCallable`, for ``drop_in_flight``);
* the process-wide parts: the runtime table (:mod:`~paddle_graphpp.core.runtime`), the
  collectives' registry, the warmup guard's epoch, the graph scopes' inlining, ``graph_process``'s
  entries, the allocator switch, the versions already warned about.

A *part* is the state of one module: an object of a class defined in that module, beside the
code that uses it. :meth:`GraphProcess.part` (process-wide) and :meth:`RuntimeSection.part` make
it on first use (``kind()``, no arguments) and hand out that same object afterwards. This module
imports nothing of the package, so that every module reaches the owner without an import cycle.

:meth:`GraphProcess.reset` forgets one runtime's memory plan and capture side: what a test
starts from. Parts stay: they mirror what was done to the frameworks (hooks registered, classes
patched), which forgetting would not undo.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, Optional, TypeVar

if TYPE_CHECKING:
    from .capture import EpisodeCapture
    from .engine import GraphedCallable
    from .memory import MemoryPlan

__all__ = ["GraphProcess", "RuntimeSection", "current_process"]

T = TypeVar("T")


class _Parts:
    """Objects made on first use, one per class."""

    def __init__(self, lock: threading.RLock):
        self._lock = lock
        self._parts: dict[type, Any] = {}

    def part(self, kind: type[T]) -> T:
        """The one ``kind`` object here, made by ``kind()`` the first time it is asked for."""
        found = self._parts.get(kind)
        if found is None:
            with self._lock:  # reentrant: making one part may ask for another
                found = self._parts.get(kind)
                if found is None:
                    found = self._parts[kind] = kind()
        return found


class RuntimeSection(_Parts):
    """One runtime's share of the process, by runtime name."""

    def __init__(self, name: str, lock: threading.RLock):
        super().__init__(lock)
        self.name = name
        #: The runtime's graph memory (set by :func:`~paddle_graphpp.core.memory.plan_for`).
        self.plan: Optional["MemoryPlan"] = None
        #: Record, then capture (set by :func:`~paddle_graphpp.core.capture.capture_for`).
        self.capture: Optional["EpisodeCapture"] = None

    def reset(self) -> None:
        """Forget the memory plan and the capture side (the parts stay)."""
        self.plan = None
        self.capture = None


class GraphProcess(_Parts):
    """This process's graph state (see the module docstring for what it holds)."""

    def __init__(self):
        super().__init__(threading.RLock())
        #: Every live graphed layer's engine (weakly held).
        self.engines: "weakref.WeakSet[GraphedCallable]" = weakref.WeakSet()
        self._sections: dict[str, RuntimeSection] = {}

    def section(self, name: str) -> RuntimeSection:
        """The section of the runtime named ``name`` (made empty on first use)."""
        found = self._sections.get(name)
        if found is None:
            with self._lock:
                found = self._sections.get(name)
                if found is None:
                    found = self._sections[name] = RuntimeSection(name, self._lock)
        return found

    def sections(self) -> list:
        """Every runtime section made so far, in the order they were made."""
        return list(self._sections.values())

    def reset(self, name: str) -> None:
        """Forget runtime ``name``'s memory plan and capture side: its next graphed call starts a
        new plan, as in a fresh process. Its parts and the process-wide ones stay."""
        section = self._sections.get(name)
        if section is not None:
            section.reset()


_CURRENT = GraphProcess()


def current_process() -> GraphProcess:
    """The process's one :class:`GraphProcess`."""
    return _CURRENT
