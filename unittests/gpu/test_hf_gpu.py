"""Unmodified Hugging Face causal LMs with graphed blocks on GPUs: in place, and split into stages.

GPT-2 and Llama built from small configs (no download), fp32 with TF32 off, dropout on
(attention, residual and embedding dropout where the model has them).

* One GPU: ``graph_layers`` on a copy of the model; 6 steps of 4 micro-batches in a 1F1B-like
  order, then AdamW, side by side with the eager model from the same seeds. Losses, logits,
  parameter gradients and the final weights must match eager to 1e-6 (relative), as the
  engine's own parity check (``testing/parity.py``) requires; the graphs must have been
  captured once per micro-batch position and replayed in every step after the capture.
  Both attention implementations: ``sdpa`` (the default; its dropout runs inside the fused
  kernel) and ``eager``.
* Two GPUs: ``causal_lm_stage`` on each rank, ``Schedule1F1B`` (and Llama also
  ``ScheduleInterleaved1F1B``, two stages per rank) over NCCL, eager stages then graphed stages
  from the same seeds (``unittests/workers/hf_pipeline_worker.py``); losses and
  gradients as eager's, graphs replayed.

Run on the GPU machine: ``python -m pytest unittests/gpu/test_hf_gpu.py -q``. Skipped without
CUDA (the two-GPU cases without two GPUs) or without transformers.
"""
import copy
import json
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires a CUDA device")
transformers = pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from paddle_graphpp.torch import graph_layers  # noqa: E402
from testing import launch  # noqa: E402
from testing.parity import rel  # noqa: E402

DEV = "cuda"
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(os.path.dirname(HERE), "workers", "hf_pipeline_worker.py")
VOCAB, SEQ, MBS, HIDDEN = 512, 64, 2, 128
ORDER = "f1 f2 f3 b1 f4 b2 b3 b4"
STEPS = 6
TOLERANCE = 1e-6


@pytest.fixture(autouse=True)
def _fp32_exact(fp32_exact):  # unittests/gpu/conftest.py
    yield


def build(kind, attn):
    torch.manual_seed(0)
    if kind == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1, use_cache=False,
                             attn_implementation=attn)
        return LlamaForCausalLM(config).to(DEV), lambda m: m.model.layers
    config = GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=4, n_head=4, n_positions=SEQ, use_cache=False,
                        attn_implementation=attn)  # resid/embd/attn dropout 0.1 (GPT-2's defaults)
    return GPT2LMHeadModel(config).to(DEV), lambda m: m.transformer.h


def run_step(model, batches, seed):
    """``ORDER`` over the micro-batches: losses (backward order) and each micro-batch's logits."""
    torch.manual_seed(seed)
    outs, losses, logits = {}, [], {}
    for tok in ORDER.split():
        n = int(tok[1:]) - 1
        if tok[0] == "f":
            outs[n] = model(batches[n], labels=batches[n])  # the model shifts the labels
            logits[n] = outs[n].logits.detach().clone()  # outputs alias graph memory until the next step
        else:
            outs[n].loss.backward()
            losses.append(outs[n].loss.detach().clone())
    return torch.stack(losses), logits


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_graph_layers_in_place_trains_like_eager(kind, attn):
    eager, blocks_of = build(kind, attn)
    graphed = copy.deepcopy(eager)
    blocks = graph_layers(blocks_of(graphed), num_warmup_steps=1)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_g = torch.optim.AdamW(graphed.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        batches = [torch.randint(0, VOCAB, (MBS, SEQ), generator=data).to(DEV) for _ in range(4)]
        le, oe = run_step(eager, batches, seed=1000 + step)
        lg, og = run_step(graphed, batches, seed=1000 + step)
        errs = {"loss": rel(lg, le)}
        errs.update({f"logits{n}": rel(og[n], oe[n]) for n in range(4)})
        errs.update({name: rel(q.grad, p.grad) for (name, p), q in zip(eager.named_parameters(), graphed.parameters())})
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOLERANCE, f"step {step}: {worst} relative error {errs[worst]:.3e}"
        opt_e.step(), opt_g.step()
        opt_e.zero_grad(), opt_g.zero_grad()
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        assert rel(q, p) <= TOLERANCE, name
    # num_warmup_steps=1: step 0 warms up, step 1 records, steps 2.. replay; 4 positions x (fwd, bwd).
    for block in blocks:
        assert block.engine.captures == 8, block
        assert block.engine.replays == 8 * (STEPS - 2), block
        assert block.engine.in_flight == 0


def test_graphed_outputs_feed_hidden_state_recording():
    """``output_hidden_states=True`` (hooks on the blocks themselves, outside the graphs) gets the
    replayed outputs, equal to eager's."""
    eager, blocks_of = build("llama", "sdpa")
    eager.eval()
    graphed = copy.deepcopy(eager)
    graph_layers(blocks_of(graphed), num_warmup_steps=1)
    x = torch.randint(0, VOCAB, (MBS, SEQ), device=DEV)
    for _ in range(4):
        want = eager(x, output_hidden_states=True)
        got = graphed(x, output_hidden_states=True)
        assert len(got.hidden_states) == len(want.hidden_states) == 5
        for a, b in zip(got.hidden_states, want.hidden_states):
            assert rel(a, b) <= TOLERANCE
        got.logits.sum().backward()
        want.logits.sum().backward()
    counts = [(b.engine.captures, b.engine.replays) for b in blocks_of(graphed)]
    assert counts == [(2, 2 * 2)] * 4, counts  # one position: warmup, record, then two replays


@pytest.mark.two_gpus
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,vpp", [("gpt2", 1), ("llama", 2)],
                         ids=["gpt2-Schedule1F1B", "llama-ScheduleInterleaved1F1B"])
def test_stages_over_two_gpus_train_like_eager(kind, vpp, tmp_path):
    envs = launch.rank_envs(2, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
                            NCCL_NVLS_ENABLE="0")
    cmd = [sys.executable, WORKER, "--model", kind, "--vpp", str(vpp), "--device", "cuda", "--hidden", str(HIDDEN),
           "--steps", str(STEPS), "--out", str(tmp_path)]
    ends = launch.run_ranks([cmd] * 2, envs=envs, timeout=240, merge_stderr=True)
    codes = [None if e.stopped else e.returncode for e in ends]
    assert codes == [0, 0], f"ranks failed or hung (codes {codes}):\n{''.join(e.stdout for e in ends)[-6000:]}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    eager, graphed = results[1]["eager"]["losses"], results[1]["graphed"]["losses"]
    assert len(graphed) == len(eager) == STEPS
    for a, b in zip(graphed, eager):
        assert abs(a - b) <= TOLERANCE * max(1.0, abs(b)), (graphed, eager)
    for r in results:
        assert r["grads_compared"] > 0 and r["grad_max_rel"] <= 1e-5, r["grad_mismatches"][:5]
        engines = r["graphed"]["engines"]
        assert len(engines) == 2  # 4 blocks over 2 ranks
        for e in engines:
            assert e["captures"] > 0 and e["replays"] > 0 and e["in_flight"] == 0, e
