"""One rank of a Hugging Face causal LM trained with Schedule1F1B, started by unittests/test_hf_torch.py
(gloo, CPU) and unittests/gpu/test_hf_gpu.py (``--device cuda``: NCCL, one GPU per rank, TF32 off).

Runs as ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` say (2 ranks). It
builds a small GPT-2 or Llama from a config (dropout on, untied embeddings), cuts it with
``causal_lm_stage`` (``--vpp 2``: two stages per rank, ScheduleInterleaved1F1B) and trains this
rank's stages twice from the same seeds: with eager blocks
(``graph=False``) and with graphed blocks. It writes ``rank<N>.json`` into ``--out``: per run the
losses (last rank), the blocks' class names and the stage's state_dict keys, and how the two
runs' parameter gradients compared after every step (compared here, tensor by tensor: the
names of those not bit-equal, and the largest relative difference), and on a GPU the graphed
blocks' capture and replay counts.
"""
import argparse
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]

import torch  # noqa: E402
from workers.torch_ranks import run_rank  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B  # noqa: E402

from paddle_graphpp.torch.hf import causal_lm_stage  # noqa: E402

VOCAB, SEQ, MBS = 64, 8, 2


def build(kind, hidden):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1, use_cache=False,
            tie_word_embeddings=False))
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=4, n_head=4, n_positions=64,
                                      use_cache=False, tie_word_embeddings=False))


def loss_fn(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def train(args, rank, world, graph):
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    num_stages = world * args.vpp
    model = build(args.model, args.hidden)  # every rank builds the whole model, then keeps its stages
    modules, stages = {}, []
    for index in range(rank, num_stages, world):  # interleaved: stages rank, rank + world, ...
        mod = causal_lm_stage(model, index, num_stages, 1, graph=graph).to(device)
        x, y = mod.example_io(MBS, SEQ)
        modules[index] = mod
        stages.append(PipelineStage(mod, index, num_stages, device, input_args=(x,), output_args=(y,)))
    if args.vpp == 1:
        schedule = Schedule1F1B(stages[0], n_microbatches=args.micro_batches, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=args.micro_batches, loss_fn=loss_fn)
    params = {f"{i}:{n}": p for i, mod in modules.items() for n, p in mod.named_parameters()}
    opt = torch.optim.AdamW(params.values(), lr=1e-2)
    torch.manual_seed(args.seed * 7 + rank)  # the dropout stream
    data = torch.Generator().manual_seed(args.seed)
    losses, grads = [], []
    for _ in range(args.steps):
        tokens = torch.randint(0, VOCAB, (args.micro_batches * MBS, SEQ + 1), generator=data).to(device)
        step_losses = [] if rank == world - 1 else None
        opt.zero_grad()
        # contiguous slices: torch 2.11's PipelineStage refuses inputs whose strides differ from the
        # example's ("stride mismatch: expected (8, 1) actual (9, 1)")
        schedule.step(*((tokens[:, :-1].contiguous(),) if rank == 0 else ()),
                      target=tokens[:, 1:].contiguous() if rank == world - 1 else None, losses=step_losses)
        grads.append({n: p.grad.clone() for n, p in params.items() if p.grad is not None})
        opt.step()
        if step_losses is not None:
            losses.append(torch.stack(step_losses).mean().item())
    blocks = [b for mod in modules.values() for b in mod.blocks]
    summary = {"losses": losses, "blocks": [type(b).__name__ for b in blocks],
               "state_dict_keys": [k for mod in modules.values() for k in mod.state_dict()],
               "engines": [{"captures": b.engine.captures, "replays": b.engine.replays, "in_flight": b.engine.in_flight}
                           for b in blocks if graph]}
    return summary, grads


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["gpt2", "llama"], required=True)
    parser.add_argument("--vpp", type=int, default=1, help="stages per rank (ScheduleInterleaved1F1B when > 1)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*CUDA graphs are not used.*")
    def body(rank, world):
        eager, eager_grads = train(args, rank, world, graph=False)
        graphed, graphed_grads = train(args, rank, world, graph=True)
        compared, mismatched, worst = 0, [], 0.0
        for step, (ge, gg) in enumerate(zip(eager_grads, graphed_grads)):
            if ge.keys() != gg.keys():
                mismatched.append(f"step {step}: parameters with gradients differ")
            for name in ge.keys() & gg.keys():
                compared += 1
                if not torch.equal(ge[name], gg[name]):
                    mismatched.append(f"step {step}: {name}")
                    diff = (gg[name].double() - ge[name].double()).norm()
                    worst = max(worst, (diff / ge[name].double().norm().clamp_min(1e-30)).item())
        result = {"rank": rank, "eager": eager, "graphed": graphed, "grads_compared": compared,
                  "grad_mismatches": mismatched, "grad_max_rel": worst}
        return result

    run_rank(args.device, args.out, body)

if __name__ == "__main__":
    main()
