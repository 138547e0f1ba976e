"""Warnings that point at the user's line.

A warning the library raises from deep inside a graphed layer, a pipeline schedule or a framework's
module call would otherwise quote a line of this package (or of torch, Paddle, transformers),
which tells the user nothing about their own code. :func:`warn` attributes it to the first frame
outside those packages: in a training script, the line that called the model or the schedule.
"""

from __future__ import annotations

import sys
import warnings

__all__ = ["warn"]

# Top-level modules whose frames a warning passes through on its way to the user's code: this
# package, the frameworks and model libraries that call into it, and the standard library's
# wrappers (context managers, functools.wraps) between them.
_PASS_THROUGH = frozenset({"paddle_graphpp", "torch", "paddle", "transformers", "paddleformers", "contextlib",
                           "functools"})


def warn(message: str, category: type = RuntimeWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first calling frame outside the
    packages in :data:`_PASS_THROUGH` (the caller itself when every frame is inside them)."""
    frame = sys._getframe(1)
    level = 2  # the caller of this function
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _PASS_THROUGH:
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
