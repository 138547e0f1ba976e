"""What the Paddle runtime knows of PaddleFormers lives in its adapter only.

No module of ``paddle_graphpp/paddle`` outside ``integrations/`` names the package
``paddleformers`` in code: no import of it, no module-name test, no version key, no string holding
it. Docstrings and comments may (they are prose), and so may a message that names the product for
the user ("PaddleFormers' Trainer"): the check is on the package's lower-case name. Files are read
with :mod:`ast`; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PADDLE = ROOT / "paddle_graphpp" / "paddle"
ADAPTERS = PADDLE / "integrations"
NAME = "paddleformers"


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def code_mentions(source: str, name: str = NAME) -> list:
    """The lines of ``source``'s code (docstrings and comments aside, as :func:`ast.unparse` writes
    it) that hold ``name``."""
    code = ast.unparse(_without_docstrings(ast.parse(source)))
    return [line.strip()[:100] for line in code.splitlines() if name in line]


def test_only_the_paddleformers_adapter_names_paddleformers_in_code():
    found = [f"{path.relative_to(ROOT).as_posix()}: {line}"
             for path in sorted(PADDLE.rglob("*.py")) if ADAPTERS not in path.parents
             for line in code_mentions(path.read_text(encoding="utf-8"))]
    assert not found, ("PaddleFormers knowledge belongs in paddle_graphpp/paddle/integrations/paddleformers.py "
                       "(graph_pipeline asks it through the Adapter interface):\n" + "\n".join(found))


def test_the_adapter_does_name_it():
    assert code_mentions((ADAPTERS / "paddleformers.py").read_text(encoding="utf-8"))


def test_the_check_finds_what_it_looks_for():
    source = ('"""Graphs paddleformers models."""\n'
              "import paddleformers.fleet  # paddleformers\n"
              "def f(model):\n"
              '    """For paddleformers."""\n'
              '    if type(model).__module__.startswith("paddleformers."):\n'
              "        return 1\n"
              "    raise ValueError(\"PaddleFormers' Trainer\")\n"
              "class A:\n"
              '    """paddleformers"""\n'
              "    x = 1\n")
    assert code_mentions(source) == ["import paddleformers.fleet",
                                     "if type(model).__module__.startswith('paddleformers.'):"]
    assert code_mentions('"""paddleformers"""\n# paddleformers\nx = 1\n') == []
