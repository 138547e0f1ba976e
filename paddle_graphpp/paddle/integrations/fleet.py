"""Paddle fleet's dygraph ``PipelineLayer``, as the pipeline front door reads and checks it.

Checked on Paddle 3.3.1 (``paddle_graphpp.support.SUPPORTED["paddle"]``: 3.3 to 3.3.1). Fleet has
no public API for what graphing a built model needs, so the private attributes are read here
only: the entry lists (``run_function``; ``_model_chunks`` / ``_start_poss`` with virtual stages
or DualPipeV), ``_start_pos``, ``_stage_id``, ``_loss_fn``, ``_recompute_interval``,
``_use_dualpipev``, ``_num_virtual_pipeline_stages``, and the strategy fleet keeps
(``fleet.fleet._user_defined_strategy``). A Paddle that keeps its layers otherwise fails
:func:`entry_lists` naming the version. Fleet's recompute groups over graphed runs
(``_need_recompute``, ``recompute_hybrid``) are :mod:`paddle_graphpp.paddle.pipeline_recompute`'s;
the CPU adjustments are :mod:`paddle_graphpp.paddle.fleet_cpu`'s.

:func:`check_configuration` and :func:`check_graphable` reject, on every rank and before any
communication, configurations that cannot run; :data:`ADAPTER` refuses, for ``graph_pipeline``, a
built model that graphed runs cannot take over.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import paddle
from paddle import nn
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_parallel import PipelineLayer

from . import Adapter

__all__ = ["PipelineLayer", "unwrap", "entry_lists", "stage_id", "shared_keys", "loss_functions",
           "recompute_interval", "set_recompute_interval", "check_graphable", "check_configuration",
           "refuse_upstream_graphs", "FleetAdapter", "ADAPTER"]


# ---------------------------------------------------------------- reading a built model
def unwrap(model):
    """The pipeline layer inside a ``fleet.distributed_model`` wrapper, else ``model``."""
    inner = getattr(model, "_layers", None)
    if not isinstance(model, PipelineLayer) and isinstance(inner, PipelineLayer):
        return inner
    return model


def entry_lists(model) -> list:
    """``(chunk_id or None, first layer index, fleet's entry list)`` for each chunk of this rank.

    Raises:
        RuntimeError: this Paddle's ``PipelineLayer`` keeps its layers otherwise (names the version).
    """
    try:
        if model._num_virtual_pipeline_stages > 1 or getattr(model, "_use_dualpipev", False):
            return [(cid, start, chunk.run_function)
                    for cid, (start, chunk) in enumerate(zip(model._start_poss, model._model_chunks))]
        return [(None, model._start_pos, model.run_function)]
    except AttributeError as exc:
        raise RuntimeError(
            f"graph_pipeline({type(model).__name__}): fleet's PipelineLayer in Paddle {paddle.__version__} "
            f"does not keep its layers as Paddle 3.x does (run_function / _model_chunks: {exc}); graph "
            "the layers one by one with paddle_graphpp.CUDAGraphedLayer, or use Paddle 3.x") from exc


def stage_id(model) -> int:
    """This rank's pipeline stage."""
    return model._stage_id


def shared_keys(model) -> dict:
    """``{id(layer): key}`` of the model's ``SharedLayerDesc`` layers on this rank."""
    return {id(layer): key for key, layer in model.shared_layers.items()}


def loss_functions(model) -> list:
    """Fleet's list of the model's loss functions (the list object itself: edits change the model)."""
    return getattr(model, "_loss_fn", [])


def recompute_interval(model) -> int:
    """The model's ``recompute_interval`` as fleet reads it in its forward."""
    return getattr(model, "_recompute_interval", 0)


def set_recompute_interval(model, interval: int) -> None:
    """Set the ``recompute_interval`` fleet's forward reads (0: it recomputes no group itself)."""
    model._recompute_interval = interval


# ---------------------------------------------------------------- configuration checks
def check_graphable(subject, *, recompute_interval, recompute_ctx, use_dualpipev):
    """Reject what graphed runs cannot do, naming ``subject`` (the call or class) and the fix."""
    if recompute_interval > 0:
        if use_dualpipev:
            raise ValueError(
                f"{subject}: recompute_interval={recompute_interval} with use_dualpipev=True: DualPipeV splits "
                "backwards into input and weight halves, which a recomputing graphed run does not do. Set "
                "recompute_interval=0, or use the 1F1B or interleaved schedule")
        moved = [key for key in ("offload", "partition") if (recompute_ctx or {}).get(key, False)]
        if moved:
            raise ValueError(
                f"{subject}: recompute_ctx {'/'.join(moved)}=True moves or splits the recomputed groups' inputs, but a "
                "graphed run keeps its inputs in the static buffers of its graphs, on the device. Set "
                f"{' and '.join(moved)} to False in recompute_ctx, or set use_cudagraph=False")
    strategy = getattr(fleet.fleet, "_user_defined_strategy", None)
    if strategy is None:
        return
    pp_cfg = strategy.strategy.hybrid_configs.pp_configs
    if pp_cfg.enable_dynamic_shape or not strategy.pipeline_configs.get("p2p_cache_shape", True):
        raise ValueError(
            f"{subject} needs the same shapes in every micro-batch, but the "
            "strategy declares dynamic shapes (pp_configs.enable_dynamic_shape=True or "
            "pipeline_configs['p2p_cache_shape']=False): pad sequences to a fixed length and turn "
            "dynamic shapes off, or set use_cudagraph=False")


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


def check_configuration(layers, *, num_stages, topology, seg_method, vpp, use_cudagraph,
                        use_dualpipev, recompute_interval, recompute_ctx=None):
    """Reject, on every rank and before any communication, configurations that cannot run."""
    pp = _pipe_degree(num_stages, topology)
    if pp is None:
        raise ValueError("PipelineLayer needs num_stages or topology")
    if use_cudagraph:
        check_graphable("PipelineLayer(use_cudagraph=True)", recompute_interval=recompute_interval,
                        recompute_ctx=recompute_ctx, use_dualpipev=use_dualpipev)
    chunks = 2 if use_dualpipev else vpp  # DualPipeV: two chunks per rank, in a V
    parts = pp * chunks
    split = f"2*pp = 2*{pp}" if use_dualpipev else f"pp*vpp = {pp}*{vpp}"
    if len(layers) < parts:
        raise ValueError(
            f"{len(layers)} layers cannot split into {split} = {parts} chunks: "
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
                f"{split} = {parts} chunks: use a multiple of {parts} such layers, or change "
                "num_stages / num_virtual_pipeline_stages")
    strategy = getattr(fleet.fleet, "_user_defined_strategy", None)
    if strategy is None:
        return
    if use_dualpipev and not strategy.strategy.hybrid_configs.pp_configs.use_dualpipev:
        raise ValueError(
            "use_dualpipev=True needs the strategy to ask for DualPipeV too, or fleet.distributed_model "
            "runs the model under 1F1B: set strategy.hybrid_configs['pp_configs']['use_dualpipev'] = True "
            "before fleet.init")
    acc = strategy.pipeline_configs.get("accumulate_steps", 1)
    if (vpp > 1 or use_dualpipev) and acc < 2 * pp:
        schedule = "DualPipeV (use_dualpipev=True)" if use_dualpipev else \
            f"the interleaved schedule (num_virtual_pipeline_stages={vpp})"
        raise ValueError(
            f"{schedule} needs at least 2*pp = {2 * pp} micro-batches, got accumulate_steps={acc}: "
            f"raise strategy.pipeline_configs['accumulate_steps'] to {2 * pp} or more")


def refuse_upstream_graphs(subject, entries):
    """Refuse a model built with fleet's own ``use_cudagraph=True`` (Paddle's ``CUDAGraphedLayer``)."""
    from paddle.device.cuda.cuda_graphed_layer import CUDAGraphedLayer as UpstreamGraphedLayer

    for _, _, run_function in entries:
        if any(isinstance(obj, UpstreamGraphedLayer) for obj in run_function):
            raise ValueError(
                f"{subject}: the model was built with use_cudagraph=True, so "
                "Paddle's own CUDAGraphedLayer already wraps its layers; build it with use_cudagraph=False "
                "and then call graph_pipeline, or call paddle_graphpp.install() before building it")


# ---------------------------------------------------------------- the adapter
@dataclass(frozen=True, slots=True)
class FleetAdapter(Adapter):
    """Fleet's refusals of a built model: recompute settings and dynamic shapes graphed runs cannot
    take over (:func:`check_graphable`), and Paddle's own graphs (:func:`refuse_upstream_graphs`)."""

    def refuse(self, model, subject: str, entries) -> None:
        check_graphable(subject, recompute_interval=recompute_interval(model),
                        recompute_ctx=getattr(model, "recompute_ctx", None),
                        use_dualpipev=getattr(model, "_use_dualpipev", False))
        refuse_upstream_graphs(subject, entries)


ADAPTER = FleetAdapter()
