"""The settings of one graphed layer, declared once: :class:`EngineOptions`.

Every front door (each framework's graphed layer class, and the functions that graph a model's
blocks, stages or loss) takes these settings as keyword arguments, or as one
``options=EngineOptions(...)`` object, and hands them to the engine through
:func:`engine_options`; none declares them again. Each field's documentation lives here, in its
``doc`` metadata, and :func:`options_doc` renders it into the front doors' docstrings, so the
text is written once too. What a runtime adds to an option (which generators it finds itself,
which hooks keep ``accumulate_grads`` off) its front door says.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from . import memory as _memory

__all__ = ["EngineOptions", "engine_options", "options_doc", "GRAPHED_LAYER_DOC", "graphed_layer_doc",
           "compiler_options"]

_FALLBACKS = ("error", "eager")


def compiler_options(value: Any, owner: str, option: str, compiler: str, keys: Sequence[str]) -> Optional[dict]:
    """The keyword arguments a graphed layer's compiler option (``compile=``, ``to_static=``)
    stands for: ``None`` for ``False``/``None``, ``{}`` for ``True``, a copy of a dict whose keys
    are among ``keys``. The framework checks the values.

    Raises:
        TypeError: ``value`` is neither a bool nor a dict.
        ValueError: a key not in ``keys``.
    """
    if value is None or value is False:
        return None
    if value is not True and not isinstance(value, dict):
        raise TypeError(f"{owner}: {option} must be True, False or a dict of {compiler} keyword arguments (some of "
                        f"{list(keys)}), got {type(value).__name__}")
    options = {} if value is True else dict(value)
    unknown = sorted(set(options) - set(keys))
    if unknown:
        raise ValueError(f"{owner}: {option}={{...}} has {unknown}, which a graphed layer does not pass to {compiler}; "
                         f"use some of {list(keys)}")
    return options


def _option(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": " ".join(doc.split())})


@dataclass(kw_only=True, slots=True)
class EngineOptions:
    """Settings of one graphed layer, checked when the layer is built (each field below)."""

    num_warmup_steps: int = _option(3, """
        Eager calls per input signature before it is recorded (recording also waits for an
        episode start: a moment when no micro-batch is in flight). Also taken positionally, after
        the wrapped object, by every front door.""")
    fallback: str = _option("error", """
        ``"error"`` (default): a failed capture raises :class:`paddle_graphpp.CaptureError`.
        ``"eager"``: warn once and keep running the layer eagerly.""")
    memory: str = _option("shared", """
        ``"shared"`` (default: one pool for all graphs, captured in execution order, static
        buffers shared by lifetime) or ``"per_graph"`` (a pool per graph); see
        :mod:`paddle_graphpp.core.memory`.""")
    max_in_flight: int = _option(64, """
        Forwards that may wait for their backward before that is an error.""")
    max_signatures: int = _option(4, """
        Input signatures captured per layer; further new ones run eagerly with a warning.""")
    accumulate_grads: Any = _option("auto", """
        ``"auto"`` (default): the backward graph adds parameter gradients into ``.grad`` itself
        (one in-graph add per parameter; ``.grad`` becomes a buffer the layer owns) where the
        runtime can, no parameter's gradient accumulation runs hooks and no parameter gets
        gradient from outside the layer too (another graphed layer holding it, a weight handed to
        the layer as an argument). Where the hooks add into a buffer of their library's own
        (Megatron-Core's ``main_grad``) the graph adds there instead and hands the hooks zeros.
        Elsewhere the graph writes them into a buffer of the layer that autograd adds to
        ``.grad``, so the hooks see every gradient and autograd sums a shared weight's parts in
        eager's order. ``True`` forces one of the first two (an error where the runtime cannot,
        with other hooks, or with such a weight); ``False`` the third (a second set of gradient
        buffers, and one more pass over them per micro-batch).""")
    generators: Any = _option(None, """
        Random generators the layer draws from besides the framework's default one (always
        registered): a list or tuple, or a callable returning one at each capture. Each capture
        registers them, so every replay draws fresh numbers from them.""")
    recompute: bool = _option(False, """
        Recompute the forward inside the backward graph (activation checkpointing): the forward
        graph keeps no activations, only the static inputs, and the backward graph runs the
        forward again before its backward, drawing the same random numbers as the forward did.
        Eager calls (warmup, the recorded step, a fallback) run under the framework's own
        checkpointing. Not with the stream-ordered allocator, nor with a zero-bubble schedule's
        split backward.""")

    def validate(self, owner: str) -> "_memory.MemoryMode":
        if not isinstance(self.num_warmup_steps, int) or self.num_warmup_steps < 0:
            raise ValueError(f"{owner}: num_warmup_steps must be an int >= 0, got {self.num_warmup_steps!r}")
        if self.fallback not in _FALLBACKS:
            raise ValueError(f"{owner}: fallback must be one of {_FALLBACKS}, got {self.fallback!r}")
        if not isinstance(self.max_signatures, int) or self.max_signatures < 1:
            raise ValueError(f"{owner}: max_signatures must be an int >= 1, got {self.max_signatures!r}")
        if not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise ValueError(f"{owner}: max_in_flight must be an int >= 1, got {self.max_in_flight!r}")
        if not (isinstance(self.accumulate_grads, bool) or self.accumulate_grads == "auto"):
            raise ValueError(f"{owner}: accumulate_grads must be a bool or 'auto', got {self.accumulate_grads!r}")
        if not (self.generators is None or callable(self.generators)
                or isinstance(self.generators, (list, tuple))):
            raise ValueError(f"{owner}: generators must be a list or tuple of generators, or a callable returning "
                             f"one, got {type(self.generators).__name__}")
        if not isinstance(self.recompute, bool):
            raise ValueError(f"{owner}: recompute must be a bool, got {self.recompute!r}")
        return _memory.MemoryMode.parse(self.memory, owner)


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(EngineOptions))


def engine_options(owner: str, door: Callable, positional: Sequence[Any], keywords: Mapping[str, Any], *,
                   options: Optional[EngineOptions] = None,
                   refused: Mapping[str, str] | None = None) -> EngineOptions:
    """The engine options a front door was called with: ``options`` (default: the defaults) with
    the keyword arguments ``keywords`` in place of its fields, and ``positional`` (at most one
    value, given right after the wrapped object) as ``num_warmup_steps``.

    Args:
        owner: the front door's name in messages (``"graph_layers()"``).
        door: the front door's function (its own keyword arguments are listed in messages).
        refused: options this front door does not take, each with the reason (an option it
            would ignore is refused, not accepted).

    Raises:
        TypeError: a keyword that is neither an engine option nor the door's own (the message
            names the door and every valid name), a refused option, more than one positional
            option, ``num_warmup_steps`` given twice, or ``options`` not an ``EngineOptions``.
    """
    refused = refused or {}
    if options is not None and not isinstance(options, EngineOptions):
        raise TypeError(f"{owner}: options must be a paddle_graphpp.EngineOptions, got {type(options).__name__}")
    unknown = sorted(set(keywords) - set(OPTION_NAMES))
    if unknown:
        taken = [n for n in OPTION_NAMES if n not in refused]
        raise TypeError(f"{owner} got unexpected keyword argument(s) {unknown}; it takes {_own_arguments(door)} and "
                        f"the engine options {taken} (paddle_graphpp.EngineOptions)")
    values = dict(keywords)
    if len(positional) > 1:
        raise TypeError(f"{owner} takes one positional option (num_warmup_steps) after what it wraps, got "
                        f"{len(positional)}; pass the others by keyword")
    if positional:
        if "num_warmup_steps" in values:
            raise TypeError(f"{owner} got num_warmup_steps both positionally and by keyword; pass it once")
        values["num_warmup_steps"] = positional[0]
    chosen = dataclasses.replace(options, **values) if options is not None else EngineOptions(**values)
    default = EngineOptions()
    for name, reason in refused.items():
        if name in keywords or getattr(chosen, name) != getattr(default, name):
            raise TypeError(f"{owner} takes no {name}: {reason}")
    return chosen


def _own_arguments(door: Callable) -> list:
    params = inspect.signature(door).parameters.values()
    return [p.name for p in params if p.name != "self"
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]


def options_doc(*, refused: Sequence[str] = (), notes: Mapping[str, str] | None = None, indent: int = 8) -> str:
    """The ``Args:`` entries of the engine options, as a front door's docstring lists them: one
    per field of :class:`EngineOptions` but ``refused``, each followed by the front door's own
    ``notes`` on it (what its runtime adds), indented by ``indent`` spaces."""
    notes = notes or {}
    entries = []
    for f in dataclasses.fields(EngineOptions):
        if f.name in refused:
            continue
        text = f.metadata["doc"] + (" " + " ".join(notes[f.name].split()) if f.name in notes else "")
        entries.append(textwrap.fill(f"{f.name}: {text}", width=96, initial_indent=" " * indent,
                                     subsequent_indent=" " * (indent + 4)))
    return "\n".join(entries) + "\n"


EngineOptions.__doc__ += "\n\n    Attributes:\n" + options_doc(indent=8)

#: The documentation of both frameworks' graphed layer classes (formatted per framework).
GRAPHED_LAYER_DOC = """Wrap ``{arg}`` so that, after warmup, its forward and backward replay CUDA graphs.

    Calls ``1..num_warmup_steps`` run eagerly. The next step (from a moment no micro-batch is
    in flight) runs eagerly too and is recorded; at the start of the step after it, every
    recorded micro-batch position of every graphed layer is captured in the order the step
    ran them, into one memory pool, and that step replays. Each position of the schedule
    gets its own forward/backward graph pair; backwards pair with forwards in FIFO order, so
    1F1B and interleaved schedules work.

    The engine options (:class:`paddle_graphpp.EngineOptions`) are taken as keyword arguments,
    or as one ``options=EngineOptions(...)`` (keyword arguments then replace its fields).

    Args:
        {arg}: the {base} to graph. Its parameters must stay on the GPU at fixed addresses.
{options}{extra}        options: an :class:`paddle_graphpp.EngineOptions` holding the options above.
        name: the name used in messages (default: the class name of ``{arg}``).

    Without CUDA (or with CPU inputs) it runs eagerly and warns once. Under ``{no_grad}`` it
    always runs eagerly.

    ``undo()`` releases the graphs and returns ``{arg}``, which graphing leaves unchanged (the
    wrapper refuses calls afterwards).

    .. warning:: Outputs alias graph memory until the same micro-batch position is replayed
       again, or, for an output the recorded step had freed within the step, until the graphs
       captured after that point run. {outputs}
    .. warning:: Do not modify outputs in place, and do not replace parameters or buffers
       (assigning new tensors or storage to them, changing their dtype) after capture: graphs
       read fixed addresses, and the next replay raises
       :class:`paddle_graphpp.StateReplacedError` (call :func:`paddle_graphpp.reset_graphs`
       on the model to capture anew). In-place updates (optimizers, ``load_state_dict``) are fine.
    .. warning:: Code inside must not synchronise with the host (reading a tensor's value on the
       host, printing tensors, data-dependent shapes); capture fails with a
       :class:`paddle_graphpp.CaptureError`. Other exceptions raised by its code during capture
       keep their type, with the layer named.
    .. warning:: Gradient hooks on tensors inside the wrapped {base} run at capture only; hooks
       on its inputs, outputs and parameters work as usual.
    .. warning:: The schedule must repeat every step: graphs are replayed in capture order, and a
       different order raises :class:`paddle_graphpp.GraphScheduleError` (use ``memory="per_graph"``).
{warnings}"""


def graphed_layer_doc(*, arg: str, base: str, no_grad: str, outputs: str, refused: Sequence[str] = (),
                      notes: Mapping[str, str] | None = None, extra_args: str = "", warnings: str = "") -> str:
    """:data:`GRAPHED_LAYER_DOC` for one framework's class: ``outputs`` completes the warning on
    outputs (what the runtime does with one still referenced); ``refused``, ``notes``: see
    :func:`options_doc`; ``extra_args``: the entries of the class's own arguments, indented as
    the others; ``warnings``: the framework's own ``.. warning::`` entries."""
    return GRAPHED_LAYER_DOC.format(arg=arg, base=base, no_grad=no_grad, outputs=outputs,
                                    options=options_doc(refused=refused, notes=notes), extra=extra_args,
                                    warnings=warnings)
