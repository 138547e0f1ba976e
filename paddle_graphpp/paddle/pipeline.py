"""Fleet pipeline models with each stage split into CUDA-graphed runs of layers.

:func:`graph_pipeline` graphs a built fleet ``PipelineLayer`` (or subclass, PaddleFormers' pipe
models included) in place, on every rank: each chunk's contiguous capturable layers become one
:class:`paddle_graphpp.CUDAGraphedLayer` in fleet's ``run_function`` lists; shared layers, plain
callables and marked layers stay eager. An entry an adapter says a capture cannot hold whole (a
mixture of experts whose dispatch reads the host) stays eager and is graphed in parts: the
sublayers the adapter names (attention) are graphed in place (:mod:`.in_place`).
:class:`PipelineLayer` is fleet's class that checks its configuration and makes the CPU
adjustments before building, then graphs itself with ``use_cudagraph=True``. Names,
``state_dict()`` keys and parameters are unchanged; ``GraphedPipeline.undo()`` restores fleet's
lists and the classes of the sublayers graphed in place.

Failure modes: a model or configuration the graphed runs cannot take over is refused before
anything changes (``TypeError`` / ``ValueError`` naming the fix); what fleet and other libraries
add is asked of their adapters (:mod:`paddle_graphpp.paddle.integrations`) when graphing starts.
Design, schedules, recompute and DualPipeV: docs/paddle.md.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

from paddle import nn
from paddle.distributed import fleet

from paddle_graphpp.core.segment import (EntryKind, LayerEntry, classify, cut_runs, describe_runs, in_parts,
                                         split_into_runs)
from paddle_graphpp.paddle import fleet_cpu
from paddle_graphpp.paddle import integrations
from paddle_graphpp.paddle import pipeline_recompute as _recompute
from paddle_graphpp.paddle.integrations import fleet as _fleet
from paddle_graphpp.core.layer import EngineHooks
from paddle_graphpp.core.options import EngineOptions
from paddle_graphpp.paddle.compile import to_static_options
from paddle_graphpp.paddle.graphed import CUDAGraphedLayer, paddle_engine_options
from paddle_graphpp.paddle.in_place import graphed_forward, swap_in, ungraph_in_place
from paddle_graphpp.paddle.own_input import OwnInput
from paddle_graphpp.paddle.loss import graph_loss

__all__ = ["graph_pipeline", "GraphedPipeline", "PipelineLayer"]

# Set on a graphed model: its GraphedPipeline.
_GRAPHS_ATTR = "_paddle_graphpp_pipeline"
_ABSENT = object()
# The model's instance attributes graph_pipeline sets (GraphedPipeline.undo puts back what was there).
_SET_ON_MODEL = ("save_state_dict", "set_state_dir", "use_cudagraph")


class _RunBody(nn.Layer):
    """The layers of one graphed run, called in sequence as fleet calls them (``x = layer(x)``)."""

    def __init__(self, layers):
        super().__init__()
        self._run = list(layers)
        for idx, layer in enumerate(self._run):
            self.add_sublayer(str(idx), layer)
        self.recomputes = False  # set per call by its _GraphedRunCall, from fleet's recompute group

    def graph_engine_hooks(self, name: str, options: EngineOptions) -> EngineHooks:
        """Its calls recompute with the ``recompute`` option, or when its recompute group does."""
        return EngineHooks(recomputes=lambda: options.recompute or self.recomputes)

    @property
    def training(self):
        # The run is no sublayer of the pipeline model, its layers are: model.train() and
        # model.eval() set them, and the engine keys its captures on this value.
        modes = {layer.training for layer in self.__dict__.get("_run", ())}
        if len(modes) <= 1:
            return modes.pop() if modes else True
        return tuple(layer.training for layer in self._run)

    @training.setter
    def training(self, mode):
        pass  # follows the layers (see the getter)

    def forward(self, *inputs):
        x = inputs[0] if len(inputs) == 1 else tuple(inputs)
        for layer in self._run:
            x = layer(x)
        return x


class _GraphedRunCall:
    """The ``run_function`` entry of a graphed run: unpacks fleet's tuple into graph inputs.

    Deliberately not an ``nn.Layer``: the run's layers stay registered under their upstream
    names only, so ``state_dict()`` keys and optimizer parameter lists are unchanged.

    With ``recompute_interval > 0`` it belongs to one of fleet's recompute groups (``group``,
    set by :func:`.pipeline_recompute.in_groups`; ``opens``: it is the group's first entry) and
    its call recomputes when the group does (the run body's ``recomputes``, read by the engine per call).
    """

    def __init__(self, graphed, run, name):
        self.graphed = graphed
        self.run = run
        self.name = name
        self.group = None
        self.opens = False

    def __call__(self, x):
        if self.group is not None:
            self.graphed.layer.recomputes = self.group.enter(x) if self.opens else self.group.active
        return self.graphed(*x) if isinstance(x, tuple) else self.graphed(x)

    def __repr__(self):
        return f"GraphedRun({self.name})"


@dataclass(slots=True)
class _Chunk:
    """One stage (or virtual chunk) of this rank: fleet's entry list and how it was split."""

    chunk_id: Optional[int]
    run_function: list  # fleet's own list object, edited in place
    eager: list  # its entries as fleet built them, one per layer
    graphed: list  # its entries with each graphed run in one entry
    runs: list  # core.segment.Run, in order


class GraphedPipeline:
    """The graphed runs :func:`graph_pipeline` made of one pipeline model (on this rank)."""

    def __init__(self, model, chunks, graphed_layers, graphed_loss=None, recompute_interval=0, attributes=None,
                 parts=(), own_inputs=()):
        self.model = model
        self._parts = list(parts)  # the sublayers graphed in place (of entries graphed in parts)
        self._own_inputs = list(own_inputs)  # those of them reading their own copy of a block's input
        self._chunks = chunks
        self._graphed_layers = graphed_layers
        self.graphed_loss = graphed_loss  # the GraphedLoss in fleet's loss list, or None
        #: fleet's ``recompute_interval`` of the model as built (its ``_recompute_interval`` is 0
        #: outside :meth:`eager_view`: the graphed entries recompute themselves)
        self.recompute_interval = recompute_interval
        self._attributes = attributes or {}  # the model's instance attributes graphing set: their values before

    @staticmethod
    def of(model) -> Optional["GraphedPipeline"]:
        """The graphs of ``model`` (a fleet pipeline model or its ``fleet.distributed_model``
        wrapper), or ``None`` if it was not graphed."""
        return getattr(_fleet.unwrap(model), _GRAPHS_ATTR, None)

    def segmentation_report(self) -> str:
        """How this rank's chunks were split: one line per graphed or eager run; under an entry
        graphed in parts, its sublayers graphed in place and what stays eager, and why; a line
        for each part graphed in place that is still eager, or stays eager, reading its own copy
        of its block's input (:class:`~paddle_graphpp.paddle.own_input.OwnInput`)."""
        lines = []
        stage = _fleet.stage_id(self.model)
        for chunk in self._chunks:
            lines.append(f"stage {stage}" + (f" chunk {chunk.chunk_id}" if chunk.chunk_id is not None else "") + ":")
            lines.extend("  " + line for line in describe_runs(chunk.runs).splitlines())
        lines.extend(line for own in self._own_inputs for line in own.describe())
        if self.recompute_interval:
            lines.append(f"recompute_interval={self.recompute_interval}: graphed runs recompute inside their own "
                         f"graphs, eager entries under fleet's recompute_hybrid")
        if self.graphed_loss is not None:
            lines.append(f"loss: graphed ({self.graphed_loss.graphed.engine.name})")
        return "\n".join(lines)

    def graphed_layers(self) -> list:
        """The :class:`paddle_graphpp.CUDAGraphedLayer` of each graphed run and of each sublayer
        graphed in place on this rank, in layer order."""
        return list(self._graphed_layers)

    def undo(self):
        """Undo :func:`graph_pipeline` on this rank: fleet's per-layer ``run_function`` lists, loss
        list and ``_recompute_interval`` as built, the model's ``save_state_dict``,
        ``set_state_dir`` and ``use_cudagraph`` as before, the sublayers graphed in place with
        their own classes back, and every graphed run's and part's graphs released. Call it on
        every rank, between steps. Returns the model (the pipeline layer, also when a
        ``fleet.distributed_model`` wrapper was graphed); it can be graphed again.

        Raises:
            GraphScheduleError: a graphed run has micro-batches in flight (run their backwards
                first). Nothing is changed then.
            RuntimeError: undone already.
        """
        model = self.model
        if model.__dict__.get(_GRAPHS_ATTR) is not self:
            raise RuntimeError(f"GraphedPipeline({type(model).__name__}): undo() was called twice; the model is not "
                               f"graphed by it any more (graph_pipeline(model) graphs it again)")
        engines = [layer.engine for layer in self._graphed_layers]
        if self.graphed_loss is not None:
            engines.append(self.graphed_loss.graphed.engine)
        for engine in engines:
            engine.check_undo()
        for engine in engines:
            engine.retire("the model runs its layers eagerly again (GraphedPipeline.undo())")
        for chunk in self._chunks:
            chunk.run_function[:] = chunk.eager
        for own in self._own_inputs:
            own.remove()
        ungraph_in_place(self._parts)
        _fleet.set_recompute_interval(model, self.recompute_interval)
        if self.graphed_loss is not None:
            losses = _fleet.loss_functions(model)
            losses[losses.index(self.graphed_loss)] = self.graphed_loss.loss_fn
        for attr, value in self._attributes.items():
            if value is _ABSENT:
                model.__dict__.pop(attr, None)
            else:
                model.__dict__[attr] = value
        del model.__dict__[_GRAPHS_ATTR]
        return model

    @contextlib.contextmanager
    def eager_view(self):
        """Show fleet's per-layer ``run_function`` lists inside the block (graphs otherwise), and
        its ``_recompute_interval`` as built.

        ``save_state_dict`` / ``set_state_dir`` of the model use it already; code that searches
        ``run_function`` for a layer of some type needs it too.
        """
        for chunk in self._chunks:
            chunk.run_function[:] = chunk.eager
        _fleet.set_recompute_interval(self.model, self.recompute_interval)
        try:
            yield
        finally:
            for chunk in self._chunks:
                chunk.run_function[:] = chunk.graphed
            _fleet.set_recompute_interval(self.model, 0)


def graph_pipeline(model, *, graph_loss: bool = False, to_static=False, options: Optional[EngineOptions] = None,
                   **engine_kwargs) -> GraphedPipeline:
    """Graph an already-built fleet pipeline model in place; returns its :class:`GraphedPipeline`.

    Args:
        model: an instance of ``paddle.distributed.fleet.meta_parallel.PipelineLayer`` or of a
            subclass (PaddleFormers' ``LlamaForCausalLMPipe``, ...), 1F1B, interleaved or DualPipeV, built
            with ``use_cudagraph=False``; or its ``fleet.distributed_model`` wrapper. Call it
            on every rank, before the first training step.
        graph_loss: graph the model's loss function too (the last stage's), so that its
            temporaries share the graphs' pool instead of memory of their own (docs/memory.md has
            the measured effect on a last stage). Each call returns its
            own loss tensor. Needs one loss function without trainable parameters.
        to_static: ``True`` or a dict of ``paddle.jit.to_static`` keyword arguments
            (``full_graph``, ``backend``, ``build_strategy``, ``input_spec``): each graphed run's
            layers run converted inside its graphs, converted in the warmup calls and captured
            (see :class:`paddle_graphpp.CUDAGraphedLayer`); eager layers, sublayers graphed in
            place and the loss function are not converted. Without CUDA the runs execute
            converted and eagerly. Layers the user converted already
            (``paddle.jit.to_static(layer)`` in the layer list) run converted without this
            option; with it they need ``{"full_graph": True}`` (Paddle 3.3.1's SOT fails on code
            that calls a converted layer, so that is refused here).
        options, **engine_kwargs: the engine options of every graphed run (and the graphed
            loss): an :class:`paddle_graphpp.EngineOptions`, or its fields by keyword, as
            :class:`paddle_graphpp.CUDAGraphedLayer` takes them.

    Parameter names, ``state_dict()`` keys and parameters are unchanged, so an optimizer
    built before the call stays valid. ``GraphedPipeline.of(model)`` returns the result again;
    its ``undo()`` puts fleet's lists and the model's attributes back and releases the graphs.

    Recompute: with fleet's ``recompute_interval > 0`` each graphed run is cut where one of fleet's
    recompute groups begins and recomputes inside its own graphs when fleet would recompute its
    group (the engine's ``recompute``: the forward graph keeps no activations, the backward graph
    runs the forward again, drawing the forward's random numbers); eager entries of a group run
    under fleet's ``recompute_hybrid``. Each graphed run is called once per micro-batch forward,
    as without recompute. The model's ``_recompute_interval`` reads 0 afterwards (the entries
    recompute themselves), fleet's value inside ``GraphedPipeline.eager_view()``; set it before
    this call (PaddleFormers' pipe models build with 0 and a ``recompute_ctx``). ``recompute=True``
    makes every graphed run recompute.

    Raises:
        TypeError: ``model`` is not a fleet pipeline model.
        RuntimeError: ``model`` is graphed already (by this function, by
            :class:`PipelineLayer` or through :func:`paddle_graphpp.install`); or this Paddle's
            ``PipelineLayer`` does not keep its layers in ``run_function`` lists (the error
            names the version).
        ValueError: ``model`` was built with upstream's ``use_cudagraph=True`` (its layers sit
            in Paddle's own ``CUDAGraphedLayer``), holds a layer or callable graphed already by
            PaddleFormers' ``autocudagraph`` decorator (no graph inside a graph), recomputes in a
            way graphed runs cannot take over (a PaddleFormers config's
            ``recompute_granularity``; ``recompute_interval > 0`` with ``use_dualpipev`` or with
            ``recompute_ctx`` offload or partition), or the strategy declares dynamic shapes;
            ``graph_loss`` with several loss functions or a loss with trainable parameters.
            Nothing is changed then.
        TypeError, ValueError: an invalid ``to_static`` (not a bool or dict, an unknown key or
            backend, ``input_spec`` without ``full_graph=True``, SOT without the PIR API), or
            with SOT a graphed run holding a layer converted already; the message names the
            model or the run, and the fix. Nothing is changed then.

    Warnings:
        * Every micro-batch must have the same shapes (pad sequences): a graph replays the
          shapes it captured.
        * A layer that synchronises with the host, communicates, or has data-dependent shapes
          must be marked with :func:`paddle_graphpp.mark_not_capturable` before this call,
          unless an adapter graphs it in parts: PaddleFormers' decoder layers with a mixture of
          experts stay eager, their attention, router and shared experts graphed in place (the
          router and shared experts from the micro-batch after the first backward, or eager with
          one warning where a graph of them would not sum their input's gradient as eagerly:
          docs/moe.md); with
          ``recompute_interval > 0`` such a layer stays eager whole.
        * ``run_function`` holds graphed runs, not single layers, afterwards: code that looks
          for a layer there must do so inside ``GraphedPipeline.eager_view()``.
    """
    chosen = paddle_engine_options("graph_pipeline()", graph_pipeline, (), engine_kwargs, options)
    model = _fleet.unwrap(model)
    name = type(model).__name__
    adapters = integrations.adapters()  # asked here, when graphing starts, never per call
    for adapter in adapters:
        adapter.start(model)
    if not isinstance(model, _fleet.PipelineLayer):
        raise TypeError(
            f"graph_pipeline() needs a fleet pipeline model (an instance of "
            f"paddle.distributed.fleet.meta_parallel.PipelineLayer or a subclass), got {name}; "
            "wrap a single layer with paddle_graphpp.CUDAGraphedLayer instead")
    if GraphedPipeline.of(model) is not None:
        raise RuntimeError(
            f"graph_pipeline({name}): the model is graphed already (by graph_pipeline, "
            "paddle_graphpp.PipelineLayer(use_cudagraph=True) or a use_cudagraph flag after "
            "paddle_graphpp.install()); graph each model once")
    containers = _fleet.entry_lists(model)
    interval = _fleet.recompute_interval(model)
    for adapter in adapters:
        adapter.refuse(model, f"graph_pipeline({name})", containers)
    loss_fn = _loss_to_graph(model, name) if graph_loss else None
    to_static_options(to_static, f"graph_pipeline({name}, to_static=...)")

    shared_keys = _fleet.shared_keys(model)
    chunks, graphed_layers, parts = [], [], []  # parts: (sublayer, its CUDAGraphedLayer)
    reading_copies = []  # (entry's layer, block, [(label, part, its layer)]): parts to read copies of its input
    for chunk_id, start, run_function in containers:
        eager = list(run_function)
        prefix = f"stage{_fleet.stage_id(model)}" + (f".chunk{chunk_id}" if chunk_id is not None else "")
        split = [_in_parts(_classify(start + i, obj, shared_keys), adapters, interval) for i, obj in enumerate(eager)]
        runs = split_into_runs([entry for entry, _ in split])
        if interval > 0:  # no graphed run across two of fleet's recompute groups
            runs = cut_runs(runs, interval, start)
        graphed = []
        for run in runs:
            if not run.graphed:
                graphed.append(run.entries[0].obj)
                entry, in_parts_of = split[run.start - start]
                if in_parts_of is None:
                    continue
                label = f"{prefix}.layers[{run.start}]"
                layers = {}
                for rel, part in in_parts_of.graphed:  # an entry graphed in parts
                    layer = layers[rel] = graphed_forward(f"{label}.{rel}", part, options=chosen)
                    graphed_layers.append(layer)
                    parts.append((part, layer))
                for block in dict.fromkeys(block for block, _ in in_parts_of.own_input):
                    reading_copies.append((entry.obj, block, [(f"{label}.{rel}", rel, layers[rel])
                                                              for of, rel in in_parts_of.own_input if of == block]))
                continue
            label = f"{prefix}.layers[{run.start}:{run.stop}]"
            layer = CUDAGraphedLayer(_RunBody(run.objects()), name=label, to_static=to_static, options=chosen)
            graphed_layers.append(layer)
            graphed.append(_GraphedRunCall(layer, run, label))
        if interval > 0:
            graphed = _recompute.in_groups(model, runs, graphed, start, interval)
        chunks.append(_Chunk(chunk_id, run_function, eager, graphed, runs))
    for part, layer in parts:  # every run and part built (and its options checked) before anything changes
        swap_in(part, layer)
    own_inputs = [OwnInput(entry, entry.get_sublayer(block),
                           [(label, entry.get_sublayer(rel), layer) for label, rel, layer in reading])
                  for entry, block, reading in reading_copies]
    for chunk in chunks:
        chunk.run_function[:] = chunk.graphed
    _fleet.set_recompute_interval(model, 0)  # the entries recompute themselves (pipeline_recompute)

    graphed_loss = None if loss_fn is None else _graph_loss(model, loss_fn, chosen)
    before = {attr: model.__dict__.get(attr, _ABSENT) for attr in _SET_ON_MODEL}
    graphs = GraphedPipeline(model, chunks, graphed_layers, graphed_loss, interval, before,
                             parts=[part for part, _ in parts], own_inputs=own_inputs)
    setattr(model, _GRAPHS_ATTR, graphs)
    for method in ("save_state_dict", "set_state_dir"):
        _with_eager_view(model, method, graphs)
    model.use_cudagraph = True
    return graphs


def _loss_to_graph(model, name):
    """The model's one loss function, checked for graphing (errors name the call and the fix)."""
    losses = [fn for fn in _fleet.loss_functions(model) if fn is not None]
    if len(losses) != 1:
        raise ValueError(
            f"graph_pipeline({name}, graph_loss=True) graphs one loss function, the model has {len(losses)}: "
            "fleet runs every loss function's forward but back-propagates one, so a graphed one would wait "
            "for a backward forever. Pass graph_loss=False")
    loss_fn = losses[0]
    trainable = ([n for n, p in loss_fn.named_parameters() if not p.stop_gradient]
                 if isinstance(loss_fn, nn.Layer) else [])
    if trainable:
        raise ValueError(
            f"graph_pipeline({name}, graph_loss=True): the loss {type(loss_fn).__name__} has trainable "
            f"parameters {trainable[:4]}; keep it eager (graph_loss=False) or move them into the last stage")
    return loss_fn


def _graph_loss(model, loss_fn, options: EngineOptions):
    """:func:`~paddle_graphpp.paddle.loss.graph_loss` of the model's loss, put in fleet's loss list."""
    graphed = graph_loss(loss_fn, name=f"stage{_fleet.stage_id(model)}.loss", options=options)
    losses = _fleet.loss_functions(model)
    losses[losses.index(loss_fn)] = graphed
    return graphed


def _classify(index, obj, shared_keys):
    target = obj.args[0] if isinstance(obj, functools.partial) and obj.args else obj
    key = shared_keys.get(id(target))
    is_layer = isinstance(obj, nn.Layer)
    name = (f"shared:{key}" if key is not None else
            f"{type(obj).__name__}#{index}" if is_layer else
            f"{getattr(obj, '__name__', type(obj).__name__)}#{index}")
    return classify(index, obj, is_layer=lambda o: isinstance(o, nn.Layer), shared=key is not None,
                    sublayers=obj.sublayers() if is_layer else None, name=name)


def _in_parts(entry, adapters, interval):
    """``(entry, parts)``: an ordinary layer the adapters graph in parts
    (:meth:`~paddle_graphpp.paddle.integrations.Adapter.graph_parts`) as such, with its
    :class:`~paddle_graphpp.core.segment.Parts`; any other entry as it is, with ``None``."""
    if entry.kind is not EntryKind.LAYER:
        return entry, None
    parts = integrations.graph_parts(adapters, entry.name, entry.obj)
    if parts is None:
        return entry, None
    if not parts.graphed:
        return LayerEntry(entry.index, entry.obj, EntryKind.OPTED_OUT, entry.name,
                          "eager whole: it cannot be captured whole, and nothing in it is graphed around what "
                          "cannot", (), parts.eager), None
    if interval > 0:
        # fleet's recompute_hybrid would run the entry's forward again in the backward, and with it
        # the parts' graphed forwards, which would then pair with no backward of their own
        return LayerEntry(entry.index, entry.obj, EntryKind.OPTED_OUT, entry.name,
                          f"eager whole: it cannot be captured whole, and under recompute_interval={interval} "
                          f"fleet would recompute parts graphed in place", (), parts.eager), None
    return in_parts(entry, [name for name, _ in parts.graphed], parts.eager), parts


def _with_eager_view(model, method_name, graphs):
    """Make ``model.<method_name>`` (fleet's per-layer checkpoint files) run inside the eager view."""
    method = getattr(model, method_name)

    @functools.wraps(method)
    def in_eager_view(*args, **kwargs):
        with graphs.eager_view():
            return method(*args, **kwargs)

    setattr(model, method_name, in_eager_view)


# ---------------------------------------------------------------- the drop-in class
def _check_to_static(to_static, use_cudagraph):
    """Check ``PipelineLayer``'s ``to_static`` on every rank, before any communication."""
    subject = "PipelineLayer(to_static=...)"
    if to_static_options(to_static, subject) is not None and not use_cudagraph:
        raise ValueError(
            f"{subject} converts the graphed runs' layers, but use_cudagraph=False builds none: set "
            "use_cudagraph=True, or apply paddle.jit.to_static to the layers yourself")


class PipelineLayer(_fleet.PipelineLayer):
    """Fleet's ``PipelineLayer`` whose stages run as CUDA-graphed runs of layers.

    Args:
        layers: the model as a list of ``LayerDesc`` / ``SharedLayerDesc`` / layers /
            callables, exactly as for fleet's ``PipelineLayer``.
        num_stages, topology, loss_fn, seg_method, recompute_interval, recompute_ctx,
        num_virtual_pipeline_stages, use_dualpipev: as for fleet's ``PipelineLayer``; with
            ``use_cudagraph`` and ``recompute_interval > 0`` the graphed runs recompute inside
            their own graphs (see :func:`graph_pipeline`).
        use_cudagraph: build the model eagerly, then :func:`graph_pipeline` it. Without CUDA
            the runs execute eagerly (one warning).
        graph_loss: with ``use_cudagraph``, graph the loss function too (see
            :func:`graph_pipeline`).
        to_static: with ``use_cudagraph``, ``True`` or a dict of ``paddle.jit.to_static``
            keyword arguments: each graphed run's layers run converted inside its graphs (see
            :func:`graph_pipeline`).
        options, **engine_kwargs: with ``use_cudagraph``, the engine options of the graphed
            runs (see :func:`graph_pipeline`); checked first in any case.

    Build it after ``fleet.init(is_collective=True, strategy=...)`` and on every rank
    (it may create communication groups), then wrap it with ``fleet.distributed_model``.
    With ``use_cudagraph``, ``GraphedPipeline.of(model).undo()`` ungraphs it (see
    :func:`graph_pipeline`).
    On a CPU build it makes fleet's CPU adjustments (:mod:`paddle_graphpp.paddle.fleet_cpu`).

    Raises:
        ValueError: a configuration that cannot run, before any process communicates:
            ``num_virtual_pipeline_stages > 1`` with ``pp <= 2``, with fewer than ``2*pp``
            micro-batches or with a ``seg_method`` that does not split into ``pp*vpp``
            chunks; ``use_dualpipev`` without the strategy's ``pp_configs['use_dualpipev']``
            or with fewer than ``2*pp`` micro-batches; ``use_cudagraph`` with dynamic shapes
            declared in the strategy, or with ``recompute_interval > 0`` under ``use_dualpipev``
            or with ``recompute_ctx`` offload or partition; ``to_static`` without
            ``use_cudagraph``, or an invalid one (an unknown key or backend, ...).
        TypeError: ``to_static`` is neither a bool nor a dict (or a value in it has the wrong type).

    The warnings of :func:`graph_pipeline` apply.
    """

    def __init__(self, layers, num_stages=None, topology=None, loss_fn=None, seg_method="uniform",
                 recompute_interval=0, recompute_ctx=None, num_virtual_pipeline_stages=None,
                 use_cudagraph=False, use_dualpipev=False, *, graph_loss=False, to_static=False,
                 options: Optional[EngineOptions] = None, **engine_kwargs):
        chosen = paddle_engine_options(f"{type(self).__name__}()", PipelineLayer.__init__, (), engine_kwargs, options)
        layers = list(layers)
        vpp = num_virtual_pipeline_stages or 1
        _check_to_static(to_static, use_cudagraph)
        _fleet.check_configuration(layers, num_stages=num_stages, topology=topology, seg_method=seg_method,
                                   vpp=vpp, use_cudagraph=use_cudagraph, use_dualpipev=use_dualpipev,
                                   recompute_interval=recompute_interval, recompute_ctx=recompute_ctx)
        name = type(self).__name__
        on_cpu = fleet_cpu._adjust("paddle_graphpp.PipelineLayer(...)" if type(self) is PipelineLayer
                                   else f"{name}(...) (a paddle_graphpp.PipelineLayer)")
        # use_cudagraph=False: upstream's own wrapping is never taken, so layers are built,
        # seeded and named exactly as without graphs (also under paddle_graphpp.install()).
        super().__init__(layers, num_stages=num_stages, topology=topology, loss_fn=loss_fn,
                         seg_method=seg_method, recompute_interval=recompute_interval,
                         recompute_ctx=recompute_ctx, num_virtual_pipeline_stages=num_virtual_pipeline_stages,
                         use_cudagraph=False, use_dualpipev=use_dualpipev)
        self.uses_hop_groups = bool(on_cpu and fleet_cpu.use_hop_groups(fleet.get_hybrid_communicate_group()))
        if use_cudagraph:  # sets use_cudagraph = True (fleet's __init__ set it False), undone with the graphs
            graph_pipeline(self, graph_loss=graph_loss, to_static=to_static, options=chosen)

    def segmentation_report(self) -> str:
        """How this rank's chunks were split: one line per graphed or eager run."""
        graphs = GraphedPipeline.of(self)
        if graphs is None:
            return f"stage {_fleet.stage_id(self)}: use_cudagraph=False, every layer eager"
        return graphs.segmentation_report()

    def graphed_layers(self) -> list:
        """The :class:`paddle_graphpp.CUDAGraphedLayer` of each graphed run on this rank, in layer order."""
        graphs = GraphedPipeline.of(self)
        return [] if graphs is None else graphs.graphed_layers()
