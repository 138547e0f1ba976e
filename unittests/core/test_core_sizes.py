"""The engine's shape, checked: the sizes issue 52 set, and typed collaborators.

* ``EpisodeCapture`` (the process-wide services) stays at most 150 lines, and no class of
  ``paddle_graphpp/core`` grows past 300: what does not fit is a concept of its own.
* The runtime seam keeps at most 15 required members (abstract methods plus ``name``); the
  rest are defaults or optional capabilities.
* The engine's parts are given the layer and their collaborators, never the engine.
"""

import ast
import pathlib

import paddle_graphpp.core as core
from paddle_graphpp.core.runtime import GraphRuntime

CORE = pathlib.Path(core.__file__).parent


def _class_lengths() -> dict:
    lengths = {}
    for path in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lengths[f"{path.name}:{node.name}"] = node.end_lineno - node.lineno + 1
    return lengths


def test_episode_capture_is_at_most_150_lines_and_no_core_class_over_300():
    lengths = _class_lengths()
    assert lengths["capture.py:EpisodeCapture"] <= 150
    assert {name: n for name, n in lengths.items() if n > 300} == {}


def test_the_runtime_seam_has_at_most_15_required_members():
    required = set(GraphRuntime.__abstractmethods__) | {"name"}
    assert len(required) <= 15, sorted(required)


def test_no_engine_part_is_given_the_engine():
    """Each part of a layer's engine is given, at construction, the layer (``core.layer.Layer``) and
    the narrow collaborators it uses; none is given the engine, none imports it, and none reaches
    into another object's private members."""
    from paddle_graphpp.core.backward import Backward
    from paddle_graphpp.core.in_step import InStepCapture
    from paddle_graphpp.core.layer_capture import LayerCapture
    from paddle_graphpp.core.recompute import LayerRecompute
    from paddle_graphpp.core.replay import Replays

    for cls in (Backward, InStepCapture, LayerCapture, Replays, LayerRecompute):
        annotations = cls.__init__.__annotations__
        assert annotations["layer"] == "Layer", cls
        assert "GraphedCallable" not in annotations.values(), cls
    for path in CORE.glob("*.py"):
        if path.name != "engine.py":
            text = path.read_text()
            assert "from .engine import" not in text and "engine._" not in text and "layer._" not in text, path.name
