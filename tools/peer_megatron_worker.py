"""One variant of ``tools/bench_peer_megatron.py`` on one rank: Megatron-Core's GPTModel (local
layer spec, no TransformerEngine) trained through Megatron's own schedule, ``--tp`` ranks per
pipeline stage (tensor parallel) and ``--pp`` stages.

Started by the benchmark, ``tp * pp`` processes, one per rank (``RANK``/``WORLD_SIZE``/``MASTER_PORT``
from ``testing.launch.rank_envs``); Megatron's default rank order puts a stage's tensor-parallel
ranks next to each other (ranks 0..tp-1 are the first stage). Every rank makes the same
micro-batches, so the ranks of a tensor-parallel group feed the same data. Prints ONE JSON line as
its last output: this rank's figures, or ``{"error": ..., "traceback": ...}`` with exit status 1.

Variants (all train the same math: bf16 parameters, bf16 gradients accumulated over the
micro-batches, plain ``torch.optim.AdamW`` on the bf16 parameters (its foreach implementation;
``--optimizer fused`` its fused one, the kind Megatron's own optimizer takes from TransformerEngine
or Apex), dropout 0.1 drawn through Megatron's graph-safe RNG tracker):

* ``eager`` / ``eager_repeat``: ``Float16Module(GPTModel)``; gradients in ``.grad``.
* ``megatron``: Megatron's local graphs (``cuda_graph_impl="local"``); the model is wrapped in
  Megatron's ``DistributedDataParallel(grad_reduce_in_fp32=False)`` because its backward graphs
  add weight gradients into ``param.main_grad``; the optimizer reads ``main_grad``.
* ``ours``: every ``TransformerLayer`` wrapped in ``paddle_graphpp.torch.CUDAGraphedModule``
  with its default settings, and on the last stage the model's vocabulary cross-entropy
  (``GPTModel.compute_language_model_loss``) in ``paddle_graphpp.torch.graph_loss`` (``--loss
  eager`` leaves it eager) and its output layer graphed in place by ``graph_layers`` (``--head
  eager`` leaves it eager; with the embedding on the same stage it is handed the embedding's
  weight, read in place too); gradients in ``.grad``.
* ``--ddp``: eager and ours in the same ``DistributedDataParallel`` (wrapped after ours graphs the
  layers, as ``megatron.training`` wraps what the model provider built); the optimizer reads
  ``main_grad``, and our graphs add into it (``GradPath.HOOKED``, docs/pytorch.md).

The tied embedding of a pipeline's first and last stage is summed by
``finalize_model_grads`` (Megatron's DDP) or by Megatron's embedding all-reduce on ``.grad``.
Under tensor parallelism without sequence parallelism nothing else needs summing: each TP rank
owns its shard's gradients, and the replicated layer norms get equal gradients on every rank.

``--model moe`` (``tools/bench_peer_megatron.py --moe``): a mixture-of-experts GPT at the
launch-bound shape of ``tools/bench_moe.py`` (:data:`MOE_SHAPE`: hidden 1024, 8 layers, 16 heads,
16 experts of width 512, top-2, vocabulary 32000; bf16, no dropout, 4 micro-batches of 2 x 256
tokens), one GPU (``--tp 1 --pp 1``). Layers: ``get_gpt_layer_local_spec(num_experts=16,
moe_grouped_gemm=False)``'s submodules (``SequentialMLP`` experts, ``TopKRouter``, the
load-balancing loss off: ``moe_aux_loss_coeff=0``) in ``MoETransformerLayer``, Megatron's own
layer class for MoE graphs (the GPT spec names plain ``TransformerLayer``; the subclass computes
the same forward and adds the partial-graph path). Read in megatron-core 0.19.2's source:

* The dispatch reads the host unless it drops and pads: the default ``allgather`` dispatcher
  always does (``token_dispatcher.py:317`` ``local_map.sum(dim=0).long().cpu()``, ``:323``
  ``.sum().item()``, then ``experts.py:1352`` ``tokens_per_expert.tolist()`` in
  ``SequentialMLP``); the ``alltoall`` dispatcher without drop-and-pad copies the splits to the
  host and waits on an event (``token_dispatcher.py:913-950``). With
  ``moe_pad_expert_input_to_capacity=True`` and a ``moe_expert_capacity_factor`` the
  ``alltoall`` dispatcher reads nothing (``token_dispatcher.py:511-534``: the counts are a host
  ``torch.full`` of the capacity; ``_maybe_dtoh_and_synchronize`` skips drop-and-pad;
  ``moe_utils.py:424-445`` permutes with ``argsort``), and the config allows the ``moe`` graph
  scope only there (``transformer_config.py:2505-2511``).
* ``cuda_graph_impl="local"`` graphs a layer through its ``__call__`` (``module.py:365-367``): an
  empty ``cuda_graph_modules`` graphs the whole layer; for a plain ``TransformerLayer`` the
  ``attn`` scope makes the same whole-layer manager (``transformer_layer.py:557-560``); the
  ``moe_router``/``moe_preprocess`` scopes act under ``local`` only in ``MoETransformerLayer``
  (``transformer_layer.py:1597-1620``, ``transition_cudagraph_scope('partial')``): the layer's
  pre-MLP norm, router and dispatch preprocessing in one graph, combine and residual in another,
  attention and the dispatch and experts eager, with an event wait on the host after the router
  graph (``transformer_layer.py:1756-1757``). The early return that splits a layer at the router
  inside one graph is ``transformer_engine`` only (``moe_utils.py:1597-1600``).

So ``--routing`` (the same for every variant of a run):

* ``capacity`` (default): ``alltoall`` dispatcher, capacity factor :data:`CAPACITY_FACTOR`,
  drop and pad: capture-safe. ``megatron``: whole-layer local graphs (``cuda_graph_modules=[]``);
  ``ours``: ``CUDAGraphedModule`` per layer, as in the dense model.
* ``dropless``: Megatron's default ``allgather`` dispatcher, no capacity: it reads the host, so
  neither peer graphs whole layers. ``megatron``: ``cuda_graph_modules=["moe_router",
  "moe_preprocess"]`` (partial graphs above); ``ours``: each layer's ``self_attention`` and
  ``mlp.router`` in ``CUDAGraphedModule`` (norms, dispatch, experts, combine eager).

Steps: ``CAPTURE_STEPS`` steps (warmup, recording, capture), then ``rounds`` timed rounds of
:func:`steps_per_round` steps (about the tokens of 3 steps at seq 2048: 12 steps at seq 512, a
round of ~1.5 s at pp=2 on 2 x H200 where 3 steps took ~0.35 s), each between two device
synchronisations. Memory: the peak of
reserved memory over the capture steps (from after the model is built), then the peak over
the timed steps. ``--device cpu`` runs a tiny model on gloo (a check of the code, not of graphs:
Megatron's graphs need CUDA, ours run eagerly on CPU).
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import datetime
import io
import os
import pstats
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)
from tools import benchlib  # noqa: E402

VARIANTS = ("eager", "megatron", "ours", "eager_repeat")
CAPTURE_STEPS = 3  # ours: 3 warmup calls, a recorded step, the capture step; Megatron: step 1 records, captures at its end
STEPS_PER_ROUND = 3  # at seq 2048 and longer; shorter sequences run more (steps_per_round)
MICRO_BATCHES = 8
MICRO_BATCH_SIZE = 1
SEED = 1234
LR = 3e-4
#: GPT-3 1.3B (the default) and the tiny shape of the CPU check. Layers split evenly over up to 4
#: pipeline stages and heads over 2 tensor-parallel ranks in both.
SHAPES = {
    "gpt1.3b": dict(hidden=2048, layers=24, heads=16, vocab=50304),
    "tiny": dict(hidden=64, layers=4, heads=4, vocab=128),
}
DROPOUT = 0.1
#: The MoE model (``--model moe``): tools/bench_moe.py's launch-bound shape, and the tiny one of
#: the CPU check. ``ffn`` is each expert's width (every layer is a MoE layer).
MOE_SHAPE = dict(hidden=1024, layers=8, heads=16, vocab=32000, experts=16, topk=2, ffn=512)
MOE_TINY = dict(hidden=64, layers=2, heads=4, vocab=128, experts=4, topk=2, ffn=32)
MOE_MICRO_BATCHES = 4
MOE_MICRO_BATCH_SIZE = 2
MOE_STEPS_PER_ROUND = 5  # as tools/bench_moe.py's --iters default
CAPACITY_FACTOR = 1.25  # as tools/bench_moe.py's --capacity-factor default
ROUTINGS = ("capacity", "dropless")
OPTIMIZERS = ("foreach", "fused")  # torch.optim.AdamW's implementations (--optimizer)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per pipeline stage")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--profile", action="store_true", help="profile one steady step (torch.profiler and cProfile)")
    p.add_argument("--memory-trace", action="store_true",
                   help="record every allocation and break the memory peaks down (tools/diagnostics/memtrace.py); "
                        "slows the run: a diagnosis, not a timing")
    p.add_argument("--loss", choices=["graphed", "eager"], default="graphed",
                   help="ours: the last stage's cross-entropy in graph_loss (default) or eager")
    p.add_argument("--head", choices=["graphed", "eager"], default="graphed",
                   help="ours: the last stage's output layer graphed in place (graph_layers) or eager")
    p.add_argument("--model", choices=["gpt", "moe"], default="gpt",
                   help="gpt: the dense GPT-3 1.3B shape; moe: the mixture of experts (MOE_SHAPE, one GPU)")
    p.add_argument("--routing", choices=ROUTINGS, default="capacity",
                   help="moe: capacity (alltoall, drop and pad: graphs whole layers) or dropless (allgather, "
                        "reads the host: graphs around the dispatch)")
    p.add_argument("--ddp", action="store_true",
                   help="eager and ours: the model in Megatron's DistributedDataParallel, gradients in main_grad "
                        "(as megatron.training wraps it; the megatron variant always is)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="foreach",
                   help="torch.optim.AdamW's implementation: foreach (its default on a GPU: temporaries per "
                        "parameter) or fused (one kernel over the parameters, no temporaries: the kind Megatron's "
                        "own optimizer takes, TransformerEngine's or Apex's FusedAdam)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    opts = p.parse_args(argv)
    if opts.memory_trace and opts.device != "cuda":
        p.error("--memory-trace records the CUDA allocator: it needs --device cuda")
    if opts.model == "moe" and (opts.tp, opts.pp) != (1, 1):
        p.error("--model moe runs on one GPU: --tp 1 --pp 1 (Megatron's MoE under tensor parallelism needs "
                "sequence parallelism, which this bench does not set up)")
    return opts


def micro_batches(opts) -> tuple:
    """``(micro-batches per step, sequences per micro-batch)`` of the model."""
    return (MOE_MICRO_BATCHES, MOE_MICRO_BATCH_SIZE) if opts.model == "moe" else (MICRO_BATCHES, MICRO_BATCH_SIZE)


def main(argv=None) -> int:
    opts = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    return benchlib.rank_result(lambda: run(opts, rank), {"rank": rank, "variant": opts.variant, "seq": opts.seq})


# ----------------------------------------------------------------------------------- setup
def init_distributed(opts, rank: int):
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != opts.tp * opts.pp:
        raise ValueError(f"started with WORLD_SIZE={world} processes, but --tp {opts.tp} x --pp {opts.pp} needs "
                         f"{opts.tp * opts.pp}: start one process per rank (tools/bench_peer_megatron.py does)")
    if opts.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
        if torch.cuda.device_count() <= local:
            raise RuntimeError(f"rank {rank} needs GPU {local}, {torch.cuda.device_count()} visible")
        torch.cuda.set_device(local)
        os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from testing.launch import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("nccl" if opts.device == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))


def build(opts, rank: int):
    """The model (wrapped as the variant needs), its config and the optimizer."""
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from paddle_graphpp.support import require
    require("megatron-core")
    if opts.model == "moe":
        shape = MOE_TINY if opts.device == "cpu" else MOE_SHAPE
    else:
        shape = SHAPES["tiny" if opts.device == "cpu" else "gpt1.3b"]
    check_shape(shape, tp=opts.tp, pp=opts.pp)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=opts.tp, pipeline_model_parallel_size=opts.pp)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    # As megatron.training seeds: per pipeline stage (Megatron's tracker adds the TP rank for the
    # sharded weights' and dropout's stream); the graph-safe tracker in every variant, so all of
    # them draw the same dropout masks.
    tensor_parallel.model_parallel_cuda_manual_seed(SEED + 100 * pp_rank, use_cudagraphable_rng=opts.device == "cuda")
    torch.manual_seed(SEED + 100 * pp_rank)
    config = TransformerConfig(**model_config(opts, shape))
    spec = layer_spec(opts, shape)
    model = GPTModel(config, spec, vocab_size=shape["vocab"], max_sequence_length=opts.seq,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute")
    if opts.device == "cuda":
        model.cuda(torch.cuda.current_device())
    model = Float16Module(config, model)
    gpt = model.module
    if opts.variant == "ours":
        from paddle_graphpp.torch import CUDAGraphedModule

        layers = gpt.decoder.layers
        for i, layer in enumerate(layers):
            if opts.model == "moe" and opts.routing == "dropless":
                # The dispatch reads the host (module docstring): graph around it, attention and router.
                layer.self_attention = CUDAGraphedModule(layer.self_attention, name=f"layers.{i}.self_attention")
                layer.mlp.router = CUDAGraphedModule(layer.mlp.router, name=f"layers.{i}.mlp.router")
            else:
                layers[i] = CUDAGraphedModule(layer)
        if opts.loss == "graphed" and gpt.post_process:
            from paddle_graphpp.torch import graph_loss

            # GPTModel.forward calls self.compute_language_model_loss(labels, logits). Set on the
            # instance with object.__setattr__: nn.Module would file a module value as a child,
            # found only after the class's own method, which would then still run.
            object.__setattr__(gpt, "compute_language_model_loss", graph_loss(gpt.compute_language_model_loss))
        if opts.head == "graphed" and gpt.post_process:
            from paddle_graphpp.torch import graph_layers

            # In place. GPTModel hands the layer its tied weight as weight=: on a last stage without
            # the embedding its own (output_layer.weight), with the embedding on the same stage
            # (pp=1) the embedding's. The graphs read either in place (the embedding's hands its part
            # of the gradient to autograd, which adds the embedding's own as eagerly); the logits
            # feed the graphed loss without a copy.
            graph_layers([gpt.output_layer], name="output_layer")
    if in_ddp(opts):  # wrapped last, as megatron.training wraps the model its provider built
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)

        model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=False), model)
        config.finalize_model_grads_func = finalize_model_grads
    else:
        config.finalize_model_grads_func = _tied_grads_finalizer(gpt)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                  **{opts.optimizer: True})
    return model, gpt, config, optimizer, shape


def in_ddp(opts) -> bool:
    """Whether the variant's model is in Megatron's DDP (gradients in ``main_grad``): Megatron's
    graphs need it; ``--ddp`` puts the others there too."""
    return opts.variant == "megatron" or opts.ddp


def model_config(opts, shape: dict) -> dict:
    """The ``TransformerConfig`` keywords of the variant (dense or MoE; Megatron's graphs only for
    its variant on a GPU: on CPU, a check of this script, it keeps its DDP and main_grad path)."""
    import torch

    graphs = opts.variant == "megatron" and opts.device == "cuda"
    moe = opts.model == "moe"
    dropout = 0.0 if moe else DROPOUT  # tools/bench_moe.py's models train without dropout
    config = dict(
        num_layers=shape["layers"], hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
        ffn_hidden_size=shape["ffn"] if moe else 4 * shape["hidden"], hidden_dropout=dropout,
        attention_dropout=dropout, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=opts.tp, pipeline_model_parallel_size=opts.pp,
        use_cpu_initialization=opts.device == "cpu",
        cuda_graph_impl="local" if graphs else "none",
        batch_p2p_comm=opts.device == "cuda",  # gloo has no coalesced p2p
    )
    if moe:
        capacity = opts.routing == "capacity"
        config.update(
            num_moe_experts=shape["experts"], moe_router_topk=shape["topk"], moe_ffn_hidden_size=shape["ffn"],
            moe_grouped_gemm=False, moe_aux_loss_coeff=0.0,
            # no linear biases, as the models of tools/bench_moe.py; with them an expert's bias is
            # added in place to the output of a tensor-parallel reduce that returns its input at
            # TP=1 (mlp.py:354), which autograd refuses
            add_bias_linear=False,
            # drop and pad: the alltoall dispatcher reads nothing from the host (module docstring)
            moe_token_dispatcher_type="alltoall" if capacity else "allgather",
            moe_expert_capacity_factor=CAPACITY_FACTOR if capacity else None,
            moe_pad_expert_input_to_capacity=capacity,
        )
        if graphs:  # whole layers where the dispatch captures; else Megatron's graphs around it
            config["cuda_graph_modules"] = [] if capacity else ["moe_router", "moe_preprocess"]
    return config


def layer_spec(opts, shape: dict):
    """The dense model's ``get_gpt_layer_local_spec()``; for the MoE model the same spec with
    ``num_experts`` in ``MoETransformerLayer`` (module docstring: the class the local graphs'
    MoE scopes need)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if opts.model != "moe":
        return get_gpt_layer_local_spec()
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import MoETransformerLayer

    spec = get_gpt_layer_local_spec(num_experts=shape["experts"], moe_grouped_gemm=False)
    return ModuleSpec(module=MoETransformerLayer, params=spec.params, submodules=spec.submodules)


def check_shape(shape: dict, *, tp: int, pp: int) -> None:
    """The model splits evenly: layers over the stages, heads and vocabulary over the TP ranks."""
    for what, n, by, flag in (("layers", shape["layers"], pp, "--pp"), ("heads", shape["heads"], tp, "--tp"),
                              ("vocab", shape["vocab"], tp, "--tp")):
        if n % by:
            raise ValueError(f"{what} {n} do not split over {flag} {by}: choose a {flag} that divides {n}")


def _tied_grads_finalizer(gpt):
    """``finalize_model_grads`` without a DDP wrapper: the tied embedding's ``.grad`` summed over
    the first and last pipeline stage (what Megatron's DDP does on ``main_grad``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_embedding_group(check_initialized=False)

    def finalize(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
        if group is None or dist.get_world_size(group) < 2 or dist.get_rank() not in dist.get_process_group_ranks(group):
            return
        weight = gpt.shared_embedding_or_output_weight()
        if weight is not None and weight.grad is not None:
            dist.all_reduce(weight.grad, group=group)

    return finalize


def batches(opts, vocab: int, steps: int, device):
    """Every step's micro-batches, made up front on the device (the same in every variant)."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    count, size = micro_batches(opts)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(count):
            tokens = torch.randint(0, vocab, (size, opts.seq + 1), generator=g)
            step.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
        out.append(step)
    positions = torch.arange(opts.seq, device=device).unsqueeze(0).expand(size, -1)
    return out, positions


# ------------------------------------------------------------------------------------ train
def steps_per_round(seq: int, device: str = "cuda", model: str = "gpt") -> int:
    """Steps in a timed round: on a GPU about as many tokens at every length as 3 steps at seq
    2048, and never fewer than 3 (the CPU check keeps 3); the MoE model's 5 (tools/bench_moe.py)."""
    if device != "cuda":
        return STEPS_PER_ROUND
    if model == "moe":
        return MOE_STEPS_PER_ROUND
    return max(STEPS_PER_ROUND, round(STEPS_PER_ROUND * 2048 / seq))


def run(opts, rank: int) -> dict:
    import torch

    if opts.device == "cpu":
        _cpu_adjustments()
    init_distributed(opts, rank)
    if opts.memory_trace:  # before the model is built: parameters and optimizer state are in the history
        from tools.diagnostics import memtrace

        memtrace.start()
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model, gpt, config, optimizer, shape = build(opts, rank)
    cuda = opts.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    round_steps = steps_per_round(opts.seq, opts.device, opts.model)
    n_micro, micro_size = micro_batches(opts)
    total_steps = CAPTURE_STEPS + opts.rounds * round_steps
    data, positions = batches(opts, shape["vocab"], total_steps + (1 if opts.profile else 0), device)
    last = parallel_state.is_pipeline_last_stage()
    forward_backward = get_forward_backward_func()
    megatron_capture = _watch_megatron_capture() if opts.variant == "megatron" else []

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place

    def forward_step(data_iterator, model_):
        tokens, labels = next(data_iterator)
        return model_(tokens, positions, None, labels=labels), loss_func

    step_starts_us = []

    def step(i: int):
        step_starts_us.append(time.time() * 1e6)
        if in_ddp(opts):
            model.zero_grad_buffer()
        else:
            optimizer.zero_grad(set_to_none=True)
        out = forward_backward(forward_step_func=forward_step, data_iterator=iter(data[i]), model=[model],
                               num_microbatches=n_micro, seq_length=opts.seq,
                               micro_batch_size=micro_size, forward_only=False)
        if in_ddp(opts):  # gradients accumulate into main_grad
            params = [p for p in model.parameters() if p.requires_grad]
            for p in params:
                p.grad = p.main_grad
            optimizer.step()
            for p in params:
                p.grad = None
        else:
            optimizer.step()
        return torch.stack([d["lm loss"] for d in out]).mean() if last else None

    sync = (lambda: torch.cuda.synchronize()) if cuda else (lambda: None)
    losses = []
    mem = {}
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(CAPTURE_STEPS):
        losses.append(step(i))
    sync()
    capture_phase_s = time.perf_counter() - t0
    if cuda:
        mem["peak_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
        mem["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    steady_since_us = time.time() * 1e6
    round_s = []
    i = CAPTURE_STEPS
    for _ in range(opts.rounds):
        sync()
        t = time.perf_counter()
        for _ in range(round_steps):
            losses.append(step(i))
            i += 1
        sync()
        round_s.append(time.perf_counter() - t)
    if cuda:
        mem["steady_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
        mem["steady_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    tokens_per_round = round_steps * n_micro * micro_size * opts.seq
    tps = [tokens_per_round / s for s in round_s]
    record = {
        "rank": rank, "variant": opts.variant, "seq": opts.seq, "tp": opts.tp, "pp": opts.pp,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(), "device": opts.device,
        "model": opts.model, **({"routing": opts.routing} if opts.model == "moe" else {}),
        "shape": shape, "micro_batches": n_micro, "micro_batch_size": micro_size,
        "capture_steps": CAPTURE_STEPS, "steps_per_round": round_steps, "rounds": opts.rounds,
        "tokens_per_s": statistics.median(tps), "tokens_per_s_rounds": tps,
        "tokens_per_s_spread": max(tps) / min(tps), "capture_phase_s": capture_phase_s,
        "losses": [float(x) for x in losses] if last else None,
        **{k: round(v, 1) for k, v in mem.items()},
        **graph_stats(opts.variant, gpt, megatron_capture),
    }
    if opts.memory_trace:
        snapshot = torch.cuda.memory._snapshot()
        record["memory_trace"] = memtrace.analyze(snapshot, steady_since_us=steady_since_us,
                                                  step_starts_us=step_starts_us)
        # GRAPHPP_MEMTRACE_RAW=<folder>: the raw history too, for tools/diagnostics/pool_model.py
        from paddle_graphpp.torch.memory import pool_segments

        layout = "-segments" if opts.variant == "ours" and not pool_segments.enabled() else ""  # ours_segments
        memtrace.write_raw(snapshot, f"{opts.variant}{layout}-seq{opts.seq}-rank{rank}", step_starts_us)
        del snapshot
        print(f"rank {rank} {opts.variant} seq {opts.seq}:\n{memtrace.describe(record['memory_trace'])}", file=sys.stderr)
    if opts.profile:
        record["profile"] = profile_step(lambda: step(i), sync, layer_calls=len(gpt.decoder.layers) * n_micro)
    if opts.tp * opts.pp > 1:
        import torch.distributed as dist

        dist.barrier()
    return record


def _watch_megatron_capture() -> list:
    """Keep what each ``create_cudagraphs()`` call of Megatron's schedules returns (capture time
    and memory); the schedules discard it."""
    from megatron.core.pipeline_parallel import schedules

    stats, create = [], schedules.create_cudagraphs

    def create_and_keep():
        out = create()
        if out:
            stats.append(out)
        return out

    schedules.create_cudagraphs = create_and_keep
    return stats


def graph_stats(variant: str, gpt, megatron_capture: list) -> dict:
    layers = list(gpt.decoder.layers)
    if variant == "ours":
        from paddle_graphpp.core.memory import memory_report

        from paddle_graphpp.torch.layers import is_graphed_layer
        from paddle_graphpp.torch.runtime import RUNTIME

        from paddle_graphpp.torch import CUDAGraphedModule

        report = memory_report()
        lending = RUNTIME.lending_report()  # optimizer steps that borrowed the graph pool, or declined
        loss = gpt.__dict__.get("compute_language_model_loss")  # graph_loss's module, when graphed
        head = gpt.output_layer if gpt.post_process and is_graphed_layer(gpt.output_layer) else None
        # the wrapped layers, or a MoE model's graphed attention and routers (--routing dropless)
        parts = [m for m in gpt.decoder.modules() if isinstance(m, CUDAGraphedModule)]
        graphed = parts + [m for m in (loss, head) if m is not None]
        return {"graphs": sum(m.engine.graph_count() for m in graphed),
                "replays": sum(m.engine.replays for m in graphed),
                "loss_graphs": loss.engine.graph_count() if loss is not None else 0,
                "head_graphs": head.engine.graph_count() if head is not None else 0,
                "capture_s": sum(r["capture_seconds"] for r in report.values()), "memory_report": report,
                **({"pool_lending": lending} if lending is not None else {})}
    if variant == "megatron":
        # a whole layer's manager, or a MoE layer's partial ones (router and postprocess)
        managers = [getattr(l, a, None) for l in layers
                    for a in ("cudagraph_manager", "cudagraph_manager_router", "cudagraph_manager_postprocess")]
        runners = [r for m in managers for r in getattr(m, "cudagraph_runners", [])]
        return {"graphs": sum((r.fwd_graph is not None) + (r.bwd_graph is not None) for r in runners),
                "runners": len(runners),
                "capture_s": sum(s.get("time", 0.0) for s in megatron_capture),
                "capture_reserved_mib": sum(s.get("reserved_bytes", 0) for s in megatron_capture) / 2**20}
    return {}


# ---------------------------------------------------------------------------------- profile
def profile_step(step, sync, *, layer_calls: int, top: int = 25) -> dict:
    """One steady step under torch.profiler (CPU ops, self time) and one under cProfile (Python
    functions); times are also given per layer call (forward calls of all graphed layers)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=activities) as prof:
        step()
        sync()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    op_rows = [{"name": e.key, "calls": e.count, "self_cpu_us": round(e.self_cpu_time_total, 1),
                "cpu_total_us": round(e.cpu_time_total, 1),
                "self_cpu_us_per_layer_call": round(e.self_cpu_time_total / layer_calls, 2)} for e in ops]
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top), file=sys.stderr)

    sync()
    prof_py = cProfile.Profile()
    t = time.perf_counter()
    prof_py.enable()
    step()
    sync()
    prof_py.disable()
    wall = time.perf_counter() - t
    stats = pstats.Stats(prof_py)
    rows = []
    for (path, line, name), (cc, nc, tottime, cumtime, _) in stats.stats.items():
        rows.append({"function": f"{_short(path)}:{line}({name})", "calls": nc, "tottime_ms": round(tottime * 1e3, 3),
                     "cumtime_ms": round(cumtime * 1e3, 3),
                     "tottime_us_per_layer_call": round(tottime * 1e6 / layer_calls, 2),
                     "cumtime_us_per_layer_call": round(cumtime * 1e6 / layer_calls, 2)})
    by_tot = sorted(rows, key=lambda r: r["tottime_ms"], reverse=True)[:top]
    by_cum = sorted(rows, key=lambda r: r["cumtime_ms"], reverse=True)[:top]
    text = io.StringIO()
    pstats.Stats(prof_py, stream=text).sort_stats("tottime").print_stats(top)
    print(text.getvalue(), file=sys.stderr)
    return {"layer_calls": layer_calls, "torch_ops_by_self_cpu": op_rows, "cprofile_wall_ms": round(wall * 1e3, 2),
            "python_by_tottime": by_tot, "python_by_cumtime": by_cum}


def _short(path: str) -> str:
    for marker in ("site-packages/", "paddle_graphpp/", "megatron/"):
        if marker in path:
            return path[path.index(marker):] if marker != "site-packages/" else path.split(marker, 1)[1]
    return path


# ------------------------------------------------------------------------------ CPU check
def _cpu_adjustments() -> None:
    """Let Megatron-Core run its CUDA-only code paths on a CPU build of torch, for checking this
    script: tensors asked for on ``cuda`` are made on the CPU, and the RNG tracker keeps CPU
    generator states. Nothing here runs on a GPU."""
    import torch
    from torch.overrides import TorchFunctionMode

    torch.set_num_threads(1)  # every rank on the same few cores: more threads each only contend

    def cpu(dev):
        if isinstance(dev, int) or (isinstance(dev, str) and dev.startswith("cuda")) or \
                (isinstance(dev, torch.device) and dev.type == "cuda"):
            return torch.device("cpu")
        return dev

    class OnCPU(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in (torch.Tensor.cuda,):
                return args[0]
            if "device" in kwargs:
                kwargs["device"] = cpu(kwargs["device"])
            if func is torch.Tensor.to and args and len(args) > 1 and not isinstance(args[1], torch.dtype) \
                    and not isinstance(args[1], torch.Tensor):
                args = (args[0], cpu(args[1]), *args[2:])
            return func(*args, **kwargs)

    OnCPU().__enter__()  # for the life of the process
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.is_available = lambda: False

    class NoStream:  # Megatron's DDP orders its collectives on streams
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

        def record_event(self, event=None):
            return None

    torch.cuda.Stream = NoStream
    torch.cuda.current_stream = lambda *a, **k: NoStream()
    torch.cuda.stream = lambda s: contextlib.nullcontext()

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


if __name__ == "__main__":
    sys.exit(main())
