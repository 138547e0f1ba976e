"""One adapter per outside library, consulted through one interface, never on a call's path.

Read from the code with :mod:`ast` (as ``test_import_cycles`` reads imports): no module outside
``paddle_graphpp/torch/integrations/`` imports an adapter module (only the package, whose
:class:`~paddle_graphpp.torch.integrations.Adapter` interface and helpers generic code uses);
every adapter module is registered and defines ``ADAPTER``; the per-call methods of graphed
blocks and ``CUDAGraphedModule`` use only the first-call hook. With torch installed, a graphed
call after the first runs without the registry (the bound checks still refuse what they refuse).
"""

from __future__ import annotations

import ast

import pytest

from test_import_cycles import PACKAGE, _imports, _modules

INTEGRATIONS = f"{PACKAGE}.torch.integrations"
# What a graphed call may use of the integrations package: the first-call mark and hook.
PER_CALL_ALLOWED = {"PREPARED", "prepare"}


def _adapter_modules(modules: dict) -> set:
    return {name for name in modules if name.startswith(INTEGRATIONS + ".")}


def test_no_module_outside_the_integrations_imports_an_adapter_module():
    modules = _modules()
    adapters = _adapter_modules(modules)
    assert {f"{INTEGRATIONS}.{n}" for n in ("fsdp", "transformers", "megatron")} <= adapters
    offenders = [f"{name} imports {target}"
                 for name, path in modules.items() if name != INTEGRATIONS and name not in adapters
                 for target in sorted(_imports(name, path, modules) & adapters)]
    assert not offenders, offenders


def test_the_integrations_package_imports_no_adapter_module_and_registers_each():
    """The package reaches its adapters by name only (imported the first time graphing asks), and
    its table names every adapter module, each of which defines ``ADAPTER``."""
    modules = _modules()
    adapters = _adapter_modules(modules)
    assert not _imports(INTEGRATIONS, modules[INTEGRATIONS], modules) & adapters
    from paddle_graphpp.torch.integrations import ADAPTER_MODULES

    assert set(ADAPTER_MODULES) == adapters and len(ADAPTER_MODULES) == len(adapters)
    for name in adapters:
        tree = ast.parse(modules[name].read_text(encoding="utf-8"))
        assigned = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                    if isinstance(t, ast.Name)}
        assert "ADAPTER" in assigned, f"{name} defines no ADAPTER"


def _method(tree: ast.AST, cls: str, name: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"no {cls}.{name}")


@pytest.mark.parametrize("module,cls,method", [("torch.layers", "GraphedLayer", "__call__"),
                                               ("torch.layers", "GraphedLayer", "forward"),
                                               ("torch.graphed", "CUDAGraphedModule", "forward"),
                                               ("torch.graphed", "CUDAGraphedModule", "run")])
def test_per_call_paths_use_only_the_first_call_hook(module, cls, method):
    tree = ast.parse(_modules()[f"{PACKAGE}.{module}"].read_text(encoding="utf-8"))
    used = {node.attr for node in ast.walk(_method(tree, cls, method))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "integrations"}
    assert used <= PER_CALL_ALLOWED, (f"{cls}.{method}", sorted(used - PER_CALL_ALLOWED))


def test_graphed_calls_do_not_consult_the_adapters_once_captured(monkeypatch):
    """On the fake graph runtime (capture runs the code eagerly, replay counts): warmup, record and
    capture consult the adapters; the replays after them run with the registry gone."""
    torch = pytest.importorskip("torch")
    from fake_runtime import FakeGraphRuntime, serving

    from paddle_graphpp.core.process import current_process
    from paddle_graphpp.torch import CUDAGraphedModule, graph_layers, integrations, ungraph_layers

    class LegacyBlock(torch.nn.Module):  # a block in transformers' style: the transformers adapter's
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, hidden_states, layer_past=None, use_cache=False):
            return torch.tanh(self.proj(hidden_states)), None

    rt = FakeGraphRuntime()
    current_process().reset(rt.name)
    with serving(rt):
        blocks = torch.nn.ModuleList([LegacyBlock(), torch.nn.Linear(8, 8)])
        graph_layers(blocks, num_warmup_steps=1, name="h")
        wrapped = CUDAGraphedModule(torch.nn.Linear(8, 8), num_warmup_steps=1)
        checks = [b.__dict__["_graphpp_call_checks"] for b in blocks]
        assert len(checks[0]) == 1 and checks[1] == ()  # bound when graphed: only the block in transformers' style
        x = torch.randn(2, 8, requires_grad=True)

        def step():
            wrapped(blocks[1](blocks[0](x)[0])).sum().backward()

        for _ in range(3):  # warmup, record, capture
            step()
        assert all(integrations.PREPARED in m.__dict__ for m in (*blocks, wrapped))
        assert wrapped.engine.captures == 2

        def consulted():
            raise AssertionError("a graphed call consulted the adapters")

        before = [m.engine.replays for m in (*blocks, wrapped)]
        monkeypatch.setattr(integrations, "adapters", consulted)
        for _ in range(3):
            step()
        assert [m.engine.replays - n for m, n in zip((*blocks, wrapped), before)] == [2 * 3] * 3  # forward, backward
        with pytest.raises(ValueError, match=r"h\.0: use_cache=True"):
            blocks[0](x, None, True)  # the check bound when graphed still refuses
        monkeypatch.undo()
        ungraph_layers(blocks)
        assert integrations.PREPARED not in blocks[0].__dict__
    current_process().reset(rt.name)
