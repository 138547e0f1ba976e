"""Segmentation of a stage's layer list into graphed runs (framework-neutral core)."""

import functools
import subprocess
import sys

import pytest

from paddle_graphpp.core.segment import (
    EntryKind,
    LayerEntry,
    classify,
    cut_runs,
    describe_runs,
    in_parts,
    mark_not_capturable,
    not_capturable_reason,
    split_into_runs,
)


class Layer:
    """A framework-free stand-in for a layer: segmentation only needs identity and children."""

    def __init__(self, name, children=()):
        self.name = name
        self.children = list(children)


def is_layer(obj):
    return isinstance(obj, Layer)


def entries_for(items, shared=()):
    return [
        classify(i, obj, is_layer=is_layer, shared=obj in shared,
                 sublayers=obj.children if is_layer(obj) else None,
                 name=getattr(obj, "name", None))
        for i, obj in enumerate(items)
    ]


def layout(runs):
    return [("G" if run.graphed else "E", [e.name for e in run.entries]) for run in runs]


def test_plain_layers_form_one_run():
    items = [Layer(f"b{i}") for i in range(4)]
    runs = split_into_runs(entries_for(items))
    assert layout(runs) == [("G", ["b0", "b1", "b2", "b3"])]
    assert runs[0].objects() == items
    assert (runs[0].start, runs[0].stop) == (0, 4)


def test_runs_split_around_shared_layers():
    embed, head = Layer("embed"), Layer("head")
    items = [embed, Layer("b0"), Layer("b1"), head, Layer("norm")]
    runs = split_into_runs(entries_for(items, shared=(embed, head)))
    assert layout(runs) == [("E", ["embed"]), ("G", ["b0", "b1"]), ("E", ["head"]), ("G", ["norm"])]
    assert runs[0].entries[0].kind is EntryKind.SHARED


def test_runs_split_around_callables_and_partials():
    def reshape(x):
        return x

    def tied_head(layer, x):
        return x

    items = [Layer("b0"), reshape, Layer("b1"), functools.partial(tied_head, Layer("e")), Layer("b2")]
    entries = entries_for(items)
    assert [e.kind for e in entries] == [EntryKind.LAYER, EntryKind.CALLABLE, EntryKind.LAYER,
                                         EntryKind.CALLABLE, EntryKind.LAYER]
    assert entries[3].name == "partial(tied_head)"
    assert layout(split_into_runs(entries)) == [
        ("G", ["b0"]), ("E", ["reshape"]), ("G", ["b1"]), ("E", ["partial(tied_head)"]), ("G", ["b2"])]


def test_opted_out_instance_class_and_sublayer():
    class Router(Layer):
        pass

    marked = mark_not_capturable(Layer("moe"), reason="data-dependent shapes")
    assert not_capturable_reason(marked) == "data-dependent shapes"
    mark_not_capturable(Router)  # every Router, made before or after, stays eager
    holder = Layer("block_with_router", children=[Layer("attn"), Router("r")])
    items = [Layer("b0"), marked, Layer("b1"), holder, Layer("b2"), Router("r2")]
    runs = split_into_runs(entries_for(items))
    assert layout(runs) == [("G", ["b0"]), ("E", ["moe"]), ("G", ["b1"]), ("E", ["block_with_router"]),
                            ("G", ["b2"]), ("E", ["r2"])]
    assert "contains Router" in runs[3].entries[0].reason
    assert not_capturable_reason(Layer("plain")) is None


def test_opt_out_beats_shared_and_describe():
    embed = mark_not_capturable(Layer("embed"))
    entries = entries_for([embed, Layer("b0")], shared=(embed,))
    assert entries[0].kind is EntryKind.OPTED_OUT
    text = describe_runs(split_into_runs(entries))
    assert text.splitlines() == ["eager   [0] embed: marked with mark_not_capturable", "graphed [1:2) b0"]


def test_every_entry_exactly_once():
    items = [Layer("a"), print, Layer("b"), Layer("c"), len, len, Layer("d")]
    runs = split_into_runs(entries_for(items))
    flat = [e.index for run in runs for e in run.entries]
    assert flat == list(range(len(items)))
    assert all(len(run.entries) == 1 for run in runs if not run.graphed)


def test_cut_runs_at_recompute_group_boundaries():
    # entries 3..10 of a stage starting at 3, groups of 2: [3,5) [5,7) [7,9) [9,11)
    items = [Layer("embed"), Layer("b0"), Layer("b1"), Layer("b2"), print, Layer("b3"), Layer("b4"), Layer("b5")]
    entries = [LayerEntry(3 + e.index, e.obj, e.kind, e.name, e.reason)
               for e in entries_for(items, shared=(items[0],))]
    runs = cut_runs(split_into_runs(entries), 2, start=3)
    assert layout(runs) == [("E", ["embed"]), ("G", ["b0"]), ("G", ["b1", "b2"]), ("E", ["print"]),
                            ("G", ["b3"]), ("G", ["b4", "b5"])]
    assert [e.index for run in runs for e in run.entries] == list(range(3, 11))
    assert layout(cut_runs(runs, 1, start=3))[1:3] == [("G", ["b0"]), ("G", ["b1"])]
    with pytest.raises(ValueError, match="positive group size"):
        cut_runs(runs, 0)


def test_empty_stage_and_bad_input():
    assert split_into_runs([]) == []
    entries = entries_for([Layer("a"), Layer("b"), Layer("c")])
    with pytest.raises(ValueError, match="consecutive"):
        split_into_runs([entries[0], entries[2]])
    with pytest.raises(TypeError, match="LayerEntry"):
        split_into_runs([Layer("a")])
    with pytest.raises(TypeError, match="None"):
        mark_not_capturable(None)
    with pytest.raises(TypeError, match="does not accept attributes"):
        mark_not_capturable(len)
    assert LayerEntry(0, None, EntryKind.LAYER, "x").capturable


def test_marks_paddle_layers_and_core_imports_no_framework():
    paddle = pytest.importorskip("paddle")
    layer = mark_not_capturable(paddle.nn.Linear(2, 2))
    assert not_capturable_reason(layer) is not None
    assert "_paddle_graphpp_not_capturable" not in layer.state_dict()
    code = ("import sys, paddle_graphpp.core.segment as s; "
            "assert 'paddle' not in sys.modules and 'torch' not in sys.modules; "
            "import paddle_graphpp; paddle_graphpp.mark_not_capturable; "
            "assert 'paddle' not in sys.modules and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_entry_graphed_in_parts_is_eager_and_its_report_lists_its_parts():
    items = [Layer("a"), Layer("moe"), Layer("b")]
    entries = entries_for(items)
    entries[1] = in_parts(entries[1], ["self_attn"], [("mlp.experts", "reads the host")])
    runs = split_into_runs(entries)
    assert layout(runs) == [("G", ["a"]), ("E", ["moe"]), ("G", ["b"])]
    assert runs[1].entries[0].kind is EntryKind.IN_PARTS and not runs[1].entries[0].capturable
    assert describe_runs(runs).splitlines()[1:4] == [
        "eager   [1] moe: graphed in parts: its own forward runs eagerly, calling the parts graphed in place",
        "    graphed in place: self_attn",
        "    eager: mlp.experts: reads the host",
    ]
    with pytest.raises(ValueError, match="not a layer"):
        in_parts(entries_for([len])[0], ["x"], ())
    with pytest.raises(ValueError, match="nothing in a to graph around mlp.experts"):
        in_parts(entries[0], [], [("mlp.experts", "reads the host")])
