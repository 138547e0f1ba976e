"""One lifecycle for every graphed scope: the structure, read from the code (no module is imported).

A graphed layer (``core/engine.py``), a whole step (``torch/step.py``) and a ``graph_process`` slot
(``graph_api.py``) each key their calls with :func:`paddle_graphpp.core.lifecycle.signature_key` and
keep their signatures in a :class:`paddle_graphpp.core.lifecycle.Lifecycle`; the rules a lifecycle
owns (how many signatures, how many warmup calls, what a failed capture does) are decided nowhere
else.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "paddle_graphpp"
SCOPES = ("core/engine.py", "torch/step.py", "graph_api.py")


def _tree(rel):
    return ast.parse((PACKAGE / rel).read_text(encoding="utf-8"))


def _called(tree) -> set:
    return {n.func.id if isinstance(n.func, ast.Name) else n.func.attr
            for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}


def test_every_scope_keys_its_calls_and_keeps_its_signatures_in_the_one_lifecycle():
    for rel in SCOPES:
        called = _called(_tree(rel))
        assert {"Lifecycle", "signature_key"} <= called, (rel, sorted(called & {"Lifecycle", "signature_key"}))


def test_the_lifecycles_rules_are_decided_only_in_the_lifecycle():
    """In the scopes, no comparison of a signature's warmup count, or of a count against
    max_signatures or num_warmup_steps (a check of an argument against a constant is validation,
    not a rule of the lifecycle)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "core/lifecycle.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", None)
                         for side in (node.left, *node.comparators) for n in ast.walk(side)}
                hit = names & {"max_signatures", "num_warmup_steps", "warm"}
                against_constant = all(isinstance(c, ast.Constant) for c in node.comparators)
                if hit and rel in SCOPES and not against_constant:
                    offenders.append(f"{rel}:{node.lineno} compares {sorted(hit)}")
    assert not offenders, offenders
