"""The versions of each framework and library paddle_graphpp plugs into, and the check of them.

paddle_graphpp reaches into internals that change between releases (transformers' masking
helpers, fleet's ``pp_layers``, PaddleFormers' pipe classes, torch's pipelining schedules,
megatron-core's layers for the peer benchmark). Each integration states the oldest version it
supports and the newest one tested; :func:`require` is called where the integration starts
(a runtime's creation, ``causal_lm_stage()``, the fleet pipeline, the benchmark):

- below the oldest supported version it raises :class:`UnsupportedVersionError`, naming the
  installed version, the range and what to install;
- above the newest tested one it warns once (the integration may still work; the warning says
  which version was tested) and goes on.

Imports no framework: versions are read from the installed distributions' metadata.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata
from types import MappingProxyType
from typing import Mapping, Optional

from .core.process import current_process
from .core.warn import warn

__all__ = ["SUPPORTED", "Support", "UnsupportedVersionError", "installed_version", "require", "report"]


class UnsupportedVersionError(ImportError):
    """An installed framework or library is older than the oldest version paddle_graphpp supports."""


@dataclass(frozen=True, slots=True)
class Support:
    """One integration's supported range.

    ``oldest`` is the oldest release supported (tested in CI or on the GPU machine);
    ``newest_tested`` the newest one tested. Versions compare by their leading numeric
    components (``5.24.0`` > ``5.3.1``); local tags (``+cpu``) and pre-release suffixes are ignored.
    """

    distribution: str  # the name pip knows it by
    oldest: str
    newest_tested: str
    used_for: str  # what paddle_graphpp does with it, for messages


SUPPORTED: Mapping[str, Support] = MappingProxyType({
    # torch: 2.11 on the GPU machines; in CI 2.13.0 (pinned) and the newest that installs on its Python
    "torch": Support("torch", "2.11", "2.14", "the PyTorch runtime"),
    "paddle": Support("paddlepaddle", "3.3", "3.3.1", "the Paddle runtime and fleet pipelines"),
    "transformers": Support("transformers", "5.0", "5.25", "causal_lm_stage() and graph_model() (transformers' model forwards and mask helpers)"),
    "paddleformers": Support("paddleformers", "1.2", "1.2.0", "PaddleFormers pipe models in graph_pipeline()"),
    "megatron-core": Support("megatron-core", "0.19", "0.19.2", "the Megatron-Core peer benchmark"),
})

# The GPU build of Paddle installs under another distribution name.
_ALIASES = MappingProxyType({"paddlepaddle": ("paddlepaddle", "paddlepaddle-gpu")})


class VersionWarnings:
    """The integrations already warned about in this process (a part of the process)."""

    def __init__(self) -> None:
        self.warned: set = set()


def _numeric(version: str) -> tuple:
    """``'2.13.0+cpu'`` -> ``(2, 13, 0)``; the leading dotted numbers only."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def _at_least(version: str, bound: str) -> bool:
    have, want = _numeric(version), _numeric(bound)
    return have[:len(want)] >= want


def _at_most(version: str, bound: str) -> bool:
    have, want = _numeric(version), _numeric(bound)
    return have[:len(want)] <= want


def installed_version(name: str) -> Optional[str]:
    """The installed version of integration ``name`` (a key of :data:`SUPPORTED`), or ``None``."""
    support = SUPPORTED[name]
    for dist in _ALIASES.get(support.distribution, (support.distribution,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def require(name: str, version: Optional[str] = None) -> Optional[str]:
    """Check integration ``name`` against its supported range; returns the version checked.

    Args:
        name: a key of :data:`SUPPORTED`.
        version: the version to check; by default the installed distribution's (a module's own
            ``__version__`` is the better source when the module is already imported).

    Raises:
        UnsupportedVersionError: the version is older than the oldest supported one.

    Warns once per integration when the version is newer than the newest tested one.
    """
    support = SUPPORTED[name]
    version = version if version is not None else installed_version(name)
    if version is None or _numeric(version) == (0, 0, 0):  # not installed, or a source build (Paddle's develop)
        return version
    if not _at_least(version, support.oldest):
        raise UnsupportedVersionError(
            f"{support.used_for} needs {support.distribution} >= {support.oldest} (tested {support.oldest} to "
            f"{support.newest_tested}); {version} is installed. Install a supported version, e.g. "
            f"`pip install '{support.distribution}>={support.oldest}'`.")
    warned = current_process().part(VersionWarnings).warned
    if not _at_most(version, support.newest_tested) and name not in warned:
        warned.add(name)
        warn(
            f"{support.distribution} {version} is newer than the newest version paddle_graphpp was tested with "
            f"({support.newest_tested}) for {support.used_for}; if it fails, pin "
            f"'{support.distribution}<={support.newest_tested}' and report the error.", UserWarning)
    return version


def report() -> dict:
    """``{name: {"installed", "oldest", "newest_tested", "status"}}`` for every integration;
    ``status`` is ``"supported"``, ``"untested (newer)"``, ``"too old"`` or ``"not installed"``."""
    rows = {}
    for name, support in SUPPORTED.items():
        version = installed_version(name)
        if version is None:
            status = "not installed"
        elif not _at_least(version, support.oldest):
            status = "too old"
        elif not _at_most(version, support.newest_tested):
            status = "untested (newer)"
        else:
            status = "supported"
        rows[name] = {"installed": version, "oldest": support.oldest, "newest_tested": support.newest_tested,
                      "status": status}
    return rows
