"""Segmentation of a pipeline stage's layer list into runs of graph-capturable layers
(framework-neutral).

:func:`classify` describes each entry as a :class:`LayerEntry` (a layer, a shared layer, a plain
callable, or a layer marked with :func:`mark_not_capturable`); :func:`split_into_runs` covers the
entries with :class:`Run` objects in order: each maximal stretch of ordinary layers is one graphed
run, and every other entry an eager run of its own, so it never sits inside a graph; :func:`in_parts`
turns an entry a capture cannot hold whole into one graphed in parts (eager, its named parts graphed
in place). Entries that
are not :class:`LayerEntry` raise ``TypeError``, indices out of order ``ValueError``. Typical use::

    entries = [classify(i, obj, is_layer=is_layer, shared=obj in tied, sublayers=subs)
               for i, obj in enumerate(stage_items)]
    for run in split_into_runs(entries):
        ... wrap run.objects() in a graphed layer when run.graphed, else keep them eager
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

__all__ = [
    "mark_not_capturable",
    "not_capturable_reason",
    "EntryKind",
    "LayerEntry",
    "Run",
    "classify",
    "split_into_runs",
    "cut_runs",
    "in_parts",
    "describe_runs",
    "Parts",
]

# Attribute that carries the opt-out. Set on an instance it marks that layer; set on a class
# (``mark_not_capturable(MyLayer)``) it marks every instance of it.
_OPT_OUT_ATTR = "_paddle_graphpp_not_capturable"


def mark_not_capturable(layer: Any, reason: str = "marked with mark_not_capturable") -> Any:
    """Keep ``layer`` out of CUDA graphs: pipeline segmentation leaves it eager.

    Use it for layers whose work a graph cannot replay faithfully: data-dependent shapes
    (MoE routing, ``nonzero``), host synchronisation (``.item()``, printing), collectives
    of their own, or Python control flow that depends on tensor values. Marking a sublayer
    keeps every pipeline entry that contains it eager.

    Args:
        layer: a ``paddle.nn.Layer`` / ``torch.nn.Module`` instance, or a layer class (then
            every instance of the class is marked, including instances made later).
        reason: a short note, shown in segmentation reports (:func:`describe_runs`).

    Returns:
        ``layer`` itself, so it can wrap a constructor call or decorate a class.

    Raises:
        TypeError: ``layer`` is ``None`` or does not accept attributes (a built-in
            function, for instance: plain callables are never captured anyway).
    """
    if layer is None:
        raise TypeError("mark_not_capturable() got None; pass the layer instance or class to keep eager")
    try:
        setattr(layer, _OPT_OUT_ATTR, str(reason))
    except (AttributeError, TypeError) as exc:
        raise TypeError(
            f"mark_not_capturable() cannot mark {layer!r}: it does not accept attributes. "
            "Plain callables always stay eager; mark layers or layer classes only."
        ) from exc
    return layer


def not_capturable_reason(obj: Any) -> Optional[str]:
    """The reason ``obj`` was marked with :func:`mark_not_capturable`, or ``None`` if it was not."""
    return getattr(obj, _OPT_OUT_ATTR, None)


class EntryKind(enum.Enum):
    """What a stage entry is, as far as graph capture is concerned."""

    LAYER = "layer"
    """An ordinary layer: may join a graphed run."""
    SHARED = "shared"
    """A layer whose weights are shared with another stage or entry (tied embedding); eager."""
    CALLABLE = "callable"
    """A plain function or ``functools.partial``; eager."""
    OPTED_OUT = "opted_out"
    """A layer marked with :func:`mark_not_capturable` (or containing one); eager."""
    IN_PARTS = "in_parts"
    """A layer graphed in parts (:func:`in_parts`): its own forward eager, some of its sublayers
    graphed in place, around what a capture cannot hold (a mixture of experts' dispatch)."""


@dataclass(frozen=True, slots=True)
class LayerEntry:
    """One entry of a stage's ordered layer list, in framework-neutral terms.

    Attributes:
        index: position in the stage's list; entries handed to :func:`split_into_runs`
            must have consecutive indices.
        obj: the layer, module or callable itself (opaque to this module).
        kind: how segmentation treats it.
        name: a human-readable name for reports and errors.
        reason: why the entry stays eager (``None`` for :attr:`EntryKind.LAYER`).
        graphed_parts: for :attr:`EntryKind.IN_PARTS`, the names of its sublayers graphed in place.
        eager_parts: for :attr:`EntryKind.IN_PARTS`, ``(name, why)`` of what runs eagerly between them.
    """

    index: int
    obj: Any
    kind: EntryKind
    name: str
    reason: Optional[str] = None
    graphed_parts: tuple = ()
    eager_parts: tuple = ()

    @property
    def capturable(self) -> bool:
        return self.kind is EntryKind.LAYER


@dataclass(frozen=True, slots=True)
class Run:
    """A maximal slice of entries that is either graphed as one unit or kept eager.

    A graphed run holds one or more contiguous :attr:`EntryKind.LAYER` entries; an eager run
    holds exactly one entry of another kind.
    """

    graphed: bool
    entries: tuple

    @property
    def start(self) -> int:
        return self.entries[0].index

    @property
    def stop(self) -> int:
        return self.entries[-1].index + 1

    def objects(self) -> list:
        """The entries' objects, in order."""
        return [entry.obj for entry in self.entries]


def _entry_name(obj: Any) -> str:
    func = getattr(obj, "func", None)  # functools.partial
    if func is not None and not hasattr(obj, "__name__"):
        return f"partial({_entry_name(func)})"
    return getattr(obj, "__name__", None) or type(obj).__name__


def classify(
    index: int,
    obj: Any,
    *,
    is_layer: Callable[[Any], bool],
    shared: bool = False,
    sublayers: Optional[Iterable[Any]] = None,
    name: Optional[str] = None,
) -> LayerEntry:
    """Describe one stage entry as a :class:`LayerEntry`.

    Args:
        index: the entry's position in the stage's list.
        obj: the entry itself.
        is_layer: the framework's test for a layer/module instance
            (``lambda o: isinstance(o, paddle.nn.Layer)``).
        shared: the entry's weights are shared with another stage or entry.
        sublayers: the entry's descendant layers, so that an opted-out sublayer keeps the
            whole entry eager; ``None`` checks the entry only.
        name: a name for reports (the class or function name by default).

    Precedence: opted-out beats shared beats callable; a shared *callable* (a
    ``forward_func`` bound to a tied layer) is reported as shared.
    """
    name = name or _entry_name(obj)
    reason = not_capturable_reason(obj)
    if reason is None and sublayers is not None:
        for sub in sublayers:
            sub_reason = not_capturable_reason(sub)
            if sub_reason is not None:
                reason = f"contains {type(sub).__name__} ({sub_reason})"
                break
    if reason is not None:
        return LayerEntry(index, obj, EntryKind.OPTED_OUT, name, reason)
    if shared:
        return LayerEntry(index, obj, EntryKind.SHARED, name, "shared weights (gradients synced across stages)")
    if not is_layer(obj):
        return LayerEntry(index, obj, EntryKind.CALLABLE, name, "plain callable")
    return LayerEntry(index, obj, EntryKind.LAYER, name)


@dataclass(frozen=True)
class Parts:
    """How to graph a block (a layer, a pipeline entry) a capture cannot hold whole, as a
    runtime's adapter says: its sublayers to graph, each in place (``(name relative to the block,
    layer)``, in the block's order), and what runs eagerly between their graphs (``(relative name,
    why)``). The block's own forward runs eagerly and calls them as before.

    ``own_input``: ``(block, part)`` relative names of graphed parts that read a copy of a block's
    input of their own, the copies' gradients added up in eager autograd's order (Paddle, whose
    backward sums a tensor's gradients in the order its readers run: docs/moe.md)."""

    graphed: tuple
    eager: tuple
    own_input: tuple = ()


def in_parts(entry: LayerEntry, graphed: Sequence[str], eager: Sequence[tuple]) -> LayerEntry:
    """``entry`` (an ordinary layer) as one graphed in parts: eager in the stage's runs, with the
    sublayers named in ``graphed`` graphed in place and ``eager``'s ``(name, why)`` between them.

    Raises:
        ValueError: ``entry`` is not :attr:`EntryKind.LAYER`, or ``graphed`` is empty.
    """
    if entry.kind is not EntryKind.LAYER:
        raise ValueError(f"in_parts(): {entry.name} is {entry.kind.value}, not a layer; only layers are graphed "
                         f"in parts")
    if not graphed:
        raise ValueError(f"in_parts(): nothing in {entry.name} to graph around {', '.join(n for n, _ in eager)}")
    return LayerEntry(entry.index, entry.obj, EntryKind.IN_PARTS, entry.name,
                      "graphed in parts: its own forward runs eagerly, calling the parts graphed in place",
                      tuple(graphed), tuple(eager))


def split_into_runs(entries: Sequence[LayerEntry]) -> list:
    """Split an ordered stage into graphed runs of contiguous layers and single eager entries.

    Args:
        entries: the stage's entries in execution order, with consecutive indices.

    Returns:
        ``list[Run]`` covering every entry exactly once, in order. Each maximal stretch of
        :attr:`EntryKind.LAYER` entries is one graphed run; every other entry is an eager run
        of its own, so shared layers, callables and opted-out layers always sit between
        graphs, never inside one.

    Raises:
        TypeError: an item is not a :class:`LayerEntry`.
        ValueError: indices are not consecutive (an entry was dropped or reordered).
    """
    runs: list = []
    pending: list = []
    previous = None
    for entry in entries:
        if not isinstance(entry, LayerEntry):
            raise TypeError(f"split_into_runs() expects LayerEntry items (use classify()), got {entry!r}")
        if previous is not None and entry.index != previous.index + 1:
            raise ValueError(
                f"stage entries must be consecutive: {entry.name} has index {entry.index} "
                f"after {previous.name} at {previous.index}; pass the stage's full list in order"
            )
        previous = entry
        if entry.capturable:
            pending.append(entry)
            continue
        if pending:
            runs.append(Run(True, tuple(pending)))
            pending = []
        runs.append(Run(False, (entry,)))
    if pending:
        runs.append(Run(True, tuple(pending)))
    return runs


def cut_runs(runs: Sequence[Run], every: int, start: int = 0) -> list:
    """Cut the graphed runs of ``runs`` where a new group of ``every`` entries begins.

    Groups are counted from index ``start`` (``[start, start+every)``, ``[start+every, ...)``):
    fleet's ``recompute_interval`` recomputes a stage's entries in such groups, and a graphed
    run that recomputes must not span two of them. Eager runs hold one entry and stay as they are.

    Raises:
        ValueError: ``every`` is not a positive int.
    """
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"cut_runs() needs a positive group size, got {every!r}")
    out: list = []
    for run in runs:
        if not run.graphed:
            out.append(run)
            continue
        piece: list = []
        for entry in run.entries:
            if piece and (entry.index - start) % every == 0:
                out.append(Run(True, tuple(piece)))
                piece = []
            piece.append(entry)
        out.append(Run(True, tuple(piece)))
    return out


def describe_runs(runs: Sequence[Run]) -> str:
    """One line per run, e.g. ``graphed [1:4) Block, Block, Block`` / ``eager [4] Head: shared weights``;
    under an entry graphed in parts, one line for its graphed parts and one per eager part, indented."""
    lines = []
    for run in runs:
        if run.graphed:
            names = ", ".join(entry.name for entry in run.entries)
            lines.append(f"graphed [{run.start}:{run.stop}) {names}")
        else:
            entry = run.entries[0]
            lines.append(f"eager   [{entry.index}] {entry.name}: {entry.reason}")
            if entry.graphed_parts:
                lines.append(f"    graphed in place: {', '.join(entry.graphed_parts)}")
            lines.extend(f"    eager: {name}: {why}" for name, why in entry.eager_parts)
    return "\n".join(lines)
