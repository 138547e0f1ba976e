"""The engine options are declared once (``core/options.py``'s ``EngineOptions``) and every front
door takes them as keywords or as one ``options=EngineOptions(...)``.

The declaration check reads the package's sources with :mod:`ast` (no framework needed); the
front-door checks build real layers on CPU with each installed framework."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from paddle_graphpp.core.options import EngineOptions, engine_options, options_doc

ROOT = Path(__file__).resolve().parent.parent / "paddle_graphpp"
NAMES = [f.name for f in dataclasses.fields(EngineOptions)]

# Functions that take an option's *resolved value* from the engine (not a user's setting, no
# default of their own): the seam's capture gets the generators the engine read from the option,
# the FIFO its limit.
CONSUMERS = {
    ("core/runtime.py", "capture_to_graph", "generators"), ("core/runtime.py", "capture_failure_hint", "generators"),
    ("paddle/runtime.py", "capture_to_graph", "generators"), ("paddle/runtime.py", "capture_failure_hint", "generators"),
    ("torch/runtime.py", "capture_to_graph", "generators"), ("torch/runtime.py", "capture_failure_hint", "generators"),
    ("core/schedule.py", "__init__", "max_in_flight"), ("core/lifecycle.py", "__init__", "max_signatures"),
    ("core/lifecycle.py", "__init__", "num_warmup_steps"), ("core/lifecycle.py", "__init__", "fallback"),
    ("core/runtime.py", "rng_mirror", "generators"), ("torch/runtime.py", "rng_mirror", "generators"),
    ("paddle/runtime.py", "rng_mirror", "generators"),
}


def _declarations() -> list:
    """``(file, function or class, name)`` for every parameter or class field named as an option."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                found += [(rel, node.name, a.arg) for a in args if a.arg in NAMES]
            elif isinstance(node, ast.ClassDef):
                found += [(rel, node.name, s.target.id) for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id in NAMES]
    return found


def test_each_option_is_declared_once():
    declared = [d for d in _declarations() if d not in CONSUMERS]
    assert sorted(declared) == sorted(("core/options.py", "EngineOptions", n) for n in NAMES), (
        "engine options declared outside EngineOptions (take **engine_kwargs / options= instead): "
        + str([d for d in declared if d[1] != "EngineOptions"]))


def test_options_are_documented_once():
    """No docstring outside core/options.py has an ``Args:`` entry for an option; the front
    doors' entries are rendered from the fields' documentation."""
    entry = re.compile(r"^\s+(" + "|".join(NAMES) + r")(, \w+)*: [A-Z`\"(a-z]", re.M)
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.relative_to(ROOT).as_posix() == "core/options.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                found += [(path.name, node.name, m.group(1)) for m in entry.finditer(doc)
                          if (path.relative_to(ROOT).as_posix(), node.name, m.group(1)) not in CONSUMERS]
    found = [f for f in found if f != ("schedule.py", "InFlightQueue", "max_in_flight")]  # the FIFO's own limit
    assert not found, f"engine options documented outside core/options.py: {found}"


def test_options_doc_renders_every_field_with_notes():
    text = options_doc(refused=("generators",), notes={"memory": "A note of the runtime."})
    for name in NAMES:
        assert (f"{name}:" in text) == (name != "generators")
    assert "A note of the runtime." in text.split("memory:")[1].split("max_in_flight:")[0]


def _door(*positional, options=None, name=None, **kwargs):
    return engine_options("door()", _door, positional, kwargs, options=options,
                          refused={"generators": "this door registers every generator itself"})


def test_engine_options_merges_the_forms():
    assert _door() == EngineOptions()
    assert _door(5).num_warmup_steps == 5
    base = EngineOptions(fallback="eager", max_signatures=2)
    chosen = _door(options=base, max_signatures=3)
    assert (chosen.fallback, chosen.max_signatures) == ("eager", 3) and base.max_signatures == 2


def test_engine_options_names_the_door_and_the_valid_names():
    with pytest.raises(TypeError, match=r"door\(\) got unexpected keyword argument\(s\) \['fallbak'\]; it takes "
                                        r"\['options', 'name'\] and the engine options \['num_warmup_steps', "
                                        r"'fallback'"):
        _door(fallbak="eager")
    with pytest.raises(TypeError, match=r"door\(\) takes no generators: this door registers"):
        _door(generators=[])
    with pytest.raises(TypeError, match="both positionally and by keyword"):
        _door(2, num_warmup_steps=2)
    with pytest.raises(TypeError, match="one positional option"):
        _door(2, 3)
    with pytest.raises(TypeError, match="must be a paddle_graphpp.EngineOptions"):
        _door(options={"fallback": "eager"})


needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
needs_paddle = pytest.mark.skipif(importlib.util.find_spec("paddle") is None, reason="needs paddle")


@needs_torch
def test_torch_front_doors_take_the_options_in_both_forms():
    import torch

    from paddle_graphpp.torch import CUDAGraphedModule, graph_layers, graph_loss, graph_stage_module

    module = CUDAGraphedModule(torch.nn.Linear(2, 2), 1, fallback="eager", max_signatures=2)
    assert (module.engine.options.num_warmup_steps, module.engine.options.fallback,
            module.engine.options.max_signatures) == (1, "eager", 2)
    blocks = graph_layers(torch.nn.ModuleList([torch.nn.Linear(2, 2)]), fallback="eager", compile=None)
    assert blocks[0].engine.options.fallback == "eager"
    shared = EngineOptions(num_warmup_steps=2, memory="per_graph")
    stage = graph_stage_module([torch.nn.Linear(2, 2)], options=shared, max_in_flight=8)
    assert (stage.graphed_modules[0].engine.options.memory, stage.graphed_modules[0].engine.options.max_in_flight,
            stage.graphed_modules[0].engine.options.num_warmup_steps) == ("per_graph", 8, 2)
    assert graph_loss(torch.nn.functional.mse_loss, 4).engine.options.num_warmup_steps == 4
    with pytest.raises(TypeError, match=r"graph_layers\(\) got unexpected keyword argument\(s\) \['fallbak'\]"):
        graph_layers(torch.nn.ModuleList([torch.nn.Linear(2, 2)]), fallbak="eager")
    with pytest.raises(TypeError, match=r"graph_loss\(loss\) takes no accumulate_grads"):
        graph_loss(torch.nn.functional.mse_loss, accumulate_grads=False)


@needs_paddle
def test_paddle_layer_refuses_the_options_its_runtime_has_no_use_for():
    import paddle

    from paddle_graphpp import CUDAGraphedLayer

    layer = CUDAGraphedLayer(paddle.nn.Linear(2, 2), 2, fallback="eager")
    assert (layer.engine.options.num_warmup_steps, layer.engine.options.fallback) == (2, "eager")
    with pytest.raises(TypeError, match=r"CUDAGraphedLayer\(Linear\) takes no generators: every Paddle generator"):
        CUDAGraphedLayer(paddle.nn.Linear(2, 2), generators=[])
    with pytest.raises(TypeError, match=r"takes no accumulate_grads"):
        CUDAGraphedLayer(paddle.nn.Linear(2, 2), options=EngineOptions(accumulate_grads=False))
