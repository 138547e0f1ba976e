"""Module attributes loaded on first access (PEP 562), so that importing a package of ours
imports no framework until a name that needs one is used."""

from __future__ import annotations

import importlib
from typing import Callable


def lazy_attributes(package: str, table: dict, namespace: dict) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``, resolving ``table`` (name -> module) into
    ``namespace`` (the package's globals) on first access."""

    def __getattr__(name):
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
