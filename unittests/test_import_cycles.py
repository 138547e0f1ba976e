"""No import cycle inside ``paddle_graphpp``.

Every module's imports are read with :mod:`ast` (no module is imported), at module level and
inside functions and classes alike: a function-level import that closes a cycle still ties the
two modules together (each needs the other to work), it only hides the cycle from the import
system. ``from package import name`` counts as an import of ``package.name`` when that is a
module, else of ``package`` (its ``__init__``). Imports under ``if TYPE_CHECKING:`` count too: they
never run, but a module that names another's type for its signatures depends on it as much. A name resolved through a string at run time (the lazy public names of
:mod:`paddle_graphpp._lazy`, the runtime table of :mod:`paddle_graphpp.core.runtime`) is not an
import here. There is no allow-list: a cycle fails the test, printed module by module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "paddle_graphpp"


def _modules() -> dict:
    """``{dotted name: path}`` of every module of the package."""
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _import_nodes(tree: ast.AST):
    """Every ``import`` / ``from ... import`` of ``tree`` (``if TYPE_CHECKING:`` blocks included)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _imports(name: str, path: Path, modules: dict) -> set:
    """The package's modules that module ``name`` imports."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = here
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = node.module if node.level == 0 else ".".join(p for p in (base, node.module) if p)
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        for target in targets:
            while target and target not in modules:  # ``import a.b.c`` where c is a name: its module
                target = target.rpartition(".")[0]
            if target and target.startswith(PACKAGE) and target != name:
                out.add(target)
    return out


def import_graph() -> dict:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each as one cycle
    through it, sorted."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(_one_cycle(graph, set(c)) for c in components)


def _one_cycle(graph: dict, members: set) -> list:
    """A path from the component's first module back to itself, within the component."""
    start = min(members)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError(f"no cycle through {start}")


def test_no_import_cycle_in_the_package():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles in paddle_graphpp:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_package_imports_neither_the_tools_nor_the_test_support():
    """``tools/`` (the lab) and ``testing/`` (test support) import the package, never the reverse."""
    found = []
    for name, path in _modules().items():
        for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            targets = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if node.level == 0 else [])
            found += [(name, t) for t in targets if t.split(".")[0] in ("tools", "testing", "unittests")]
    assert not found, found


def test_the_checker_finds_a_function_level_cycle():
    graph = import_graph()
    assert "paddle_graphpp.core.options" in graph["paddle_graphpp.core.engine"]  # edges are read
    graph = {k: set(v) for k, v in graph.items()}
    graph["paddle_graphpp.core.options"].add("paddle_graphpp.core.engine")
    assert ["paddle_graphpp.core.engine", "paddle_graphpp.core.options", "paddle_graphpp.core.engine"] in find_cycles(graph)


def test_function_level_and_typing_only_imports_are_edges(tmp_path):
    modules = {"paddle_graphpp.a": tmp_path / "a.py", "paddle_graphpp.b": tmp_path / "b.py"}
    modules["paddle_graphpp.a"].write_text("def f():\n    from . import b\n")
    modules["paddle_graphpp.b"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    assert _imports("paddle_graphpp.a", modules["paddle_graphpp.a"], modules) == {"paddle_graphpp.b"}
    assert _imports("paddle_graphpp.b", modules["paddle_graphpp.b"], modules) == {"paddle_graphpp.a"}
