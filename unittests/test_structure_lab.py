"""The lab stays apart: what imports what between the package, ``testing/`` and ``tools/``, and
what the package's own text points at.

* ``testing/`` (test support) imports no ``tools`` module; the tools may import ``testing``.
* ``paddle_graphpp`` imports neither ``tools`` nor ``testing``.
* No docstring, comment or string of the package mentions ``tools/``: the package links the
  docs (``docs/*.md``), not the lab.
* A module docstring of the package states its contract in a few lines (at most
  :data:`MAX_DOCSTRING_LINES`); the design story lives once, in ``docs/``.

Files are read with :mod:`ast` and :mod:`tokenize`; nothing here imports the package, a tool or a
framework. Imports count wherever they are: at module level, inside functions, under
``if TYPE_CHECKING:``, and as a literal name given to ``importlib.import_module`` or
``__import__``.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "paddle_graphpp"
TESTING = ROOT / "testing"
MAX_DOCSTRING_LINES = 25

_LAB_MENTION = re.compile(r"(?<![\w.])tools/")


def _files(top: Path) -> list:
    return sorted(top.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def imported_names(source: str) -> list:
    """``(line, dotted name)`` of every absolute import in ``source``, wherever it sits, and of
    every literal module name handed to ``importlib.import_module`` / ``__import__``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def _imports_of(top: Path, forbidden: tuple) -> list:
    return [f"{_rel(path)}:{line}: imports {name}" for path in _files(top)
            for line, name in imported_names(path.read_text(encoding="utf-8"))
            if name.split(".")[0] in forbidden]


def lab_mentions(source: str) -> list:
    """``(line, text)`` of every comment or string (docstrings included) of ``source`` that
    mentions ``tools/``."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            for match in _LAB_MENTION.finditer(tok.string):
                before = tok.string[:match.start()]
                line = before.rpartition("\n")[2] + tok.string[match.start():].partition("\n")[0]
                found.append((tok.start[0] + before.count("\n"), line.strip()[:100]))
    return found


def docstring_lines(source: str) -> int:
    doc = ast.get_docstring(ast.parse(source), clean=True)
    return len(doc.splitlines()) if doc else 0


def test_testing_imports_no_tools_module():
    found = _imports_of(TESTING, ("tools",))
    assert not found, "testing/ must not depend on the lab (move what it needs into testing/):\n" + "\n".join(found)


def test_the_package_imports_neither_tools_nor_testing():
    found = _imports_of(PACKAGE, ("tools", "testing"))
    assert not found, "paddle_graphpp must not import the lab or the test support:\n" + "\n".join(found)


def test_the_package_text_mentions_no_tools_path():
    found = [f"{_rel(path)}:{line}: {text}" for path in _files(PACKAGE)
             for line, text in lab_mentions(path.read_text(encoding="utf-8"))]
    assert not found, ("the package's docstrings and comments link docs/*.md, not tools/ (point them at "
                       "the docs page that covers the topic):\n" + "\n".join(found))


def test_module_docstrings_are_short():
    lengths = {_rel(path): docstring_lines(path.read_text(encoding="utf-8")) for path in _files(PACKAGE)}
    over = {name: n for name, n in lengths.items() if n > MAX_DOCSTRING_LINES}
    assert not over, (
        f"module docstrings longer than {MAX_DOCSTRING_LINES} lines (state the contract and the failure "
        f"modes; the design story goes to docs/architecture.md or the topic's docs page):\n"
        + "\n".join(f"{name}: {n} lines" for name, n in sorted(over.items(), key=lambda kv: -kv[1])))


def test_the_checks_find_what_they_look_for():
    source = ('"""A module.\n\nMeasured by ``tools/bench_x.py``."""\n'
              "import os\n"
              "from tools import benchlib\n"
              "def f():\n"
              "    import tools.gpt_torch  # see tools/gpt_torch.py\n"
              "    return importlib.import_module('testing.parity'), functools.partial(f)\n")
    assert [name for _, name in imported_names(source)] == ["os", "tools", "tools.gpt_torch", "testing.parity"]
    assert lab_mentions(source) == [(3, "Measured by ``tools/bench_x.py``.\"\"\""), (7, "# see tools/gpt_torch.py")]
    assert lab_mentions("# docs/memory.md; functools.partial, mytools/x\n") == []
    assert docstring_lines('"""one\n\ntwo\n"""\n') == 3
