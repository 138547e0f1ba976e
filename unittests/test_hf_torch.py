"""Unmodified Hugging Face causal LMs with graphed blocks, on CPU (PyTorch runtime).

``graph_layers`` graphs GPT-2's and Llama's decoder blocks in place; ``causal_lm_stage`` cuts
the models into pipeline stages. Without CUDA the graphed blocks run eagerly through the
engine's FIFO bookkeeping, so these tests check what CPU can show: names, state_dict keys and
the optimizer's parameters unchanged, the ``use_cache`` errors, the stages computing what the
full model computes, and losses and gradients equal to eager's under a pipeline-like order.
Capture and replay are checked on GPUs (``unittests/gpu/test_hf_gpu.py``).
"""
import copy
import json
import os
import pickle
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from paddle_graphpp import EngineOptions, StateReplacedError  # noqa: E402
from paddle_graphpp.core.records import Phase  # noqa: E402
from paddle_graphpp.torch import CUDAGraphedModule, graph_layers, ungraph_layers  # noqa: E402
from paddle_graphpp.torch.hf import CausalLMStage, causal_lm_stage  # noqa: E402
from paddle_graphpp.torch.layers import _GivenParameter, _OwnParameter, is_graphed_layer  # noqa: E402
from testing import launch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "workers", "hf_pipeline_worker.py")
VOCAB, SEQ = 64, 8
ORDER = "f1 f2 f3 b1 f4 b2 b3 b4"  # a 1F1B-like order: backwards pair with forwards in FIFO order


@pytest.fixture(autouse=True)
def _quiet_cpu_fallback():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA graphs are not used.*")
        yield


def build(kind, *, use_cache=False, tie=False, layers=4, dropout=0.1):
    """A small model from a config (no download), the same weights for the same seed."""
    torch.manual_seed(0)
    if kind == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             attention_dropout=dropout, use_cache=use_cache, tie_word_embeddings=tie)
        return LlamaForCausalLM(config)
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=64, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, use_cache=use_cache, tie_word_embeddings=tie)
    return GPT2LMHeadModel(config)


def blocks_of(model):
    return model.model.layers if hasattr(model, "model") else model.transformer.h


KINDS = pytest.mark.parametrize("kind", ["gpt2", "llama"])


# ----------------------------------------------------------------------------- in place
@KINDS
def test_graph_layers_keeps_names_state_dict_and_optimizer_parameters(kind):
    model = build(kind)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    keys = list(model.state_dict())
    modules = [n for n, _ in model.named_modules()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built before graphing
    original = [type(b) for b in blocks_of(model)]
    out = graph_layers(blocks_of(model))

    assert [n for n, _ in model.named_parameters()] == names
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_modules()] == modules  # the CUDAGraphedModule adds no submodule
    assert [p for group in opt.param_groups for p in group["params"]] == params
    for block, cls, returned in zip(blocks_of(model), original, out):
        assert returned is block and is_graphed_layer(block)
        assert isinstance(block, cls) and type(block).__name__ == f"Graphed{cls.__name__}"
        assert isinstance(block.graphed, CUDAGraphedModule)
        assert {id(p) for p in block.graphed.parameters()} == {id(p) for p in block.parameters()}
    assert "cuda_graphs=True" in repr(blocks_of(model)[0])


@KINDS
def test_use_cache_in_the_config_is_refused_naming_the_layer(kind):
    model = build(kind, use_cache=True)
    with pytest.raises(ValueError, match=r"\[0\].*use_cache=True.*model\.config\.use_cache = False"):
        graph_layers(blocks_of(model))
    assert not any(is_graphed_layer(b) for b in blocks_of(model))  # nothing half-graphed
    with pytest.raises(ValueError, match=r"^model\.layers\.0: "):
        graph_layers(blocks_of(model), name="model.layers")
    model.config.use_cache = False
    graph_layers(blocks_of(model))
    assert all(is_graphed_layer(b) for b in blocks_of(model))


@KINDS
def test_cache_and_attention_outputs_at_forward_are_refused_with_the_fix(kind):
    model = build(kind)
    graph_layers(blocks_of(model), name="blocks")
    x = torch.randint(0, VOCAB, (2, SEQ))
    with pytest.raises(ValueError, match=r"blocks\.0: use_cache=True.*use_cache=False"):
        model(x, use_cache=True)
    with pytest.raises(ValueError, match=r"blocks\.0: .*cache object \(DynamicCache"):
        model(x, past_key_values=DynamicCache(config=model.config))
    with pytest.raises(ValueError, match=r"blocks\.0: output_attentions=True.*output_attentions=False"):
        model(x, output_attentions=True)
    assert all(b.engine.in_flight == 0 for b in blocks_of(model))  # refused before the engine


@KINDS
def test_without_grad_the_cache_works_eagerly(kind):
    model = build(kind).eval()
    ref = copy.deepcopy(model)
    graph_layers(blocks_of(model))
    x = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        got = model(x, use_cache=True)
        want = ref(x, use_cache=True)
        assert torch.equal(got.logits, want.logits)
        assert got.past_key_values.get_seq_length() == SEQ
        nxt = torch.randint(0, VOCAB, (2, 1))
        assert torch.equal(model(nxt, past_key_values=got.past_key_values).logits,
                           ref(nxt, past_key_values=want.past_key_values).logits)


@KINDS
def test_hidden_state_recording_sees_the_graphed_blocks(kind):
    # transformers records hidden states with forward hooks on the block class; a graphed block is
    # still an instance of it, and its hooks run outside the graphs.
    model = build(kind, dropout=0.0)
    ref = copy.deepcopy(model)
    graph_layers(blocks_of(model), num_warmup_steps=1)
    x = torch.randint(0, VOCAB, (2, SEQ))
    for _ in range(3):
        got, want = model(x, output_hidden_states=True), ref(x, output_hidden_states=True)
        assert len(got.hidden_states) == len(want.hidden_states) == 5
        for a, b in zip(got.hidden_states, want.hidden_states):
            assert torch.equal(a, b)
        got.logits.sum().backward()


class LegacyBlock(torch.nn.Module):
    """A decoder block in transformers 4.x style: cache arguments by position, a tuple output."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, hidden_states, layer_past=None, attention_mask=None, use_cache=False, output_attentions=False):
        out = torch.tanh(self.proj(hidden_states))
        if attention_mask is not None:
            out = out * attention_mask
        return (out, None) if not output_attentions else (out, None, out.mean())


def test_positional_cache_arguments_and_tuple_outputs():
    blocks = torch.nn.ModuleList([LegacyBlock(), LegacyBlock()])
    ref = copy.deepcopy(blocks)
    graph_layers(blocks, num_warmup_steps=1, name="h")
    x, mask = torch.randn(2, 3, 8), torch.rand(2, 3, 8)
    with pytest.raises(ValueError, match=r"h\.0: a cache object \(tuple, argument layer_past\)"):
        blocks[0](x, (x, x))
    with pytest.raises(ValueError, match=r"h\.0: use_cache=True"):
        blocks[0](x, None, mask, True)
    with pytest.raises(ValueError, match=r"h\.0: output_attentions=True"):
        blocks[0](x, None, mask, False, True)
    for _ in range(3):
        h, g = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        for block, plain in zip(blocks, ref):
            out, want = block(h, None, mask), plain(g, None, mask)
            assert isinstance(out, tuple) and out[1] is None and torch.equal(out[0], want[0])
            h, g = out[0], want[0]
        h.sum().backward()
        g.sum().backward()
    for p, q in zip(blocks.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


class TiedHead(torch.nn.Module):
    """An output layer that can be handed its weight, as Megatron-Core's is (``weight=``, tied)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(VOCAB, 8) * 0.1)
        self.bias = torch.nn.Parameter(torch.zeros(VOCAB))

    def forward(self, hidden, weight=None):
        return hidden @ (self.weight if weight is None else weight).t() + self.bias, None


def tied_head_steps(head, steps, *, given):
    """Losses of ``steps`` steps of 2 micro-batches, the head given ``given`` as its weight; the
    gradients are left in ``head``."""
    data = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        head.zero_grad(set_to_none=True)
        for _ in range(2):
            x = torch.randn(2, SEQ, 8, generator=data)
            logits, _ = head(x, weight=given(head))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.zeros(2 * SEQ, dtype=torch.long))
            loss.backward()
            losses.append(loss.detach())
    return torch.stack(losses)


def test_a_blocks_own_weight_given_as_an_argument_trains_like_eager():
    head, ref = TiedHead(), TiedHead()
    ref.load_state_dict(head.state_dict())
    graph_layers([head], num_warmup_steps=1, name="output_layer")
    got = tied_head_steps(head, 3, given=lambda h: h.weight)
    want = tied_head_steps(ref, 3, given=lambda h: h.weight)
    assert torch.equal(got, want)
    assert torch.equal(head.weight.grad, ref.weight.grad) and torch.equal(head.bias.grad, ref.bias.grad)


class TiedLM(torch.nn.Module):
    """Megatron-Core's GPT on one stage (no pipeline): the output layer is handed the embedding's
    weight as ``weight=``, a parameter that is not the head's own."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = TiedHead()

    def forward(self, tokens):
        logits, _ = self.head(torch.tanh(self.body(self.embedding(tokens))), weight=self.embedding.weight)
        return logits


def tied_lm_steps(model, steps):
    data = torch.Generator().manual_seed(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        for _ in range(2):
            tokens = torch.randint(0, VOCAB, (2, SEQ), generator=data)
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            losses.append(loss.detach())
        opt.step()
    return torch.stack(losses)


def test_another_modules_weight_given_as_an_argument_trains_like_eager():
    # The embedding's weight given to a graphed head (Megatron at pp=1): read in place, its
    # gradient is the head's part added to the embedding's own, as eager's.
    torch.manual_seed(0)
    model = TiedLM()
    ref = copy.deepcopy(model)
    graph_layers([model.head], num_warmup_steps=1, name="output_layer")
    got = tied_lm_steps(model, 3)
    want = tied_lm_steps(ref, 3)
    assert torch.equal(got, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
        assert (p.grad is None and q.grad is None) if name == "head.weight" else torch.equal(p.grad, q.grad), name
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert "given" not in str(model.state_dict().keys())


def test_a_block_given_two_activations_that_carry_gradients_is_refused_before_it_runs():
    """Their gradients would leave the graphed block from one node, where eagerly they leave from
    many: summed in another order upstream (last-bit differences, as Inkling2's block states showed)."""
    from paddle_graphpp.core.errors import SignatureError

    class TwoInputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, hidden, states):
            return self.lin(hidden) + states

    blocks = torch.nn.ModuleList([TwoInputs(), TwoInputs()])
    graph_layers(blocks, name="two")
    x = torch.randn(2, 4, requires_grad=True)
    hidden = x * 2
    with pytest.raises(SignatureError, match=r"two\.0: .*passes 2 \(argument 0, argument 1\).*graph_model"):
        blocks[0](hidden, hidden * 3)
    blocks[0](hidden, (hidden * 3).detach()).sum().backward()  # one gradient path: graphed as before
    assert x.grad is not None


def test_the_parameter_test_for_block_arguments_agrees_with_isinstance():
    from torch import nn

    from paddle_graphpp.torch.layers import _is_parameter

    class MyParameter(nn.Parameter):
        pass

    class MyTensor(torch.Tensor):
        pass

    tensor = torch.ones(2)
    cases = [tensor, nn.Parameter(tensor.clone()), MyParameter(tensor.clone()), tensor.as_subclass(MyTensor),
             nn.Parameter(tensor.as_subclass(MyTensor)), None, 3, (tensor,), "use_cache"]
    assert [_is_parameter(x) for x in cases] == [isinstance(x, nn.Parameter) for x in cases]
    assert [_is_parameter(x) for x in cases] == [False, True, True, False, True, False, False, False, False]


def test_a_blocks_own_weight_given_as_an_argument_is_no_graph_input(fake_runtime):
    # Read in place like the block's other parameters: the graphs take only the hidden state as
    # an input (no weight-sized input buffer, no gradient handed out for it).
    head = TiedHead()
    graph_layers([head], num_warmup_steps=1, name="output_layer")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no eager fallback
        tied_head_steps(head, 4, given=lambda h: h.weight)
    assert head.engine.captures == 2 and head.engine.replays > 0
    (sig,) = head.engine.signatures().values()
    specs, consts = sig.key[:2]
    assert [s.shape for s in specs] == [(2, SEQ, 8)]
    assert ("_OwnParameter", _OwnParameter("weight")) in consts, consts  # the weight by name, a constant


def test_another_modules_weight_given_as_an_argument_is_no_graph_input(fake_runtime):
    # Read in place like the head's own: the graphs take only the hidden state as an input, and
    # the embedding's weight is among the parameters the engine captured against (its storage
    # watched; its gradient handed to autograd).
    model = TiedLM()
    graph_layers([model.head], num_warmup_steps=1, name="output_layer")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no eager fallback, no copy
        tied_lm_steps(model, 4)
    assert model.head.engine.captures == 2 and model.head.engine.replays > 0
    (sig,) = model.head.engine.signatures().values()
    specs, consts = sig.key[:2]
    assert [s.shape for s in specs] == [(2, SEQ, 8)]
    assert ("_GivenParameter", _GivenParameter("given_0")) in consts, consts
    with torch.no_grad():
        model.embedding.weight.data = model.embedding.weight.detach().clone()  # new storage
    with pytest.raises(StateReplacedError, match=r"output_layer\.0: parameter 'given_0' was given new storage"):
        tied_lm_steps(model, 1)


def test_the_given_weights_gradient_is_summed_as_eagerly_when_recorded(fake_runtime):
    # A recorded call runs the code the graphs will replay, with the gradients added as the
    # graphs will add them. Eagerly autograd sums the head's part and the embedding's before adding
    # them to .grad (G + (h + e)); graphs adding theirs into .grad in place would give (G + h) + e
    # from the second micro-batch on. The head leaves that weight's accumulation to autograd.
    torch.manual_seed(0)
    model = TiedLM()
    ref = copy.deepcopy(model)
    graph_layers([model.head], num_warmup_steps=1, name="output_layer")
    # One step of two micro-batches, each its own episode here (a forward, then its backward):
    # the first warms up, the second is recorded (real values, the gradients added as the graphs
    # will add them, onto the first's), to be captured when the next one starts.
    got, want = tied_lm_steps(model, 1), tied_lm_steps(ref, 1)
    assert model.head.engine.phase() is Phase.RECORD and model.head.engine.replays == 0
    assert torch.equal(got, want)
    assert torch.equal(model.embedding.weight.grad, ref.embedding.weight.grad)
    assert torch.equal(model.embedding.weight, ref.embedding.weight)
    (view,) = model.head.engine.signatures().values()
    assert not view.accumulate and not model.head.engine.accumulates_in_graphs(model.embedding.weight)


def test_a_weight_tied_between_graphed_blocks_is_summed_as_eagerly_when_recorded(fake_runtime):
    # Blocks sharing a weight (Universal-Transformer-style tied layers): eagerly a backward sums
    # the blocks' parts before adding them to .grad. Every block leaves that weight to autograd,
    # so the recorded step (the graphs' code, run for real) matches eager bit for bit.
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            return torch.tanh(self.lin(x)) + x

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block() for _ in range(3)])
            for block in self.layers[1:]:
                block.lin = self.layers[0].lin
            self.out = torch.nn.Linear(16, 4)

        def forward(self, x):
            for block in self.layers:
                x = block(x)
            return self.out(x)

    torch.manual_seed(0)
    model = Tied()
    ref = copy.deepcopy(model)
    graph_layers(model.layers, num_warmup_steps=1)
    for step in range(2):  # warmup, then the recorded step
        xs = [torch.randn(4, 16) for _ in range(4)]
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            pending = {}
            for op in "f0 f1 b0 f2 b1 f3 b2 b3".split():
                i = int(op[1:])
                if op[0] == "f":
                    pending[i] = m(xs[i]).square().mean()
                else:
                    pending.pop(i).backward()
        assert torch.equal(model.layers[0].lin.weight.grad, ref.layers[0].lin.weight.grad), step
    assert model.layers[0].engine.phase() is Phase.RECORD
    assert not any(view.accumulate for block in model.layers for view in block.engine.signatures().values())


def test_a_weight_first_given_after_the_graphs_are_fixed_is_refused_until_they_are_reset(fake_runtime):
    # The graphs hold gradient buffers for the parameters they were fixed on; a new one would
    # need others. Refused before anything runs; after reset_graphs it is taken and watched.
    from paddle_graphpp import reset_graphs
    from paddle_graphpp.core.errors import SignatureError

    head = TiedHead()
    graph_layers([head], num_warmup_steps=1, name="output_layer")
    first, second = (torch.nn.Parameter(torch.randn(VOCAB, 8)) for _ in range(2))
    tied_head_steps(head, 3, given=lambda h: first)
    with pytest.raises(SignatureError, match=r"output_layer\.0: a parameter that is not this block's own "
                                             r"\(shape \(64, 8\)\) is passed to it as an argument for the first "
                                             r"time after its graphs were fixed"):
        tied_head_steps(head, 1, given=lambda h: second)
    assert head.engine.in_flight == 0
    with torch.no_grad():  # an inference call is not refused: it runs the forward as it is
        x = torch.randn(2, SEQ, 8)
        logits, _ = head(x, weight=second)
        assert torch.equal(logits, x @ second.t() + head.bias)
    assert head.graphed.module.given(second) is None  # nor registered
    reset_graphs(head)
    tied_head_steps(head, 3, given=lambda h: second)
    assert head.engine.captures == 2 + 2 and head.engine.replays > 0  # captured anew
    with torch.no_grad():
        second.data = second.detach().clone()
    with pytest.raises(StateReplacedError, match=r"parameter 'given_1' was given new storage"):
        tied_head_steps(head, 1, given=lambda h: second)


def test_bad_arguments_name_the_fix():
    model = build("llama")
    with pytest.raises(TypeError, match="single LlamaDecoderLayer.*pass \\[module\\]"):
        graph_layers(model.model.layers[0])
    with pytest.raises(TypeError, match="not an nn.Module"):
        graph_layers([model.model.layers[0], 3])
    with pytest.raises(ValueError, match="no layers"):
        graph_layers([])
    with pytest.raises(ValueError, match="appears twice"):
        graph_layers([model.model.layers[0], model.model.layers[0]])
    with pytest.raises(ValueError, match="fallback"):
        graph_layers(model.model.layers, fallback="sometimes")
    assert not any(is_graphed_layer(b) for b in model.model.layers)
    with pytest.raises(ValueError, match="recompute must be a bool"):
        graph_layers(model.model.layers, recompute="yes")
    graph_layers(model.model.layers)
    with pytest.raises(TypeError, match="already graphed"):
        graph_layers(model.model.layers)
    with pytest.raises(TypeError, match="cannot be pickled or deep-copied"):
        copy.deepcopy(model)


def test_checkpoints_load_and_ungraph_restores_the_classes():
    model, other = build("gpt2"), build("gpt2")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    graph_layers(blocks_of(model))
    params = list(model.parameters())
    model.load_state_dict(other.state_dict())  # copies in place: the graphs' addresses stay valid
    assert all(a is b for a, b in zip(model.parameters(), params))
    for (n, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), n
    with pytest.raises(TypeError, match="cannot be pickled or deep-copied.*state_dict"):
        pickle.dumps(model)
    ungraph_layers(blocks_of(model))
    assert not any(is_graphed_layer(b) for b in blocks_of(model))
    assert type(blocks_of(model)[0]).__name__ == "GPT2Block"
    assert pickle.loads(pickle.dumps(model)) is not None


def run_order(model, batches, order, seed):
    """Forwards and backwards of micro-batches in ``order``; losses in backward order."""
    torch.manual_seed(seed)
    outs, losses = {}, []
    for tok in order.split():
        n = int(tok[1:]) - 1
        if tok[0] == "f":
            outs[n] = model(batches[n], labels=batches[n])  # the model shifts the labels
        else:
            outs[n].loss.backward()
            losses.append(outs[n].loss.detach())
    return torch.stack(losses)


@KINDS
def test_losses_and_gradients_equal_eager_over_steps_and_micro_batches(kind):
    eager = build(kind)
    graphed = copy.deepcopy(eager)
    graph_layers(blocks_of(graphed), num_warmup_steps=1)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_g = torch.optim.AdamW(graphed.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    for step in range(4):
        batches = [torch.randint(0, VOCAB, (2, SEQ), generator=data) for _ in range(4)]
        le = run_order(eager, batches, ORDER, seed=100 + step)
        lg = run_order(graphed, batches, ORDER, seed=100 + step)
        assert torch.equal(lg, le), step
        for (n, p), q in zip(eager.named_parameters(), graphed.parameters()):
            assert torch.equal(q.grad, p.grad), (step, n)
        opt_e.step(), opt_g.step()
        opt_e.zero_grad(), opt_g.zero_grad()
    for p, q in zip(eager.parameters(), graphed.parameters()):
        assert torch.equal(p, q)
    assert all(b.engine.in_flight == 0 for b in blocks_of(graphed))


@pytest.fixture
def fake_runtime():
    """CUDAGraphedModules built while it is active use the fake graph runtime: capture runs the
    code eagerly and replay only counts (values after a replay are stale), so the engine's
    graph path (record, capture, replay, links between chained blocks) runs on CPU."""
    from fake_runtime import FakeGraphRuntime, serving

    from paddle_graphpp.core.process import current_process

    rt = FakeGraphRuntime()
    current_process().reset(rt.name)
    with serving(rt):
        yield rt
    current_process().reset(rt.name)


@KINDS
@pytest.mark.parametrize("staged", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["in_place", "stages"])
def test_blocks_record_capture_and_replay_with_hugging_face_arguments(kind, staged, fake_runtime):
    # The graph path with the models' own calling conventions (keyword tensors, None and bool
    # arguments, the (cos, sin) tuple): every block captures one graph pair per micro-batch
    # position and replays them in every later step, without falling back to eager.
    model = build(kind)
    if staged:
        stages = [causal_lm_stage(model, s, 2, num_warmup_steps=1) for s in range(2)]

        def forward(tokens):
            logits = compose(stages, tokens)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    else:
        graph_layers(blocks_of(model), num_warmup_steps=1)

        def forward(tokens):
            return model(tokens, labels=tokens).loss
    data = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no eager fallback of any kind
        for step in range(5):
            batches = [torch.randint(0, VOCAB, (2, SEQ), generator=data) for _ in range(4)]
            losses = {}
            for tok in ORDER.split():
                n = int(tok[1:]) - 1
                if tok[0] == "f":
                    losses[n] = forward(batches[n])
                else:
                    losses.pop(n).backward()
    for block in blocks_of(model):
        assert block.engine.captures == 8, block  # 4 positions x (forward, backward)
        assert block.engine.replays == 8 * 3, block  # step 0 warms up, step 1 records
        assert block.engine.in_flight == 0
        (sig,) = block.engine.signatures().values()
        assert len(sig.positions) == 4


# ------------------------------------------------------------------------------ stages
def compose(stages, x):
    for stage in stages:
        x = stage(x)
    return x


@KINDS
@pytest.mark.parametrize("num_stages,split", [(1, None), (2, None), (3, None), (2, [0, 4]), (3, [1, 3, 0])])
def test_stages_compute_what_the_full_model_computes(kind, num_stages, split):
    full, model = build(kind), build(kind)
    stages = [causal_lm_stage(model, s, num_stages, layers_per_stage=split) for s in range(num_stages)]
    assert all(isinstance(s, CausalLMStage) for s in stages)
    # Every key of the full model, each on one stage, with the same tensors.
    keys = [k for s in stages for k in s.state_dict()]
    assert sorted(keys) == sorted(full.state_dict())
    state = model.state_dict()
    for s in stages:
        for k, v in s.state_dict().items():
            assert v is state[k] or torch.equal(v, state[k]), k
    assert sum(len(s.blocks) for s in stages) == 4 and all(is_graphed_layer(b) for s in stages for b in s.blocks)

    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    x, y = tokens[:, :-1], tokens[:, 1:]
    torch.manual_seed(5)  # dropout on: the same draws in the same order
    want = full(x).logits
    torch.manual_seed(5)
    got = compose(stages, x)
    assert torch.equal(got, want)
    torch.nn.functional.cross_entropy(want.flatten(0, 1), y.flatten()).backward()
    torch.nn.functional.cross_entropy(got.flatten(0, 1), y.flatten()).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for n, p in full.named_parameters():
        assert torch.equal(grads[n], p.grad), n


def test_stage_example_io_and_the_eager_reference():
    model = build("llama")
    first, last = causal_lm_stage(model, 0, 2, graph=False), causal_lm_stage(model, 1, 2, graph=False)
    assert not any(is_graphed_layer(b) for b in model.model.layers)
    assert first.layer_indices == [0, 1] and last.layer_indices == [2, 3]
    x, y = first.example_io(3, SEQ)
    assert x.shape == (3, SEQ) and x.dtype == torch.long and y.shape == (3, SEQ, 32)
    x, y = last.example_io(3, SEQ)
    assert x.shape == (3, SEQ, 32) and x.dtype == torch.float32 and y.shape == (3, SEQ, VOCAB)
    assert "blocks=[2, 3]" in repr(last)


def test_stage_errors_say_what_to_do():
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        causal_lm_stage(build("gpt2", tie=True), 0, 2)
    causal_lm_stage(build("gpt2", tie=True), 0, 1)  # one stage holds both ends: fine
    with pytest.raises(ValueError, match=r"stage_index must be in \[0, 2\)"):
        causal_lm_stage(build("llama"), 2, 2)
    with pytest.raises(ValueError, match="add up to the model's 4 blocks"):
        causal_lm_stage(build("llama"), 0, 2, layers_per_stage=[1, 2])
    with pytest.raises(ValueError, match="cannot fill 5 stages"):
        causal_lm_stage(build("llama"), 0, 5)
    with pytest.raises(TypeError, match="not a transformers causal LM.*graph_layers"):
        causal_lm_stage(torch.nn.Sequential(torch.nn.Linear(2, 2)), 0, 1)
    with pytest.raises(TypeError, match=r"causal_lm_stage\(\) got unexpected keyword argument\(s\) \['max_inflight'\]; "
                                        r"it takes \['model', 'stage_index', 'num_stages', 'layers_per_stage', 'graph', "
                                        r"'compile', 'scope', 'options'\] and the engine options \[.*'max_in_flight'"):
        causal_lm_stage(build("llama"), 0, 2, max_inflight=8)


def test_stage_blocks_take_the_engine_options():
    stage = causal_lm_stage(build("llama"), 1, 2, 2, options=EngineOptions(fallback="eager"), max_signatures=1)
    chosen = {(b.engine.options.num_warmup_steps, b.engine.options.fallback, b.engine.options.max_signatures)
              for b in stage.blocks}
    assert chosen == {(2, "eager", 1)}



def test_an_old_transformers_is_refused_at_build(monkeypatch):
    model = build("gpt2")  # first: transformers' lazy imports may set __version__ again
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.6")  # the module imported now
    with pytest.raises(ImportError, match=r"transformers >= 5\.0 .* 4\.57\.6 is installed"):
        causal_lm_stage(model, 0, 1)


def test_masks_are_the_models_own_built_once_per_batch_shape():
    model = build("llama")
    stage = causal_lm_stage(model, 0, 1, graph=False)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    masks = stage.masks(ids)
    assert [name for name, _ in masks] == ["create_causal_mask"]  # what LlamaModel.forward calls
    assert stage.masks(ids.clone()) is masks  # kept: no mask code (or host read) per call
    assert stage.masks(ids[:1]) is not masks  # another batch shape: built anew
    model.eval()  # no dropout: the two forwards must agree exactly
    with torch.no_grad():
        assert torch.equal(stage(ids), model(ids).logits)  # the model's own forward, the same logits


def test_recording_the_masks_draws_no_random_numbers():
    model = build("llama")
    stage = causal_lm_stage(model, 0, 1, graph=False)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    before = torch.get_rng_state()
    stage.masks(ids)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_forward_that_asks_for_other_masks_than_recorded_is_refused():
    model = build("llama")
    stage = causal_lm_stage(model, 0, 1, graph=False)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    masks = [("create_sliding_window_causal_mask", None)]
    with pytest.raises(RuntimeError, match="asked for the mask create_causal_mask where it asked for "
                                           "create_sliding_window_causal_mask.*graph_layers"):
        stage.body(ids, masks)


def test_a_cut_that_does_not_reproduce_the_model_is_refused_at_build():
    model = build("llama")
    real = type(model).forward

    def scaled(self, *args, **kwargs):  # a head transform the base model's forward does not show
        out = real(self, *args, **kwargs)
        out.logits = out.logits * 2
        return out

    model.forward = scaled.__get__(model)
    # the last stage runs the class's forward, the check compares with the class's too: equal
    causal_lm_stage(model, 0, 2, graph=False)
    original = model.model.__class__.forward

    class Other(type(model.model)):
        def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
            if inputs_embeds is None:
                inputs_embeds = self.embed_tokens(input_ids)
            out = original(self, inputs_embeds=inputs_embeds, **kwargs)
            # the embedding again after the blocks: a later stage has only its own input
            out.last_hidden_state = out.last_hidden_state + inputs_embeds
            return out

    other = build("llama")
    other.model.__class__ = Other
    with pytest.raises(TypeError, match=r"cut into 2 stages computes other logits than its own forward.*graph_layers"):
        causal_lm_stage(other, 0, 2, graph=False)


# ------------------------------------------------------------------------- distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind,vpp", [("gpt2", 1), ("llama", 1), ("llama", 2)],
                         ids=["gpt2-Schedule1F1B", "llama-Schedule1F1B", "llama-ScheduleInterleaved1F1B"])
def test_pipeline_over_two_gloo_ranks_trains_like_eager_stages(kind, vpp, tmp_path):
    envs = launch.rank_envs(2, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, WORKER, "--model", kind, "--vpp", str(vpp), "--steps", "4", "--out", str(tmp_path)]
    ends = launch.run_ranks([cmd] * 2, envs=envs, timeout=200, merge_stderr=True)
    codes = [None if e.stopped else e.returncode for e in ends]
    assert codes == [0, 0], f"ranks failed or hung (codes {codes}):\n{''.join(e.stdout for e in ends)[-6000:]}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    eager, graphed = results[1]["eager"]["losses"], results[1]["graphed"]["losses"]
    assert len(eager) == 4 and all(v == v for v in eager)
    assert graphed == eager
    for r in results:
        assert r["grads_compared"] >= 4 * 10 and r["grad_mismatches"] == []  # every step, tensor by tensor
        assert len(r["graphed"]["blocks"]) == 2 and all(b.startswith("Graphed") for b in r["graphed"]["blocks"])
        assert r["graphed"]["state_dict_keys"] == r["eager"]["state_dict_keys"]


@pytest.mark.parametrize("when", ["before", "after"])
def test_gradient_checkpointing_recomputes_through_the_engine(when):
    """``gradient_checkpointing_enable()`` before or after graph_layers: each block's call goes to
    the engine once (transformers' own checkpoint would call it twice), which recomputes it: where
    it runs eagerly (here: no CUDA) under torch.utils.checkpoint, so its forward runs again in the
    backward. Losses and gradients equal the eager checkpointed model's."""
    ref, model = build("llama"), build("llama")
    ref.gradient_checkpointing_enable()
    if when == "before":
        model.gradient_checkpointing_enable()
    graph_layers(model.model.layers)
    if when == "after":
        model.gradient_checkpointing_enable()
    ref.train(), model.train()
    runs, library = [], []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *a: runs.append(torch.is_grad_enabled()))
    for block in model.model.layers:  # transformers' own checkpoint (around __call__ before 5.25, forward since)
        own = block._gradient_checkpointing_func
        block._gradient_checkpointing_func = lambda *a, own=own, **k: (library.append(1), own(*a, **k))[1]
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    for m in (ref, model):
        torch.manual_seed(1)
        m(x, labels=x).loss.backward()
    assert not library  # a graphed block is never checkpointed by the library: its graphs recompute
    assert len(runs) == 2, runs  # the forward under checkpoint, then its recomputation in the backward
    assert model.model.layers[0].engine.recomputing.when()
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name
    model.gradient_checkpointing_disable()
    runs.clear()
    model(x, labels=x).loss.backward()
    assert runs == [True] and not model.model.layers[0].engine.recomputing.when()


def test_recompute_refuses_what_its_graphs_cannot_do():
    """compile= with checkpointing (the compiled forward would compile anew for a capture without
    autograd), and generators the eager recomputation would not replay, are refused naming the fix."""
    model = build("llama")
    graph_layers(model.model.layers, compile=True)
    model.gradient_checkpointing_enable()
    model.train()
    x = torch.randint(0, VOCAB, (2, SEQ))
    with pytest.raises(ValueError, match=r"LlamaDecoderLayer\[0\]: gradient checkpointing \(recompute\) with compile="):
        model(x, labels=x)
    from paddle_graphpp.torch import CUDAGraphedModule
    with pytest.raises(ValueError, match="recompute=True with compile= is not supported"):
        CUDAGraphedModule(torch.nn.Linear(4, 4), recompute=True, compile=True)
    from paddle_graphpp.torch.runtime import RUNTIME
    with pytest.raises(ValueError, match=r"default CUDA generator.s draws only.*generators= \(1\)"):
        RUNTIME.rng_mirror([torch.Generator()])


# ------------------------------------------------------------------- recorded outputs
def _moe(**overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=64, use_cache=False, **overrides)
    return Qwen3MoeForCausalLM(config)


def test_router_logits_recorded_inside_graphed_blocks_are_refused():
    # blocks graphed whole (batched_mm experts); blocks graphed around their experts hand the
    # router logits over from the routers' own graphs (test_moe_around.py)
    model = _moe(output_router_logits=True)
    model.set_experts_implementation("batched_mm")
    with pytest.raises(ValueError, match=r"\[0\]: .*output_router_logits=True.*graph_model\(\)"):
        graph_layers(model.model.layers)
    model = _moe()
    model.set_experts_implementation("batched_mm")
    graph_layers(model.model.layers)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    model(ids, labels=ids)  # nothing recorded inside: fine
    with pytest.raises(ValueError, match=r"records .*router_logits|mlp.gate.* with hooks inside a graphed layer"):
        model(ids, labels=ids, output_router_logits=True)


def test_graph_model_computes_router_logits_and_the_aux_loss_in_its_graph():
    import copy

    from paddle_graphpp.torch import graph_model

    model = _moe(output_router_logits=True, router_aux_loss_coef=0.01)
    ref = copy.deepcopy(model)
    graph_model(model)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    out, own = model(ids, labels=ids), ref(ids, labels=ids)
    assert own.aux_loss is not None and torch.equal(out.aux_loss, own.aux_loss)
    assert torch.equal(out.loss, own.loss)  # the loss includes the weighted aux loss
    assert len(out.router_logits) == 2 and all(torch.equal(a, b) for a, b in zip(out.router_logits, own.router_logits))
    out.loss.backward()
    own.loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_layers_that_share_keys_and_values_outside_their_arguments_are_refused():
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    model = GemmaForCausalLM(GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_cache=False))
    model.config.num_kv_shared_layers = 1  # as Gemma3n's config says it (its last layers read earlier layers' keys)
    with pytest.raises(ValueError, match=r"num_kv_shared_layers=1.*graph_model\(\)"):
        graph_layers(model.model.layers)
