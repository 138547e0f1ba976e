"""Activation checkpointing inside graphed blocks, on one GPU.

A block with transformers' gradient checkpointing on (``model.gradient_checkpointing_enable()``)
or graphed with ``recompute=True`` keeps no activations in its forward graph; its backward graph
runs the forward again (drawing the forward's dropout masks from the RNG mirrors) before the
backward.

* Graphed checkpointed training equals eager checkpointed training bit for bit (fp32, dropout
  on: the eager runs' spread is 0), with checkpointing turned on before or after graphing.
* ``CUDAGraphedModule(recompute=True)`` over a module with dropout equals
  ``torch.utils.checkpoint`` over it, replays after replays.
* Peak memory, the capture step included, each variant in its own process: graphed checkpointed
  <= 1.05x eager checkpointed, and below graphed without checkpointing.
"""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires a CUDA device")
transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from paddle_graphpp.torch import CUDAGraphedModule, graph_layers  # noqa: E402

DEV = "cuda"
VOCAB, MICRO = 256, 4


def build(hidden=128, layers=4, dropout=0.1, vocab=VOCAB):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2 + 64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         attention_dropout=dropout, use_cache=False)
    return LlamaForCausalLM(config).to(DEV)


def train(model, steps, *, batch=2, seq=64):
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    data = [torch.randint(0, vocab, (batch, seq), generator=g).to(DEV) for _ in range(steps * MICRO)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    torch.manual_seed(3)
    for step in range(steps):
        for tokens in data[step * MICRO:(step + 1) * MICRO]:
            loss = model(tokens, labels=tokens).loss / MICRO
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return torch.stack(losses).cpu(), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("when", ["before", "after"])
def test_checkpointed_graphed_blocks_equal_eager_checkpointed(when):
    runs = []
    for graphed in (False, False, True):
        model = build()
        model.train()
        if when == "before" or not graphed:
            model.gradient_checkpointing_enable()
        if graphed:
            graph_layers(model.model.layers)
            if when == "after":
                model.gradient_checkpointing_enable()
        runs.append(train(model, 6))
    (eager_a, weights_a), (eager_b, weights_b), (ours, weights) = runs
    spread = (eager_a - eager_b).abs().max().item()
    weight_spread = max((a - b).abs().max().item() for a, b in zip(weights_a, weights_b))
    engine = model.model.layers[0].engine
    assert engine.replays > 0, "the graphed blocks never replayed"
    assert all(p.recomputes for p in engine.positions()), "the captured positions do not recompute"
    assert (ours - eager_a).abs().max().item() <= spread, (ours - eager_a).abs().max().item()
    assert max((a - b).abs().max().item() for a, b in zip(weights_a, weights)) <= weight_spread


def test_recompute_option_equals_torch_checkpoint_with_dropout():
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Dropout(0.3),
                               torch.nn.Linear(256, 64), torch.nn.Dropout(0.2)).to(DEV)
    ref = copy.deepcopy(body)
    graphed = CUDAGraphedModule(body, recompute=True)
    x = torch.randn(8, 64, device=DEV)
    for step in range(8):
        outs = []
        for module, run in ((ref, lambda m, t: torch.utils.checkpoint.checkpoint(m, t, use_reentrant=False)),
                            (graphed, lambda m, t: m(t))):
            torch.manual_seed(10 + step)
            t = x.clone().requires_grad_(True)
            y = run(module, t)
            (y * y).sum().backward()
            outs.append((y.detach().clone(), t.grad.clone()))
        (y_ref, gx_ref), (y, gx) = outs
        assert torch.equal(y_ref, y), f"step {step}: outputs differ"
        assert torch.equal(gx_ref, gx), f"step {step}: input gradients differ (the recompute drew other masks)"
        for a, b in zip(ref.parameters(), body.parameters()):
            assert torch.equal(a.grad, b.grad), f"step {step}: parameter gradients differ"
    assert graphed.engine.replays > 0 and all(p.recomputes for p in graphed.engine.positions())


# ----------------------------------------------------------------------------- memory, one process each
# Llama's vocabulary: the logits count as they do in training (with a 256-token vocabulary the
# static buffers and pool holes of the capture, 24 + ~20 MiB, are 5.6% of a 770 MiB peak)
SHAPE = dict(hidden=512, layers=8, dropout=0.1, vocab=32000)
BATCH, SEQ = 4, 1024


def _memory_worker(variant: str) -> None:
    model = build(**SHAPE)
    model.train()
    if variant in ("eager_checkpointed", "graphed_checkpointed"):
        model.gradient_checkpointing_enable()
    if variant.startswith("graphed"):
        graph_layers(model.model.layers)
    torch.cuda.reset_peak_memory_stats()
    train(model, 6, batch=BATCH, seq=SEQ)
    torch.cuda.synchronize()
    replays = model.model.layers[0].engine.replays if variant.startswith("graphed") else 0
    print(json.dumps({"variant": variant, "peak": torch.cuda.max_memory_allocated(), "replays": replays}))


def _peak(variant: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, variant], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_checkpointed_graphs_peak_memory_drops_like_eager_checkpointing():
    peaks = {v: _peak(v) for v in ("eager_checkpointed", "graphed_checkpointed", "graphed")}
    ours, eager, full = (peaks[v]["peak"] for v in ("graphed_checkpointed", "eager_checkpointed", "graphed"))
    assert peaks["graphed_checkpointed"]["replays"] > 0
    print({v: round(p["peak"] / 2**20) for v, p in peaks.items()})
    assert ours <= 1.05 * eager, f"graphed checkpointed peak {ours / 2**20:.0f} MiB > 1.05x eager {eager / 2**20:.0f}"
    assert ours < full, f"graphed checkpointed peak {ours / 2**20:.0f} MiB not below graphs alone {full / 2**20:.0f}"


if __name__ == "__main__":
    _memory_worker(sys.argv[1])
