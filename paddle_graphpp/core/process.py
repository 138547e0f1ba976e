"""The one owner of this process's graph state: :class:`GraphProcess`, reached through
:func:`current_process`.

Whatever the package remembers between calls that no object of the user's holds lives here, and
no other module keeps state in a global (``unittests/test_process_state.py``): per runtime name a
:class:`RuntimeSection` (its memory plan, its record-then-capture side
:class:`~paddle_graphpp.core.capture.EpisodeCapture`, both renewed when another runtime object
takes the name, and the parts of that runtime's package), the live engines, and the process-wide
parts. A *part* is one module's state, an object of a class defined in that module, made on first
use by :meth:`GraphProcess.part` / :meth:`RuntimeSection.part`. This module imports nothing of the
package. :meth:`GraphProcess.reset` forgets one runtime's plan and capture side (what a test starts
from); parts stay, as they mirror what was done to the frameworks. docs/architecture.md lists the
parts.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional, TypeVar

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
        self.plan: Optional[Any] = None  # a core.memory.MemoryPlan (not imported: it imports this module)
        #: Record, then capture (set by :func:`~paddle_graphpp.core.capture.capture_for`).
        self.capture: Optional[Any] = None  # a core.capture.EpisodeCapture

    def reset(self) -> None:
        """Forget the memory plan and the capture side (the parts stay)."""
        self.plan = None
        self.capture = None


class GraphProcess(_Parts):
    """This process's graph state (see the module docstring for what it holds)."""

    def __init__(self):
        super().__init__(threading.RLock())
        #: Every live graphed layer's engine (weakly held).
        self.engines: "weakref.WeakSet[Any]" = weakref.WeakSet()  # core.engine.GraphedCallable objects
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
