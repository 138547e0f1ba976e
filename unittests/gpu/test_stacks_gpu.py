"""Graphed blocks inside the training stacks users run, on one GPU: Lightning's closure, the Hugging
Face Trainer and accelerate (the recipes of docs/pytorch.md), each equal to its eager run.

Lightning runs the last micro-batch of each accumulation window inside
``optimizer.step(closure)``. The optimizer's pre-step hook used to lend the graph pool to the
step (its temporaries reuse the activations' memory between episodes), and the closure's eager
work (the embedding, the rotary tables) then landed in pool memory that the graphs it replayed
overwrote: graphed training drifted from eager (3e-4) from the first such micro-batch after the
capture. A step with a closure no longer borrows.

* Lightning's order without Lightning: fp32 weights under ``torch.autocast(bf16)``, 4 micro-batches
  a window, the last inside ``optimizer.step(closure)`` with clipping in the closure; graphed
  equals eager bit for bit (against the eager-vs-eager spread).
* Lightning itself (when installed): ``precision="bf16-mixed"``, ``accumulate_grad_batches=4``,
  ``gradient_clip_val=1.0``; the logged losses and final weights equal eager's.
"""
import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires a CUDA device")
transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from paddle_graphpp.torch import graph_layers  # noqa: E402

DEV = "cuda"
VOCAB, SEQ, MBS, MICRO, STEPS = 256, 64, 2, 4, 5


def build():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1, use_cache=False)
    return LlamaForCausalLM(config).to(DEV)


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (MBS, SEQ), generator=g).to(DEV) for _ in range(n)]


def lightning_order(model, data):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    torch.manual_seed(3)
    for step in range(STEPS):
        window = data[step * MICRO:(step + 1) * MICRO]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for tokens in window[:-1]:
                loss = model(tokens, labels=tokens).loss / MICRO
                loss.backward()
                losses.append(loss.detach().float())

            def closure():
                loss = model(window[-1], labels=window[-1]).loss / MICRO
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                losses.append(loss.detach().float())
                return loss

            opt.step(closure)
        opt.zero_grad()
    torch.cuda.synchronize()
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def graph_layers_of(model):
    graph_layers(model.model.layers)


def graphed_equals_eager(fit, base, graph=graph_layers_of):
    """``fit`` twice eagerly (their spread is the tolerance), then on a copy graphed by ``graph``."""
    ref_losses, ref_params = fit(copy.deepcopy(base))
    again_losses, again_params = fit(copy.deepcopy(base))
    spread = max((again_losses - ref_losses).abs().max().item(), max_diff(again_params, ref_params))
    model = copy.deepcopy(base)
    graph(model)
    losses, params = fit(model)
    engine = (model._graphpp_whole.graphed if "_graphpp_whole" in model.__dict__
              else model.model.layers[0].graphed)._engine
    assert engine.replays > 0 and len(losses) == len(ref_losses)
    loss_diff, param_diff = (losses - ref_losses).abs().max().item(), max_diff(params, ref_params)
    assert loss_diff <= spread and param_diff <= spread, (loss_diff, param_diff, spread)


def test_lightnings_closure_order_graphed_equals_eager():
    data = batches(STEPS * MICRO)
    graphed_equals_eager(lambda model: lightning_order(model, data), build())


def test_lightning_trainer_graphed_equals_eager(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model, self.losses = model, []

        def training_step(self, tokens, _):
            loss = self.model(tokens, labels=tokens).loss
            self.losses.append(loss.detach().float())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def fit(model):
        module = Module(model)
        trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", accumulate_grad_batches=MICRO,
                             gradient_clip_val=1.0, max_steps=STEPS, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
        torch.manual_seed(3)
        tokens = torch.cat([b.cpu() for b in batches(STEPS * MICRO)])
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(tokens, batch_size=MBS))
        torch.cuda.synchronize()
        return torch.stack(module.losses), [p.detach().clone() for p in model.parameters()]

    graphed_equals_eager(fit, build())


@pytest.mark.parametrize("route", ["graph_layers", "graph_model"])
def test_hf_trainer_graphed_equals_eager(route, tmp_path):
    from transformers import Trainer, TrainingArguments

    from paddle_graphpp.torch import graph_model

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(1)
            self.ids = torch.randint(0, VOCAB, (STEPS * MICRO * MBS, SEQ), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def fit(model):
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=MBS,
                                 gradient_accumulation_steps=MICRO, max_steps=STEPS, bf16=True, max_grad_norm=1.0,
                                 learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=1, logging_steps=1,
                                 report_to=[], save_strategy="no", seed=3, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens())
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        torch.cuda.synchronize()
        return torch.tensor(losses), [p.detach().clone() for p in model.parameters()]

    graphed_equals_eager(fit, build(), graph_layers_of if route == "graph_layers" else graph_model)


def test_accelerate_graphed_equals_eager():
    accelerate = pytest.importorskip("accelerate")

    def fit(model):
        accelerator = accelerate.Accelerator(mixed_precision="bf16", gradient_accumulation_steps=MICRO)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = accelerator.prepare(model, opt)
        losses = []
        torch.manual_seed(3)
        for tokens in batches(STEPS * MICRO):
            with accelerator.accumulate(model):
                loss = model(tokens, labels=tokens).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            losses.append(loss.detach().float())
        torch.cuda.synchronize()
        accelerator.free_memory()
        return torch.stack(losses), [p.detach().clone() for p in model.parameters()]

    graphed_equals_eager(fit, build())  # graph_layers before accelerator.prepare()
