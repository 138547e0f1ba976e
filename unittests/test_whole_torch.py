"""Whole-model (``graph_model``), whole-stage (``causal_lm_stage(scope="stage")``) and whole-step
(``graph_step``) scopes on CPU: validation, and the eager path every one of them takes without
CUDA, which must train exactly as the plain model. That capture works is the GPU tests' claim
(``unittests/gpu/test_whole_gpu.py``)."""
import copy
import inspect
import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from paddle_graphpp.torch import causal_lm_stage, graph_layers, graph_model, graph_step, ungraph_model  # noqa: E402

VOCAB, SEQ = 96, 12
pytestmark = pytest.mark.filterwarnings("ignore:.*CUDA graphs are not used:RuntimeWarning")


def build(kind="llama"):
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, use_cache=False))
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ,
                                      use_cache=False))


def tokens(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(n)]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_graph_model_trains_like_the_model_and_keeps_its_names(kind):
    ref, model = build(kind), build(kind)
    graph_model(model)
    assert list(model.state_dict()) == list(ref.state_dict())
    # trainers read the columns a model takes from its forward's signature
    assert inspect.signature(model.forward) == inspect.signature(ref.forward)
    assert type(model) is type(ref)
    for m in (ref, model):
        torch.manual_seed(5)  # dropout draws the same
        for x in tokens():
            out = m(x, labels=x)
            out.loss.backward()
        m.losses = out.loss.detach()
    assert torch.equal(ref.losses, model.losses)
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_calls_the_graph_does_not_cover_take_the_models_own_forward(caplog):
    model = graph_model(build())
    x = tokens(1)[0]
    with caplog.at_level(logging.WARNING, logger="paddle_graphpp"):
        out = model(x, attention_mask=torch.ones_like(x), labels=x)
        model(x, attention_mask=torch.ones_like(x), labels=x)
    assert out.loss is not None
    assert sum("attention_mask" in r.getMessage() for r in caplog.records) == 1  # one warning per kind
    with caplog.at_level(logging.WARNING, logger="paddle_graphpp"):
        caplog.clear()
        with torch.no_grad():
            model(x)  # evaluation and generate(): silently the model's own forward
        out = model(x, return_dict=False, labels=x)
    assert caplog.records == [] and isinstance(out, tuple) and out[0].dim() == 0
    assert not out[1].requires_grad  # with labels the logits come back detached


def test_graph_model_refuses_a_graph_inside_a_graph_and_bad_options():
    model = build()
    graph_layers(model.model.layers)
    with pytest.raises(TypeError, match="already graphed"):
        graph_model(model)
    model = graph_model(build())
    with pytest.raises(TypeError, match="graphed already.*ungraph_model"):
        graph_model(model)
    with pytest.raises(TypeError, match="cannot be copied.*before graph_model"):
        copy.deepcopy(model)
    ungraph_model(model)
    assert "forward" not in model.__dict__
    with pytest.raises(ValueError, match="num_warmup_steps"):
        graph_model(build(), num_warmup_steps=0)
    with pytest.raises(TypeError, match="not a transformers causal LM.*graph_layers"):
        graph_model(torch.nn.Linear(2, 2))


def test_graph_model_runs_the_models_own_forward_with_a_sliding_window():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               sliding_window=4, use_cache=False))
    ref = copy.deepcopy(mistral)
    graph_model(mistral)
    ids = tokens(1)[0]
    assert ids.shape[1] > 4  # the window matters
    out, own = mistral(ids, labels=ids), ref(ids, labels=ids)
    assert torch.equal(out.logits, own.logits) and torch.equal(out.loss, own.loss)
    out.loss.backward()
    own.loss.backward()
    for (name, p), q in zip(mistral.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_whole_graphs_refuse_gradient_checkpointing_before_and_after():
    """One graph over every block does not recompute: refused when graphing and at a training call
    once turned on after; graph_layers is the way named."""
    model = build()
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match=r"layers.0 has gradient checkpointing on.*graph_model\(\).*graph_layers"):
        graph_model(model)
    with pytest.raises(ValueError, match=r"checkpointing on.*causal_lm_stage\(scope='stage'\)"):
        causal_lm_stage(model, 0, 1, scope="stage")
    model = graph_model(build())
    model.gradient_checkpointing_enable()
    model.train()
    x = tokens(1)[0]
    with pytest.raises(ValueError, match="checkpointing on.*graph_model"):
        model(x, labels=x)
    model.eval()
    with torch.no_grad():
        model(x, labels=x)  # evaluation does not recompute: it runs


def test_whole_stage_scope_equals_the_eager_stage():
    ref = causal_lm_stage(build(), 0, 1, graph=False)
    whole = causal_lm_stage(build(), 0, 1, scope="stage")
    assert list(whole.state_dict()) == list(ref.state_dict())
    x = tokens(1)[0]
    torch.manual_seed(2)
    a = ref(x)
    torch.manual_seed(2)
    b = whole(x)
    assert torch.equal(a, b) and b.requires_grad
    with pytest.raises(ValueError, match="scope must be one of"):
        causal_lm_stage(build(), 0, 1, scope="model")


def step_of(model, opt):
    def train_step(batch):
        for x in batch:
            (model(x, labels=x).loss / len(batch)).backward()
        opt.step()
        opt.zero_grad()
        return x.float().mean()
    return train_step


def test_graph_step_without_cuda_runs_the_step_as_it_is():
    ref, model = build(), build()
    ref_opt, opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model))
    plain, graphed = step_of(ref, ref_opt), graph_step(step_of(model, opt), optimizers=opt)
    for batch in (tokens(2, s) for s in range(3)):
        assert torch.equal(plain(batch), graphed(batch))
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert graphed.captures == 0 and graphed.eager_reason(tokens(2)) is not None
    assert not isinstance(opt.param_groups[0]["lr"], torch.Tensor)  # not switched: nothing is captured


def test_graph_step_checks_its_arguments():
    model = build()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="step function first"):
        graph_step(opt, optimizers=opt)
    with pytest.raises(TypeError, match="no capturable mode"):
        graph_step(lambda: None, optimizers=torch.optim.LBFGS(model.parameters()))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        graph_step(lambda: None, optimizers=[object()])
    with pytest.raises(ValueError, match="num_warmup_steps"):
        graph_step(lambda: None, optimizers=opt, num_warmup_steps=0)
    with pytest.raises(ValueError, match="fallback"):
        graph_step(lambda: None, optimizers=opt, fallback="ignore")
    with pytest.raises(TypeError, match="takes no memory: each signature"):
        graph_step(lambda: None, optimizers=opt, memory="per_graph")
    with pytest.raises(TypeError, match="unexpected keyword.*max_inflight"):
        graph_step(lambda: None, optimizers=opt, max_inflight=2)
    assert graph_step(lambda: None, 5, optimizers=opt).num_warmup_steps == 5
    graph_step(lambda: None, optimizers=torch.optim.SGD(model.parameters(), lr=0.1))  # no host reads: taken


def test_graph_step_refuses_arguments_whose_tensors_it_would_not_copy():
    from collections import UserDict

    from paddle_graphpp.core.tree import flatten
    from paddle_graphpp.torch.step import _unsupported_leaf

    ok, _ = flatten(((dict(ids=torch.zeros(2)), [torch.ones(1), 3, None], "x"), {}))
    assert _unsupported_leaf(ok) is None
    held, _ = flatten(((UserDict(input_ids=torch.zeros(2, 3)),), {}))  # a BatchEncoding is one too
    assert "UserDict" in _unsupported_leaf(held) and "dict(batch)" in _unsupported_leaf(held)


def test_block_arguments_follow_the_attention_kernel():
    model = build()
    stage = causal_lm_stage(model, 0, 1, graph=False)
    ids = tokens(1)[0]
    sdpa = stage.masks(ids)
    model.config._attn_implementation = "eager"
    eager = stage.masks(ids)
    assert eager is not sdpa and eager[0][1] is not None  # eager attention needs the mask


def test_a_load_balancing_loss_that_reads_the_host_is_refused_when_built_and_left_to_eager_per_call(monkeypatch,
                                                                                                   caplog):
    """The probe's verdict stands in for a GPU here (off a GPU it finds nothing: nothing is captured);
    that it tells what a capture does is unittests/gpu/test_moe_gpu.py's claim."""
    from testing import zoo

    from paddle_graphpp.torch.integrations import transformers as adapter

    monkeypatch.setattr(adapter, "aux_loss_capture_problem", lambda model: "its loss reads the host (probe)")
    model = zoo.build("qwen3_moe", experts_implementation="batched_mm", output_router_logits=True)
    with pytest.raises(ValueError, match=r"output_router_logits=True in its config.*its loss reads the host \(probe\)"
                                         r".*output_router_logits = False"):
        graph_model(model)
    assert "forward" not in model.__dict__  # refused before anything changed
    model.config.output_router_logits = False
    ref = copy.deepcopy(model)
    graph_model(model)
    x = torch.randint(0, model.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with caplog.at_level(logging.WARNING, logger="paddle_graphpp"):
        outs = [model(x, labels=x, output_router_logits=True) for _ in range(2)]
    want = ref(x, labels=x, output_router_logits=True)
    assert all(torch.equal(o.loss, want.loss) and torch.equal(o.aux_loss, want.aux_loss) for o in outs)
    assert sum("load-balancing loss cannot be captured" in r.getMessage() for r in caplog.records) == 1


def test_a_model_graphed_before_it_reaches_the_gpu_is_probed_at_its_first_call_there(monkeypatch, caplog):
    """Trainers move the model after it is graphed: the build cannot probe, the first call can (the
    probe's verdict stands in for the GPU, as above)."""
    from testing import zoo

    from paddle_graphpp.torch.integrations import transformers as adapter

    on_gpu = {"now": False}
    monkeypatch.setattr(adapter, "aux_loss_capture_problem",
                        lambda model: "its loss reads the host (probe)" if on_gpu["now"] else None)
    model = zoo.build("qwen3_moe", experts_implementation="batched_mm", output_router_logits=True)
    ref = copy.deepcopy(model)
    graph_model(model)  # not on the GPU yet: nothing to probe, nothing refused
    on_gpu["now"] = True
    x = torch.randint(0, model.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with caplog.at_level(logging.WARNING, logger="paddle_graphpp"):
        out = model(x, labels=x)
    want = ref(x, labels=x)
    assert torch.equal(out.loss, want.loss) and torch.equal(out.aux_loss, want.aux_loss)
    assert any("its loss reads the host (probe)" in r.getMessage() and "model's own forward" in r.getMessage()
               for r in caplog.records)
