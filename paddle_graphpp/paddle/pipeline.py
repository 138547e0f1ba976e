"""``PipelineLayer``: fleet's pipeline layer with each stage split into CUDA-graphed runs.

A drop-in for ``paddle.distributed.fleet.meta_parallel.PipelineLayer``: same constructor,
same parameter names and checkpoints, trained the same way
(``fleet.distributed_model(model).train_batch(...)``, 1F1B or interleaved).

With ``use_cudagraph=True`` each stage's layers (each virtual chunk's, with
``num_virtual_pipeline_stages > 1``) are split by :mod:`paddle_graphpp.core.segment` into
runs of contiguous capturable layers; each run is wrapped in one
:class:`paddle_graphpp.CUDAGraphedLayer`. These stay eager and end the run before them:

* ``SharedLayerDesc`` layers (tied embeddings: their weight gradients are all-reduced
  across stages after the schedule, outside any graph);
* plain callables in the layer list;
* layers marked with :func:`paddle_graphpp.mark_not_capturable` (or containing one).

Each graphed run keeps its own FIFO of in-flight micro-batches; the schedule (1F1B or
interleaved) calls every chunk's runs in its own order, and the FIFOs follow it.
Upstream's own ``use_cudagraph`` path (one queue of Paddle ``CUDAGraphedLayer`` per flush)
is never taken: the base class is built with ``use_cudagraph=False`` and the runs are
graphed afterwards, so layers are built, seeded and named exactly as without graphs.

On a CPU build (gloo) the module makes fleet's CPU adjustments itself
(:mod:`paddle_graphpp.paddle.fleet_cpu`), and the graphed runs execute eagerly.
"""

from __future__ import annotations

import contextlib
import functools
import re

from paddle import nn
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_parallel import PipelineLayer as _FleetPipelineLayer

from paddle_graphpp.core.segment import classify, describe_runs, split_into_runs
from paddle_graphpp.paddle import fleet_cpu

__all__ = ["PipelineLayer"]


class _RunBody(nn.Layer):
    """The layers of one graphed run, called in sequence as fleet calls them (``x = layer(x)``)."""

    def __init__(self, layers):
        super().__init__()
        self._run = list(layers)
        for idx, layer in enumerate(self._run):
            self.add_sublayer(str(idx), layer)

    def forward(self, *inputs):
        x = inputs[0] if len(inputs) == 1 else tuple(inputs)
        for layer in self._run:
            x = layer(x)
        return x


class _GraphedRunCall:
    """The ``run_function`` entry of a graphed run: unpacks fleet's tuple into graph inputs.

    Deliberately not an ``nn.Layer``: the run's layers stay registered under their upstream
    names only, so ``state_dict()`` keys and optimizer parameter lists are unchanged.
    """

    def __init__(self, graphed, run, name):
        self.graphed = graphed
        self.run = run
        self.name = name

    def __call__(self, x):
        return self.graphed(*x) if isinstance(x, tuple) else self.graphed(x)

    def __repr__(self):
        return f"GraphedRun({self.name})"


def _pipe_degree(num_stages, topology):
    if topology is not None:
        hcg = getattr(topology, "_parent_hcg", None)
        if hcg is not None:
            return hcg._pp_degree
        return topology.get_dim_size("pipe")
    return num_stages


def _desc_name(desc):
    if isinstance(desc, nn.Layer):
        return type(desc).__name__
    if hasattr(desc, "layer_func"):
        return desc.layer_func.__name__
    spec = getattr(desc, "layer_spec", None)
    if spec is not None and not isinstance(spec.layer, tuple):
        return spec.layer.__name__
    return getattr(desc, "__name__", None)


def _check_configuration(layers, *, num_stages, topology, seg_method, vpp, use_cudagraph,
                         use_dualpipev, recompute_interval):
    """Reject, on every rank and before any communication, configurations that cannot run."""
    pp = _pipe_degree(num_stages, topology)
    if pp is None:
        raise ValueError("PipelineLayer needs num_stages or topology")
    if use_cudagraph and use_dualpipev:
        raise NotImplementedError(
            "PipelineLayer(use_cudagraph=True) does not support use_dualpipev=True; "
            "use the 1F1B or interleaved schedule, or set use_cudagraph=False")
    if use_cudagraph and recompute_interval > 0:
        raise ValueError(
            f"PipelineLayer(use_cudagraph=True) cannot recompute (recompute_interval={recompute_interval}): "
            "a recomputed forward would replay a graph out of the schedule's order. "
            "Set recompute_interval=0, or mark the layers to recompute with mark_not_capturable")
    parts = pp * vpp
    if len(layers) < parts:
        raise ValueError(
            f"{len(layers)} layers cannot split into pp*vpp = {pp}*{vpp} = {parts} chunks: "
            "add layers or lower num_stages / num_virtual_pipeline_stages")
    if vpp > 1:
        if pp <= 2:
            raise ValueError(
                f"num_virtual_pipeline_stages={vpp} needs more than 2 pipeline stages (got {pp}): "
                "Paddle's interleaved schedule requires pp_degree > 2; use num_virtual_pipeline_stages=1")
        if not (isinstance(seg_method, str) and seg_method.startswith("layer:")):
            raise ValueError(
                f"num_virtual_pipeline_stages={vpp} needs seg_method='layer:<LayerClassName>' "
                f"(got {seg_method!r}), so that the matching layers split evenly into the {parts} chunks")
    if isinstance(seg_method, str) and seg_method.startswith("layer:"):
        pattern = re.compile(seg_method.split(":", 1)[1], re.IGNORECASE)
        count = sum(1 for desc in layers if (name := _desc_name(desc)) and pattern.search(name))
        if count == 0 or count % parts:
            raise ValueError(
                f"seg_method={seg_method!r} matches {count} layers, which cannot split evenly into "
                f"pp*vpp = {pp}*{vpp} = {parts} chunks: use a multiple of {parts} such layers, or change "
                "num_stages / num_virtual_pipeline_stages")
    strategy = getattr(fleet.fleet, "_user_defined_strategy", None)
    if strategy is None:
        return
    acc = strategy.pipeline_configs.get("accumulate_steps", 1)
    if vpp > 1 and acc < 2 * pp:
        raise ValueError(
            f"the interleaved schedule (num_virtual_pipeline_stages={vpp}) needs at least 2*pp = {2 * pp} "
            f"micro-batches, got accumulate_steps={acc}: raise strategy.pipeline_configs['accumulate_steps'] "
            f"to {2 * pp} or more")
    if use_cudagraph:
        pp_cfg = strategy.strategy.hybrid_configs.pp_configs
        if pp_cfg.enable_dynamic_shape or not strategy.pipeline_configs.get("p2p_cache_shape", True):
            raise ValueError(
                "PipelineLayer(use_cudagraph=True) needs the same shapes in every micro-batch, but the "
                "strategy declares dynamic shapes (pp_configs.enable_dynamic_shape=True or "
                "pipeline_configs['p2p_cache_shape']=False): pad sequences to a fixed length and turn "
                "dynamic shapes off, or set use_cudagraph=False")


class PipelineLayer(_FleetPipelineLayer):
    """Fleet's ``PipelineLayer`` whose stages run as CUDA-graphed runs of layers.

    Args:
        layers: the model as a list of ``LayerDesc`` / ``SharedLayerDesc`` / layers /
            callables, exactly as for fleet's ``PipelineLayer``.
        num_stages, topology, loss_fn, seg_method, recompute_interval, recompute_ctx,
        num_virtual_pipeline_stages, use_dualpipev: as for fleet's ``PipelineLayer``.
        use_cudagraph: split each stage (or virtual chunk) into runs of capturable layers
            and graph each run with :class:`paddle_graphpp.CUDAGraphedLayer`. Without CUDA
            the runs execute eagerly (one warning).
        num_warmup_steps: eager steps each graphed run takes before capture.

    Build it after ``fleet.init(is_collective=True, strategy=...)`` and on every rank
    (it may create communication groups), then wrap it with ``fleet.distributed_model``.

    Raises:
        ValueError: a configuration that cannot run, before any process communicates:
            ``num_virtual_pipeline_stages > 1`` with ``pp <= 2``, with fewer than ``2*pp``
            micro-batches or with a ``seg_method`` that does not split into ``pp*vpp``
            chunks; ``use_cudagraph`` with dynamic shapes declared in the strategy or with
            recomputation.
        NotImplementedError: ``use_cudagraph`` together with ``use_dualpipev``.

    Warnings:
        * Every micro-batch must have the same shapes (pad sequences): a graph replays the
          shapes it captured.
        * A layer that synchronises with the host, communicates, or has data-dependent shapes
          must be marked with :func:`paddle_graphpp.mark_not_capturable`.
        * ``run_function`` holds graphed runs, not single layers, when ``use_cudagraph`` is
          on; ``save_state_dict`` / ``set_state_dir`` still write and read per layer.
    """

    def __init__(self, layers, num_stages=None, topology=None, loss_fn=None, seg_method="uniform",
                 recompute_interval=0, recompute_ctx=None, num_virtual_pipeline_stages=None,
                 use_cudagraph=False, use_dualpipev=False, *, num_warmup_steps=3):
        layers = list(layers)
        vpp = num_virtual_pipeline_stages or 1
        _check_configuration(layers, num_stages=num_stages, topology=topology, seg_method=seg_method,
                             vpp=vpp, use_cudagraph=use_cudagraph, use_dualpipev=use_dualpipev,
                             recompute_interval=recompute_interval)
        on_cpu = fleet_cpu.adjust_for_cpu()
        super().__init__(layers, num_stages=num_stages, topology=topology, loss_fn=loss_fn,
                         seg_method=seg_method, recompute_interval=recompute_interval,
                         recompute_ctx=recompute_ctx, num_virtual_pipeline_stages=num_virtual_pipeline_stages,
                         use_cudagraph=False, use_dualpipev=use_dualpipev)
        self.use_cudagraph = bool(use_cudagraph)
        self.uses_hop_groups = False
        if on_cpu:
            self.uses_hop_groups = fleet_cpu.use_hop_groups(fleet.get_hybrid_communicate_group())
        # Per chunk: the eager entry list (for checkpoints) and the segmentation (for reports).
        self._eager_run_functions = []
        self._segmentation = []
        self._graphed_layers = []
        if self.use_cudagraph:
            self._graph_stage(num_warmup_steps)

    # ------------------------------------------------------------------ building
    def _chunks(self):
        """``(chunk_id or None, start layer index, container)`` for each chunk of this rank."""
        if self._num_virtual_pipeline_stages > 1:
            return [(cid, start, chunk) for cid, (start, chunk) in
                    enumerate(zip(self._start_poss, self._model_chunks))]
        return [(None, self._start_pos, None)]

    def _graph_stage(self, num_warmup_steps):
        from paddle_graphpp.paddle.graphed_layer import CUDAGraphedLayer

        shared_keys = {id(layer): key for key, layer in self.shared_layers.items()}
        for chunk_id, start, chunk in self._chunks():
            eager = list(chunk.run_function if chunk is not None else self.run_function)
            runs = split_into_runs([self._classify(start + i, obj, shared_keys) for i, obj in enumerate(eager)])
            graphed = []
            for run in runs:
                if not run.graphed:
                    graphed.append(run.entries[0].obj)
                    continue
                name = (f"stage{self._stage_id}" + (f".chunk{chunk_id}" if chunk_id is not None else "")
                        + f".layers[{run.start}:{run.stop}]")
                layer = CUDAGraphedLayer(_RunBody(run.objects()), num_warmup_steps, name=name)
                self._graphed_layers.append(layer)
                graphed.append(_GraphedRunCall(layer, run, name))
            if chunk is not None:
                chunk.run_function = graphed
            else:
                self.run_function[:] = graphed
            self._eager_run_functions.append(eager)
            self._segmentation.append(runs)

    @staticmethod
    def _classify(index, obj, shared_keys):
        target = obj.args[0] if isinstance(obj, functools.partial) and obj.args else obj
        key = shared_keys.get(id(target))
        is_layer = isinstance(obj, nn.Layer)
        name = (f"shared:{key}" if key is not None else
                f"{type(obj).__name__}#{index}" if is_layer else
                f"{getattr(obj, '__name__', type(obj).__name__)}#{index}")
        return classify(index, obj, is_layer=lambda o: isinstance(o, nn.Layer), shared=key is not None,
                        sublayers=obj.sublayers() if is_layer else None, name=name)

    # ------------------------------------------------------------------ reports
    def segmentation_report(self) -> str:
        """How this rank's chunks were split: one line per graphed or eager run."""
        if not self.use_cudagraph:
            return f"stage {self._stage_id}: use_cudagraph=False, every layer eager"
        lines = []
        for (chunk_id, _, _), runs in zip(self._chunks(), self._segmentation):
            lines.append(f"stage {self._stage_id}" + (f" chunk {chunk_id}" if chunk_id is not None else "") + ":")
            lines.extend("  " + line for line in describe_runs(runs).splitlines())
        return "\n".join(lines)

    def graphed_layers(self) -> list:
        """The :class:`CUDAGraphedLayer` of each graphed run on this rank, in layer order."""
        return list(self._graphed_layers)

    # ------------------------------------------------------------- mode, checkpoints
    def train(self, mode: bool = True):
        super().train(mode)
        # The graphed wrappers are not sublayers (to keep state_dict keys unchanged).
        for layer in self._graphed_layers:
            for sub in [layer, *layer.sublayers()]:
                sub.training = mode
        return self

    def eval(self):
        return self.train(False)

    @contextlib.contextmanager
    def _eager_view(self):
        """Show fleet's per-layer ``run_function`` lists while checkpoints are written or read."""
        if not self.use_cudagraph:
            yield
            return
        saved = []
        for (_, _, chunk), eager in zip(self._chunks(), self._eager_run_functions):
            if chunk is not None:
                saved.append(chunk.run_function)
                chunk.run_function = eager
            else:
                saved.append(list(self.run_function))
                self.run_function[:] = eager
        try:
            yield
        finally:
            for (_, _, chunk), graphed in zip(self._chunks(), saved):
                if chunk is not None:
                    chunk.run_function = graphed
                else:
                    self.run_function[:] = graphed

    def save_state_dict(self, path):
        with self._eager_view():
            return super().save_state_dict(path)

    def set_state_dir(self, path):
        with self._eager_view():
            return super().set_state_dir(path)

