"""One rank of a fleet DualPipeV run, launched by unittests/test_zero_bubble_paddle.py.

Run with ``python -m paddle.distributed.launch --nproc_per_node 2`` (gloo on CPU). It trains a
token embedding tied to the output head (``LocalSharedLayerDesc``: DualPipeV puts both on the
first rank) around blocks built from fleet's ``SplitBWLinear`` (weight gradients deferred by the
zero-bubble backwards) and a plain linear, with dropout, as ``paddle_graphpp.PipelineLayer(...,
use_dualpipev=True)`` (AdamW, random tokens: ``fleet_ranks.train_on_random_tokens``), once with ``use_cudagraph=False`` and once with ``use_cudagraph=True``
(same seeds, same data), through ``fleet.distributed_model(...).train_batch(...)``. Per rank
it writes to ``--out``: each mode's per-step losses, a digest of every parameter gradient
before each optimizer step and of the weights after training, how many weight halves of
graphed runs fleet's store ran, and the micro-batches left in flight.

``--runtime fake`` plugs the fake graph runtime (unittests/fake_paddle_runtime.py) into
``CUDAGraphedLayer``: capture and replay then only do bookkeeping (replayed values are stale),
which checks that DualPipeV's order captures and replays every graphed run's positions.
"""

import argparse
import hashlib
import os
import sys

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
from paddle.distributed.fleet.meta_parallel import LayerDesc, LocalSharedLayerDesc
from paddle.distributed.fleet.meta_parallel.zero_bubble_utils import SplitBWLinear

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # unittests/
from fleet_ranks import finish, init_fleet, train_on_random_tokens
from paddle_graphpp.paddle import runtime as paddle_runtime
from paddle_graphpp.paddle.pipeline import PipelineLayer

VOCAB, HIDDEN, SEQ = 16, 8, 3


def _one(x):
    """DualPipeV hands a chunk's first layer, and the loss, a one-tensor list (except the raw
    micro-batch of the first chunk)."""
    return x[0] if isinstance(x, (list, tuple)) else x


class Embedding(nn.Layer):
    def __init__(self, weight=None):
        super().__init__()
        self.weight = self.create_parameter([VOCAB, HIDDEN]) if weight is None else weight

    def forward(self, tokens):
        return F.embedding(_one(tokens), self.weight)


def tied_head(embedding, hidden):
    return paddle.matmul(_one(hidden), embedding.weight, transpose_y=True)


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = SplitBWLinear(HIDDEN, 2 * HIDDEN)
        self.fc2 = SplitBWLinear(2 * HIDDEN, HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        x = _one(x)
        return x + self.proj(self.drop(self.fc2(F.gelu(self.fc1(self.norm(x))))))


def loss_fn(logits, labels):
    return F.cross_entropy(_one(logits).reshape([-1, VOCAB]), labels.reshape([-1]))


def digest(array) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


def train(args, use_cudagraph):
    paddle.seed(args.seed)
    descs = ([LocalSharedLayerDesc("embed", Embedding, shared_weight_attr="weight")]
             + [LayerDesc(Block) for _ in range(args.blocks)]
             + [LocalSharedLayerDesc("embed", Embedding, forward_func=tied_head, shared_weight_attr="weight")])
    model = PipelineLayer(descs, num_stages=args.pp, loss_fn=loss_fn,
                          seg_method="layer:Block", use_dualpipev=True, use_cudagraph=use_cudagraph,
                          num_warmup_steps=1, graph_loss=use_cudagraph)
    named = dict(model.named_parameters())
    grads = []

    def note_grads():
        grads.append({n: None if p.grad is None else digest(p.grad.numpy()) for n, p in named.items()})

    dmodel, losses = train_on_random_tokens(model, args, VOCAB, SEQ, before_step=note_grads)
    layers = model.graphed_layers()
    return {"class": type(dmodel).__name__, "losses": losses, "grads": grads,
            "weights": {n: digest(p.numpy()) for n, p in named.items()},
            "graphed_layers": len(layers), "report": model.segmentation_report(),
            "in_flight": sum(layer.engine.in_flight for layer in layers),
            "graphed_runs": [{"captures": layer.engine.captures, "replays": layer.engine.replays,
                              "positions": layer.engine.position_kinds(), "graphs": layer.engine.graph_count(),
                              "in_flight": layer.engine.in_flight} for layer in layers]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--runtime", choices=["real", "fake"], default="real")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    rank = init_fleet(args.pp, args.micro_batches, args.micro_batch_size, dualpipev=True)
    weight_halves = []
    run_weight_half = paddle_runtime._weight_pass

    def counted(ctx):
        weight_halves.append(ctx.call.engine.name)
        run_weight_half(ctx)

    paddle_runtime._weight_pass = counted
    eager = train(args, False)
    if args.runtime == "fake":
        from fake_paddle_runtime import FakePaddleRuntime
        from paddle_graphpp.core.runtime import register_runtime

        register_runtime("paddle", FakePaddleRuntime)  # what the graphed layers built from here use
    graphed = train(args, True)
    finish(args.out, rank, {"rank": rank, "eager": eager, "graphed": graphed,
                            "weight_halves_run": len(weight_halves)})


if __name__ == "__main__":
    main()
