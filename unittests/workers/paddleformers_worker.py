"""One rank of a PaddleFormers pipe model trained by fleet, launched by
unittests/test_paddleformers_pipe.py (Llama) and unittests/test_paddleformers_zoo.py.

Run with ``python -m paddle.distributed.launch --nproc_per_node N`` (gloo on CPU). The tiny
model of ``--model NAME`` (a case of ``paddleformers_zoo.CASES``, which holds each class's
configuration and CPU settings; ``--layers`` decoder layers) is built and trained three times
with the same seeds and data, through ``fleet.distributed_model(...).train_batch(...)``:

* ``eager``: as PaddleFormers builds it;
* ``graph_pipeline``: built the same way, then ``paddle_graphpp.graph_pipeline(model)``;
* ``install``: built under ``paddle_graphpp.install(default_use_cudagraph=True)``
  (PaddleFormers calls fleet's ``PipelineLayer.__init__`` without ``use_cudagraph``).

``--routes`` picks some of them (``--routes eager`` checks that a new class trains at all).
Writes per-rank JSON to ``--out``: per-step losses, segmentation reports, state_dict keys,
parameter names before and after graphing, and how often each graphed run was called.

``--recompute-interval N`` sets fleet's ``_recompute_interval`` of the ``eager`` and
``graph_pipeline`` models to N after building them (PaddleFormers builds with 0 and a
``recompute_ctx``), before graphing; the ``install`` model is graphed inside its constructor and
keeps 0. The JSON then also holds how often each decoder layer ran forward (``forwards``).
"""

import argparse

import paddle
from paddle.distributed import fleet

import paddle_graphpp
from fleet_ranks import count_calls, finish, init_fleet, train_on_random_tokens
from paddle_graphpp.paddle import fleet_cpu
from paddleformers_zoo import SEQ, VOCAB, case


def new_model(args):
    zoo = case(args.model)
    return zoo.pipe_cls()(zoo.build_config(layers=args.layers, tie=args.tie, vpp=args.vpp))


def build(args, route):
    paddle.seed(args.seed)
    if route == "install":
        paddle_graphpp.install(default_use_cudagraph=True)
        try:
            model = new_model(args)
        finally:
            paddle_graphpp.uninstall()
        return model, None
    model = new_model(args)
    model._recompute_interval = args.recompute_interval
    if route == "eager":
        return model, None
    names = [p.name for p in model.parameters()]
    paddle_graphpp.graph_pipeline(model)
    return model, names


def train(args, route):
    model, names_before = build(args, route)
    graphs = paddle_graphpp.GraphedPipeline.of(model)
    calls = count_calls(graphs.graphed_layers() if graphs else [])
    forwards = {}
    for name, layer in model.named_sublayers():
        if type(layer).__name__.endswith("DecoderLayerPipe"):
            forwards[name] = 0
            layer.register_forward_pre_hook(lambda _l, _i, name=name: forwards.__setitem__(name, forwards[name] + 1))
    record = {
        "graphed_names": [layer.engine.name for layer in graphs.graphed_layers()] if graphs else [],
        "report": graphs.segmentation_report() if graphs else None,
        "state_dict_keys": list(model.state_dict().keys()),
        "names_before": names_before,
        "names_after": [p.name for p in model.parameters()],
    }
    _, losses = train_on_random_tokens(model, args, VOCAB, SEQ, labels_as_tuple=case(args.model).labels_as_tuple)
    record.update(losses=losses, graphed_calls=calls, forwards=forwards)
    return record


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama", help="a case of paddleformers_zoo.CASES")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument("--layers", type=int, help="decoder layers (the case's by default)")
    parser.add_argument("--tie", type=int, choices=(0, 1), help="tied embeddings (the case's by default)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--recompute-interval", type=int, default=0)
    parser.add_argument("--routes", default="eager,graph_pipeline,install", help="comma-separated, in this order")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    rank = init_fleet(args.pp, args.micro_batches, args.micro_batch_size)
    # The project's CPU fleet adjustments, which any fleet pipeline needs on CPU ranks.
    fleet_cpu.adjust_for_cpu()
    uses_hop_groups = fleet_cpu.use_hop_groups(fleet.get_hybrid_communicate_group())
    result = {"rank": rank, "uses_hop_groups": uses_hop_groups}
    for route in args.routes.split(","):
        result[route] = train(args, route)
    finish(args.out, rank, result)


if __name__ == "__main__":
    main()
