"""One rank of a fleet pipeline run, launched by unittests/test_paddle_pipeline*.py.

Run with ``python -m paddle.distributed.launch --nproc_per_node N`` (gloo on CPU). It trains
a tiny GPT-like model whose token embedding is tied to the output head through a
``SharedLayerDesc``, with a plain callable and an opted-out layer in the list, once with
``use_cudagraph=False`` and once with ``use_cudagraph=True`` (same seeds, same data), through
``fleet.distributed_model(...).train_batch(...)``, and writes per-rank JSON to ``--out``:
the losses of both modes, the segmentation report, and how often each graphed run was called.

``--die-rank R`` makes rank R exit abruptly during the first step (to test that the other
ranks fail instead of hanging).

``--to-static user`` builds the graphed run's blocks converted by their user
(``paddle.jit.to_static`` on each instance); ``--to-static option`` builds it with
``PipelineLayer(to_static=True)``. The eager run stays plain, and the JSON then also holds how
many converted programs the graphed run executed. ``--dropout`` sets the blocks' dropout.

``--recompute-interval N`` builds both models with fleet's ``recompute_interval=N``; the JSON then
also holds how often each block and the opted-out layer ran forward (``forwards``, by layer
index), recomputations included.
"""

import argparse
import os

import paddle
import paddle.nn as nn
import paddle.nn.functional as F
from paddle.distributed.fleet.meta_parallel import LayerDesc, SharedLayerDesc

import paddle_graphpp
from fleet_ranks import count_calls, finish, init_fleet, train_on_random_tokens
from paddle_graphpp.paddle.pipeline import PipelineLayer

VOCAB, HIDDEN, SEQ = 32, 16, 6


class TiedEmbedding(nn.Layer):
    def __init__(self):
        super().__init__()
        self.weight = self.create_parameter([VOCAB, HIDDEN])

    def forward(self, tokens):
        return F.embedding(tokens, self.weight)


def tied_head(embedding, hidden):
    return paddle.matmul(hidden, embedding.weight, transpose_y=True)


class Block(nn.Layer):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.fc2 = nn.Linear(2 * HIDDEN, HIDDEN)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class UserStaticBlock(Block):
    """A Block its user converted: ``paddle.jit.to_static`` on the instance, as built."""

    def __init__(self, dropout=0.1):
        super().__init__(dropout)
        paddle.jit.to_static(self)


@paddle_graphpp.mark_not_capturable
class HostSyncProbe(nn.Layer):
    """Stands for a layer that must stay eager (it reads a value on the host); it has a weight of its
    own, so that fleet's recompute_interval recomputes it in its group."""

    def __init__(self):
        super().__init__()
        self.scale = self.create_parameter([HIDDEN], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x):
        self.last_mean = float(x.mean())
        return x * self.scale


def scale_residual(x):
    return x * 0.5


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1]))


def layer_descs(num_blocks, block=Block, dropout=0.1):
    descs = [SharedLayerDesc("embed", TiedEmbedding, shared_weight_attr="weight")]
    for i in range(num_blocks):
        descs.append(LayerDesc(block, dropout=dropout))
        if i == 0:
            descs.append(scale_residual)
        if i == num_blocks // 2:
            descs.append(LayerDesc(HostSyncProbe))
    descs.append(SharedLayerDesc("embed", TiedEmbedding, forward_func=tied_head, shared_weight_attr="weight"))
    return descs


def count_converted_runs():
    """``{"runs": n}``, n counting the converted programs (SOT's or the AST converter's) run from now on."""
    from paddle.jit.dy2static.pir_partial_program import PartialProgramLayer

    counter = {"runs": 0}
    for method in ("__call__", "sot_call"):
        def counted(self, *a, _run=getattr(PartialProgramLayer, method), **k):
            counter["runs"] += 1
            return _run(self, *a, **k)

        setattr(PartialProgramLayer, method, counted)
    return counter


def count_forwards(model):
    """``{layer index: forwards}`` of the model's blocks and opted-out layers on this rank."""
    counts = {}
    for name, layer in model.named_sublayers():
        if isinstance(layer, (Block, HostSyncProbe)) and "." not in name:
            counts[name] = 0
            layer.register_forward_pre_hook(lambda _l, _i, name=name: counts.__setitem__(name, counts[name] + 1))
    return counts


def train(args, use_cudagraph):
    converted = use_cudagraph and args.to_static != "none"
    recompute = {}
    if args.recompute_interval:
        from paddle.distributed import fleet

        recompute = dict(recompute_interval=args.recompute_interval, recompute_ctx={
            "mp_group": fleet.get_hybrid_communicate_group().get_model_parallel_group(),
            "offload": False, "partition": False})
    paddle.seed(args.seed)
    model = PipelineLayer(
        layer_descs(args.blocks, UserStaticBlock if converted and args.to_static == "user" else Block, args.dropout),
        num_stages=args.pp, loss_fn=loss_fn,
        seg_method="layer:Block" if args.vpp > 1 else "uniform",
        num_virtual_pipeline_stages=args.vpp if args.vpp > 1 else None,
        use_cudagraph=use_cudagraph, graph_loss=use_cudagraph, to_static=converted and args.to_static == "option",
        **recompute,
    )
    calls = count_calls(model.graphed_layers())
    forwards = count_forwards(model)
    programs = count_converted_runs() if converted else None
    model, losses = train_on_random_tokens(model, args, VOCAB, SEQ, die_rank=args.die_rank)
    inner = model._layers
    return {"losses": losses, "report": inner.segmentation_report(), "graphed_calls": calls, "forwards": forwards,
            "uses_hop_groups": inner.uses_hop_groups, "converted_runs": programs and programs["runs"],
            "run_function_types": sorted({type(f).__name__ for f in
                                          (inner.run_function if args.vpp == 1 else
                                           [f for c in inner._model_chunks for f in c.run_function])})}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--to-static", choices=["none", "user", "option"], default="none")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--recompute-interval", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.to_static != "none":
        os.environ["MIN_GRAPH_SIZE"] = "0"  # SOT runs pieces under 10 operators (one block) unconverted

    rank = init_fleet(args.pp, args.micro_batches, args.micro_batch_size)
    finish(args.out, rank, {"rank": rank, "eager": train(args, False), "graphed": train(args, True)})


if __name__ == "__main__":
    main()
