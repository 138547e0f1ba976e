"""One owner of process state: no module of ``paddle_graphpp`` keeps state in a global.

The process's state lives in one :class:`~paddle_graphpp.core.process.GraphProcess`, reached
through one module-level handle, ``paddle_graphpp.core.process._CURRENT``. Every other module
global must be a constant: its module-level names (read with :mod:`ast`: assignments at module
level, outside functions and classes, including inside module-level ``if``/``try``/``with``
blocks) must hold a value of one of the kinds :func:`constant` lists, checked on the imported
module; and no module may rebind a global (a ``global`` statement), whatever the value. There is
no allow-list of names beyond the handle; ``__all__`` and the ``_LAZY`` tables of the lazy
packages are kinds of their own (a list of names, a table of names to modules).

A module whose framework is not installed is not imported under
``PADDLE_GRAPHPP_FRAMEWORK_FREE=1`` (CI's framework-free step); its ``global`` statements are
still read. The test checks itself on small modules of its own
(:func:`test_the_check_finds_state_in_a_module_of_its_own`).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import importlib.util
import logging
import os
import re
import types
import typing
from pathlib import Path

import pytest

from test_import_cycles import _modules  # every module of the package, by dotted name

HANDLE = ("paddle_graphpp.core.process", "_CURRENT")  # the one module global that is not a constant
_FRAMEWORKS = ("torch", "paddle")


# ------------------------------------------------------------------ what a constant is
def constant(value) -> bool:
    """Whether ``value`` is a constant: the kinds a module global may hold.

    * ``None``, booleans, numbers, strings, bytes;
    * enum members;
    * tuples (named tuples included) and frozensets of constants;
    * ``types.MappingProxyType`` tables: hashable keys, constant values;
    * frozen dataclass instances whose fields are constants;
    * definitions: classes, functions (builtin ones too), code objects, modules;
    * logger objects, compiled regular expressions, ``TypeVar`` objects;
    * a bare ``object()`` (a sentinel: it has no attributes to change).
    """
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, enum.Enum)):
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(constant(item) for item in value)
    if isinstance(value, types.MappingProxyType):
        return all(_hashable(key) and constant(item) for key, item in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return value.__dataclass_params__.frozen and all(
            constant(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType, types.CodeType, types.ModuleType)):
        return True
    if isinstance(value, (logging.Logger, re.Pattern, typing.TypeVar)):
        return True
    return type(value) is object


def _hashable(key) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def _named_kind(name: str, value) -> bool:
    """The kinds known by their name: ``__all__`` (a list of names) and a lazy package's
    ``_LAZY`` table (name -> module)."""
    if name == "__all__":
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    if name == "_LAZY":
        return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    return False


# ------------------------------------------------------------------ reading a module
def module_globals(tree: ast.Module) -> list:
    """The names module-level statements bind, in order (functions and classes not entered)."""
    found: list = []
    stack = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and getattr(node, "value", None) is not None:
            targets = [node.target]
        for target in targets:
            found += [n.id for n in ast.walk(target) if isinstance(n, ast.Name) and n.id not in found]
        for field in ("body", "orelse", "finalbody", "handlers"):  # if / try / with / for blocks
            stack.extend(reversed(getattr(node, field, [])))
    return found


def rebound(tree: ast.Module) -> list:
    """Names any ``global`` statement of the module rebinds."""
    return sorted({name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names})


def violations(name: str, path: Path, module) -> list:
    """What module ``name`` (its source at ``path``, imported as ``module``; ``None``: not
    imported, only its ``global`` statements are read) keeps as state, one line each."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = [f"{name}.{g}: rebound with a `global` statement" for g in rebound(tree)]
    if module is None:
        return out
    for g in module_globals(tree):
        if (name, g) == HANDLE or g not in vars(module):
            continue
        value = vars(module)[g]
        if not (constant(value) or _named_kind(g, value)):
            out.append(f"{name}.{g}: a {type(value).__module__}.{type(value).__qualname__}, not a constant")
    return out


def _import(name: str):
    """The module, or ``None`` where it is not imported: ``__main__`` (running it is its import)
    and, in the framework-free step, a module whose framework is missing."""
    if name.endswith(".__main__"):
        return None
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if os.environ.get("PADDLE_GRAPHPP_FRAMEWORK_FREE") == "1" and exc.name in _FRAMEWORKS:
            return None
        raise


# ------------------------------------------------------------------ the tests
def test_no_module_of_the_package_keeps_state_in_a_global():
    found = []
    for name, path in _modules().items():
        found += violations(name, path, _import(name))
    assert not found, ("module globals that hold state (keep state in a part of paddle_graphpp.core.process."
                       "GraphProcess; make a constant table a tuple, frozenset or MappingProxyType):\n"
                       + "\n".join(found))


def test_the_owner_has_one_handle():
    from paddle_graphpp.core import process

    assert isinstance(process._CURRENT, process.GraphProcess)
    assert process.current_process() is process._CURRENT
    assert module_globals(ast.parse(Path(process.__file__).read_text())).count("_CURRENT") == 1


def test_no_module_searches_the_processs_objects():
    # state is found through its owner, never by walking the garbage collector's objects (a
    # diagnostic naming what holds one given object, gc.get_referrers, is not such a search)
    calls = [f"{name}:{node.lineno}" for name, path in _modules().items()
             for node in ast.walk(ast.parse(Path(path).read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "get_objects"]
    assert not calls, calls


def _load(tmp_path: Path, source: str):
    path = tmp_path / "probe_module.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("probe_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


def test_the_check_finds_state_in_a_module_of_its_own(tmp_path):
    path, module = _load(tmp_path, "import threading\n"
                                   "_X = {}\n"
                                   "_N = 0\n"
                                   "_T = (1, [])\n"
                                   "if True:\n    _L = threading.Lock()\n"
                                   "def bump():\n    global _N\n    _N += 1\n")
    found = violations("probe", path, module)
    assert [line.split(":")[0] for line in found] == ["probe._N", "probe._X", "probe._T", "probe._L"]

    path, module = _load(tmp_path, "import enum, logging, re, types, typing\n"
                                   "from dataclasses import dataclass\n"
                                   "@dataclass(frozen=True)\nclass Row:\n    a: int\n"
                                   "class Kind(enum.Enum):\n    A = 1\n"
                                   "__all__ = ['Row']\n"
                                   "_LAZY = {'Row': 'probe'}\n"
                                   "_NAMES = ('a', 1, 2.5, None, frozenset({b'x'}))\n"
                                   "_TABLE = types.MappingProxyType({Kind.A: Row(1), 'cls': Row})\n"
                                   "logger = logging.getLogger('probe')\n"
                                   "_PATTERN = re.compile('x')\n"
                                   "T = typing.TypeVar('T')\n"
                                   "_SENTINEL = object()\n"
                                   "_ALIAS = len\n")
    assert violations("probe", path, module) == []
