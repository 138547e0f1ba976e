"""Boolean ``FLAGS_*`` environment settings, read as gflags (and so Paddle) reads them."""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["env_flag_value", "env_flag"]

_TRUE = ("1", "t", "true", "y", "yes", "on")
_FALSE = ("0", "f", "false", "n", "no", "off", "")


def env_flag_value(raw: Optional[str], flag: str) -> bool:
    """gflags' reading of a boolean environment value (``None``: unset, false)."""
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{flag}={raw!r} is not a boolean; use 1 or 0")


def env_flag(flag: str, default: bool) -> bool:
    """The boolean environment setting ``flag``; ``default`` where it is unset."""
    raw = os.environ.get(flag)
    return default if raw is None else env_flag_value(raw, flag)
