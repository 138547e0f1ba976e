"""The library's warnings point at the user's line (paddle_graphpp/core/warn.py), not at its own
source or a framework's: every warning the package raises goes through that one helper."""
import ast
import os
import sys
import warnings

import pytest

from paddle_graphpp.core.warn import warn

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "paddle_graphpp")


def test_the_package_warns_only_through_the_helper():
    raw = []
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(root, name)
            if not name.endswith(".py") or path == os.path.join(PACKAGE, "core", "warn.py"):
                continue
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "warn" \
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "warnings":
                    raw.append(f"{os.path.relpath(path, PACKAGE)}:{node.lineno}")
    assert not raw, f"warnings.warn outside paddle_graphpp/core/warn.py (use its warn()): {raw}"


def test_a_direct_call_is_attributed_to_the_caller():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warn("here")
    assert seen[0].filename == __file__ and seen[0].category is RuntimeWarning


def test_a_graphed_layer_without_cuda_warns_at_the_line_that_called_the_model():
    torch = pytest.importorskip("torch")
    from paddle_graphpp.torch import graph_layers

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    graph_layers(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        model(torch.randn(3, 4)).sum().backward()
    ours = [w for w in seen if "CUDA graphs are not used" in str(w.message)]
    assert ours, [str(w.message) for w in seen]
    for w in ours:  # torch's module call and the engine's frames in between are passed over
        assert w.filename == __file__ and w.lineno == line, (w.filename, w.lineno)


def test_without_cuda_a_model_of_many_graphed_layers_warns_once():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("the layers capture on a CUDA device")
    from paddle_graphpp.torch import graph_layers

    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(6)))
    graph_layers(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # Python's own: each text once per calling line
        for _ in range(3):
            model(torch.randn(3, 4)).sum().backward()
    ours = [str(w.message) for w in seen if "CUDA graphs are not used" in str(w.message)]
    assert ours == ["CUDA graphs are not used (PyTorch sees no CUDA device); graphed layers are running eagerly."]


def test_a_reason_of_one_layer_names_it():
    pytest.importorskip("torch")
    from paddle_graphpp.core.engine import _unavailable_message
    from paddle_graphpp.torch.runtime import TorchRuntime

    rt = TorchRuntime()
    common = rt.graphs_unavailable_reason(())  # None where PyTorch sees a CUDA device
    ours = sorted(_unavailable_message(rt, name, "an input is on the moon") for name in ("Block[0]", "Block[1]"))
    assert len(ours) == 2 and all("an input is on the moon" in m for m in ours), ours
    assert ours[0] != ours[1]  # each names its layer
    if common is not None:  # the reason every layer shares names none
        assert _unavailable_message(rt, "Block[0]", common) == _unavailable_message(rt, "Block[1]", common)
