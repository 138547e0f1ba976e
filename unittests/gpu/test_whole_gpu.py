"""Whole-model, whole-stage and whole-step graphs on one GPU.

Unmodified Hugging Face Llama and GPT-2 built from small configs (no download), fp32 with TF32
off, dropout on, 4 micro-batches of gradient accumulation per step, AdamW:

* ``graph_model`` equals the eager model and ``graph_layers`` (per-block graphs): losses, logits
  and final weights, bit for bit where eager equals itself (two eager runs are compared first:
  the embedding's backward may add in any order); the whole model is one forward and one
  backward launch per micro-batch.
* ``graph_step`` over the eager model and over ``graph_model``: one launch per step, equal to
  the eager steps; the graphed layers inside keep no graphs of their own.
* Two ``causal_lm_stage(scope="stage")`` stages in one process under a 1F1B order equal the
  eager stages.
* A host read inside the scope raises a ``CaptureError`` naming what read, and training goes
  on (eagerly), equal to eager.

Run on the GPU machine: ``python -m pytest unittests/gpu/test_whole_gpu.py -q``.
"""
import copy
import types

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires a CUDA device")
transformers = pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

import paddle_graphpp  # noqa: E402
from paddle_graphpp.torch import causal_lm_stage, graph_layers, graph_model, graph_step  # noqa: E402

DEV = "cuda"
VOCAB, SEQ, MBS, HIDDEN, MICRO = 256, 32, 2, 64, 4
STEPS = 5


@pytest.fixture(autouse=True)
def _fp32_exact(fp32_exact):  # unittests/gpu/conftest.py
    yield


def build(kind):
    torch.manual_seed(0)
    if kind == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1, use_cache=False)
        return LlamaForCausalLM(config).to(DEV)
    config = GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=3, n_head=4, n_positions=SEQ, use_cache=False,
                        tie_word_embeddings=True)  # resid/embd/attn dropout 0.1
    return GPT2LMHeadModel(config).to(DEV)


def data(steps=STEPS):
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, VOCAB, (MBS, SEQ), generator=g).to(DEV) for _ in range(MICRO)] for _ in range(steps)]


def capturable_adamw(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    for group in opt.param_groups:  # as graph_step prepares its optimizers: the same arithmetic
        group["lr"] = torch.tensor(1e-3, device=DEV)
    return opt


def step_fn(model, opt):
    def train_step(batches):
        losses = []
        for tokens in batches:
            out = model(tokens, labels=tokens)
            (out.loss / len(batches)).backward()
            losses.append(out.loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return torch.stack(losses)
    return train_step


def train(model, steps, *, whole_step=False, seed=7):
    opt = capturable_adamw(model)
    fn = step_fn(model, opt)
    run = graph_step(fn, optimizers=opt) if whole_step else fn
    losses = []
    torch.manual_seed(seed)
    for batches in steps:
        losses.append(run(batches).clone())
    torch.cuda.synchronize()
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], run


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_whole_model_equals_eager_and_per_block_graphs(kind):
    base = build(kind)
    steps = data()
    ref_losses, ref_params, spread = eager_spread(base, steps)

    blocks = copy.deepcopy(base)
    graph_layers(blocks.model.layers if kind == "llama" else blocks.transformer.h)
    block_losses, block_params, _ = train(blocks, steps)

    whole = graph_model(copy.deepcopy(base))
    whole_losses, whole_params, _ = train(whole, steps)
    engine = whole._graphpp_whole.graphed._engine
    # forward then backward per micro-batch: one position; the first step warms up and records, its
    # (forward, backward) pair is captured as the second starts and replays for every later micro-batch
    assert (engine.captures, engine.replays) == (2, 2 * MICRO * (STEPS - 1)), (engine.captures, engine.replays)
    for what, losses, params in (("whole", whole_losses, whole_params), ("blocks", block_losses, block_params)):
        loss_diff, param_diff = (losses - ref_losses).abs().max().item(), max_diff(params, ref_params)
        assert loss_diff <= spread and param_diff <= spread, (what, loss_diff, param_diff, spread)
    assert (whole_losses - block_losses).abs().max().item() <= spread


def test_whole_model_keeps_the_causal_attention_kernel_and_never_reads_the_host():
    model = graph_model(build("llama"))
    opt = capturable_adamw(model)
    fn = step_fn(model, opt)
    steps = data(6)
    for batches in steps[:4]:  # warmup, record, capture
        fn(batches)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batches in steps[4:]:  # replays: a host read anywhere in the step would raise here
            fn(batches)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    engine = model._graphpp_whole.graphed._engine
    assert (engine.captures, engine.replays) == (2, 2 * MICRO * (len(steps) - 1)), (engine.captures, engine.replays)
    masks = model._graphpp_whole.stage.masks(steps[0][0])
    assert masks[0][1] is None  # sdpa masks causally itself: no materialised mask


def eager_spread(base, steps):
    """The reference run, and how far a second eager run lands from it (the embedding's backward
    may add in another order)."""
    ref_losses, ref_params, _ = train(copy.deepcopy(base), steps)
    again_losses, again_params, _ = train(copy.deepcopy(base), steps)
    return ref_losses, ref_params, spread_of((ref_losses, ref_params), (again_losses, again_params))


def spread_of(ref, again):
    """How far two eager runs' (losses, parameters) land from each other: the tolerance."""
    return max(max_diff(again[1], ref[1]), (again[0] - ref[0]).abs().max().item())


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_whole_step_over_graph_model_equals_eager_steps(kind):
    base = build(kind)
    steps = data()
    ref_losses, ref_params, spread = eager_spread(base, steps)
    model = graph_model(copy.deepcopy(base))
    losses, params, step = train(model, steps, whole_step=True)
    assert step.captures == 1 and step.replays == STEPS - step.num_warmup_steps
    assert (losses - ref_losses).abs().max().item() <= spread
    assert max_diff(params, ref_params) <= spread
    assert model._graphpp_whole.graphed._engine.captures == 0  # inlined: the model's engine kept no graphs


class TinyLM(torch.nn.Module):
    """Not a transformers model: embedding, dropout, MLP, head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(2 * HIDDEN, HIDDEN))
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens, labels):
        h = self.embed(tokens)
        logits = self.head(h + self.mlp(h))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return types.SimpleNamespace(loss=loss)


def test_whole_step_over_a_plain_module_equals_eager_steps():
    torch.manual_seed(0)
    base = TinyLM().to(DEV)
    steps = data()
    ref_losses, ref_params, spread = eager_spread(base, steps)
    losses, params, step = train(copy.deepcopy(base), steps, whole_step=True)
    assert step.captures == 1 and step.replays == STEPS - step.num_warmup_steps
    assert (losses - ref_losses).abs().max().item() <= spread
    assert max_diff(params, ref_params) <= spread


def test_transformers_masks_inside_a_whole_step_are_refused_and_training_goes_on():
    base = build("llama")
    steps = data()
    ref_losses, ref_params, spread = eager_spread(base, steps)
    model = copy.deepcopy(base)  # not graph_model(): its own mask code runs inside the capture
    opt = capturable_adamw(model)
    step = graph_step(step_fn(model, opt), optimizers=opt)
    torch.manual_seed(7)
    losses = []
    for i, batches in enumerate(steps):
        if i == step.num_warmup_steps:  # the capture
            with pytest.raises(paddle_graphpp.CaptureError, match=r"attention mask.*graph_model"):
                step(batches)
        losses.append(step(batches).clone())
    assert step.captures == 0
    assert (torch.stack(losses) - ref_losses).abs().max().item() <= spread
    assert max_diff([p.detach() for p in model.parameters()], ref_params) <= spread


def test_whole_stages_under_1f1b_equal_eager_stages():
    def stages(graphed):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1, use_cache=False)
        model = LlamaForCausalLM(config).to(DEV)
        return [causal_lm_stage(model, i, 2, graph=graphed, scope="stage") for i in range(2)]

    def run(pair):
        opt = torch.optim.AdamW([p for s in pair for p in s.parameters()], lr=1e-3)
        torch.manual_seed(3)
        losses = []
        for batches in data():
            sent, outs = {}, {}
            order = ["f0", "f1", "b0", "f2", "b1", "f3", "b2", "b3"]  # 1F1B on the last stage
            for tok in order:
                n = int(tok[1:])
                if tok[0] == "f":
                    h = pair[0](batches[n])
                    recv = h.detach().requires_grad_()
                    logits = pair[1](recv)
                    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batches[n][:, 1:].flatten())
                    sent[n], outs[n] = (h, recv), loss
                else:
                    (outs[n] / MICRO).backward()
                    h, recv = sent.pop(n)
                    h.backward(recv.grad)
                    losses.append(outs[n].detach().clone())
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        return torch.stack(losses), [p.detach().clone() for s in pair for p in s.parameters()]

    ref_losses, ref_params = run(stages(False))
    spread = spread_of((ref_losses, ref_params), run(stages(False)))
    graphed = stages(True)
    losses, params = run(graphed)
    # 1F1B keeps up to two micro-batches in flight: a position per micro-batch of the step, each
    # (forward, backward) captured in the third step (warmup, record, capture) and replayed from there
    counts = [(s._whole._engine.captures, s._whole._engine.replays) for s in graphed]
    assert counts == [(2 * MICRO, 2 * MICRO * (len(data()) - 2))] * 2, counts
    assert (losses - ref_losses).abs().max().item() <= spread
    assert max_diff(params, ref_params) <= spread


def test_a_host_read_in_the_step_raises_naming_it_and_training_goes_on():
    base = build("llama")
    steps = data()
    ref_losses, ref_params, spread = eager_spread(base, steps)
    model = graph_model(copy.deepcopy(base))
    opt = capturable_adamw(model)
    inner = step_fn(model, opt)
    seen = []

    def logging_step(batches):
        losses = inner(batches)
        seen.append(losses.sum().item())  # a host read: cannot be captured
        return losses

    step = graph_step(logging_step, optimizers=opt)
    torch.manual_seed(7)
    losses = []
    for i, batches in enumerate(steps):
        if i == step.num_warmup_steps:  # the capture
            with pytest.raises(paddle_graphpp.CaptureError, match=r"item\(\)"):
                step(batches)
        losses.append(step(batches).clone())  # eager from the failed capture on
    torch.cuda.synchronize()
    assert step.captures == 0 and step.eager_reason(steps[0]) is not None
    # the failed capture ran nothing: the step after it is the step the eager run took
    assert (torch.stack(losses) - ref_losses).abs().max().item() <= spread
    assert max_diff([p.detach() for p in model.parameters()], ref_params) <= spread


def test_a_host_read_in_the_model_with_eager_fallback_keeps_training_right():
    base = build("llama")
    steps = data()
    ref_losses, ref_params, spread = eager_spread(base, steps)
    model = copy.deepcopy(base)
    norm = model.model.norm
    original = norm.forward

    def reading_norm(hidden):
        if hidden.abs().sum() < 0:  # a Python branch on a device value
            hidden = hidden * 0
        return original(hidden)

    norm.forward = reading_norm
    graph_model(model, fallback="eager")
    with pytest.warns(RuntimeWarning, match="capturing"):
        losses, params, _ = train(model, steps)
    assert (losses - ref_losses).abs().max().item() <= spread
    assert max_diff(params, ref_params) <= spread
