"""One rank of PaddleFormers' ``Trainer`` training a tiny tied ``LlamaForCausalLMPipe`` with
pipeline parallelism, launched by unittests/test_paddleformers_trainer.py.

Run with ``python -m paddle.distributed.launch --nproc_per_node N`` (gloo on CPU), N = ``--pp``
(2 by default; ``--vpp`` virtual stages per rank, ``--layers`` decoder layers). The script is
written as a user's would be, in the Trainer's order: ``TrainingArguments(...)`` (whose
``__post_init__`` calls ``fleet.init``), then ``fleet_cpu.adjust_for_cpu()``, then per route the
model, the switch, ``Trainer(...)`` and ``train()``. Routes, same seeds and data:

* ``eager``: the model as PaddleFormers builds it;
* ``graph_pipeline``: ``paddle_graphpp.graph_pipeline(model)`` before ``Trainer(...)``;
* ``install``: the model built under ``paddle_graphpp.install(default_use_cudagraph=True)``.

Each route trains ``--steps`` optimizer steps (``gradient_accumulation_steps`` micro-batches
each, ``max_grad_norm``, a linear schedule with warmup) saving every ``--save-steps``, then a
fresh model of the same route resumes from the first checkpoint and trains to the end. The last
checkpoint of each route is also loaded into a fresh, ungraphed model. Writes per-rank JSON to
``--out``: per-step losses, grad norms and learning rates, weight digests, segmentation reports.

The only lines a user would not write are :func:`paddleformers_cpu.work_around_trainer_defects`
(PaddleFormers' own CPU/fp32 defects, test support) and the recording of results.
"""

import argparse
import hashlib
import os

import numpy as np
import paddle
from paddle.distributed import fleet

import paddle_graphpp
from fleet_ranks import FLEET_READY, count_calls, finish
from paddle_graphpp.paddle import fleet_cpu
from paddleformers_cpu import work_around_trainer_defects

VOCAB, HIDDEN, SEQ = 96, 64, 8


def llama_config(args):
    from paddleformers.transformers import LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=True)
    config.fuse_rms_norm = False  # the fused RMSNorm kernel has no CPU build
    config.virtual_pipeline_model_parallel_size = args.vpp
    return config


class RandomTokens(paddle.io.Dataset):
    """``n`` fixed random sequences as ``{"input_ids", "labels"}`` (labels shifted by one)."""

    def __init__(self, n, seed):
        self.tokens = np.random.RandomState(seed).randint(0, VOCAB, (n, SEQ + 1)).astype("int64")

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def build(route, args):
    from paddleformers.transformers import LlamaForCausalLMPipe

    paddle.seed(args.seed)
    if route == "install":
        paddle_graphpp.install(default_use_cudagraph=True)
        try:
            return LlamaForCausalLMPipe(llama_config(args))
        finally:
            paddle_graphpp.uninstall()
    model = LlamaForCausalLMPipe(llama_config(args))
    if route == "graph_pipeline":
        paddle_graphpp.graph_pipeline(model)  # the one switch: after building, before Trainer(...)
    return model


def digests(model):
    """``{parameter name: sha256 of its bytes}``: equal digests are bit-identical weights."""
    return {k: hashlib.sha256(np.ascontiguousarray(v.numpy()).tobytes()).hexdigest()
            for k, v in model.state_dict().items()}


def logged_steps():
    """A ``TrainerCallback`` keeping every per-step log (loss, global_norm, learning_rate, ...)
    in its ``logs`` (the Trainer empties ``state.log_history`` after each log)."""
    from paddleformers.trainer import TrainerCallback

    class KeepLogs(TrainerCallback):
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.logs.append(dict(logs))

    return KeepLogs()


def train(route, args, training_args, dataset, output_dir, resume_from=None):
    from paddleformers.trainer import Trainer

    model = build(route, args)
    training_args.output_dir = output_dir
    graphs = paddle_graphpp.GraphedPipeline.of(model)
    calls = count_calls(graphs.graphed_layers() if graphs else [])
    kept = logged_steps()
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=[kept])
    trainer.train(resume_from_checkpoint=resume_from)
    logs = kept.logs
    return {
        "losses": [log["loss"] for log in logs],
        "grad_norms": [log["global_norm"] for log in logs],
        "learning_rates": [log["learning_rate"] for log in logs],
        "steps": [log["global_step"] for log in logs],
        "weights": digests(model),
        "report": graphs.segmentation_report() if graphs else None,
        "graphed_calls": sorted(set(calls.values())),
    }


def load_into_ungraphed(checkpoint, args):
    """A fresh ungraphed model with the weights of ``checkpoint``, loaded the way the Trainer
    loads its flex checkpoints (``paddle.distributed.load_state_dict`` over the model's
    ``sharded_state_dict()``); their digests."""
    from paddleformers.transformers import LlamaForCausalLMPipe

    paddle.seed(args.seed + 1)  # other initial weights: only the checkpoint can make them equal
    model = LlamaForCausalLMPipe(llama_config(args))
    assert paddle_graphpp.GraphedPipeline.of(model) is None
    paddle.distributed.load_state_dict(model.sharded_state_dict(), os.path.join(checkpoint, "model_state"))
    return digests(model)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--routes", default="eager,graph_pipeline,install")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from paddleformers.trainer import TrainingArguments

    training_args = TrainingArguments(
        output_dir=os.path.join(args.out, "unused"), pipeline_model_parallel_size=args.pp,
        per_device_train_batch_size=1, gradient_accumulation_steps=args.accumulation,
        max_steps=args.steps, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1,
        max_grad_norm=1.0, save_steps=args.save_steps, logging_steps=1, seed=args.seed,
        amp_master_grad=False,  # the Trainer refuses its default (True) without fp16/bf16
        report_to=[], disable_tqdm=True, dataloader_num_workers=0)  # calls fleet.init
    rank = paddle.distributed.get_rank()
    print(FLEET_READY, flush=True)
    paddle.distributed.barrier()
    fleet_cpu.adjust_for_cpu()  # after TrainingArguments(...), before Trainer.train()
    uses_hop_groups = fleet_cpu.use_hop_groups(fleet.get_hybrid_communicate_group())  # gloo with pp > 2
    work_around_trainer_defects()

    dataset = RandomTokens(args.steps * args.accumulation, args.seed)
    result = {"rank": rank, "uses_hop_groups": uses_hop_groups}
    for route in args.routes.split(","):
        out = os.path.join(args.out, route)
        first_save = os.path.join(out, f"checkpoint-{args.save_steps}")
        result[route] = train(route, args, training_args, dataset, out)
        result[route]["resumed"] = train(route, args, training_args, dataset, out + "-resumed", resume_from=first_save)
        if route != "eager":  # the graphed run's checkpoints in an ungraphed model
            result[route]["eager_resumed"] = train("eager", args, training_args, dataset, out + "-eager-resumed",
                                                   resume_from=first_save)
            result[route]["loaded"] = load_into_ungraphed(os.path.join(out, f"checkpoint-{args.steps}"), args)
    finish(args.out, rank, result)


if __name__ == "__main__":
    main()
