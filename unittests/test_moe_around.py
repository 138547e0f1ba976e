"""Mixture-of-experts blocks graphed around their dispatch: a block whose routed experts dispatch
in a way a capture cannot hold (transformers' ``eager`` loop over hit experts; ``grouped_mm`` off
bf16 on sm90+) gets its attention and its router graphed, each in place, and its experts, norms,
shared experts and own glue code eager between them (``graph_layers(...).eager`` says what and
why). Checked here against the model's own training, bit for bit in fp32, with the router logits'
load-balancing loss; on the fake runtime, that the parts capture and replay while the experts
never run inside a capture; and undo.

CPU only: the fake runtime's captures run the code eagerly. That the parts capture on a GPU, and
what they gain, is unittests/gpu/test_moe_gpu.py and tools/bench_moe.py.
"""
import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from testing import zoo  # noqa: E402

from paddle_graphpp.core.process import current_process  # noqa: E402
from paddle_graphpp.torch import graph_layers, ungraph_layers  # noqa: E402
from paddle_graphpp.torch.layers import is_graphed_layer  # noqa: E402
from paddle_graphpp.torch.integrations import transformers as adapter  # noqa: E402

MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"]


def _model(model_type, implementation, **overrides):
    try:
        return zoo.build(model_type, experts_implementation=implementation, **overrides)
    except Exception as exc:  # noqa: BLE001 - a class this transformers does not ship
        pytest.skip(f"{model_type} does not build here: {exc}")


def _trained_as_the_model_does(base, graph):
    """The largest difference between training ``base``'s copy plainly and a copy graphed by
    ``graph(model)`` (zoo's run: 2 micro-batches, AdamW; logits, losses, gradients, weights)."""
    data = zoo._batches(base.config.get_text_config().vocab_size)
    own = copy.deepcopy(base)
    reference = zoo._train(own, zoo._own(own), data)
    graphed = copy.deepcopy(base)
    graph(graphed)
    return zoo._difference(reference, zoo._train(graphed, zoo._own(graphed), data))


def _graph_layers_trained(base):
    """``(difference from the model's own training, what graph_layers returned, the graphed model)``."""
    got = {}

    def graph(model):
        got["model"], got["graphed"] = model, graph_layers(zoo.blocks_of(model))

    difference = _trained_as_the_model_does(base, graph)
    return difference, got["graphed"], got["model"]


def _names(graphed):
    return [layer.__dict__["_graphpp_name"] for layer in graphed]


@pytest.mark.parametrize("model_type", MOE)
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_blocks_graphed_around_their_experts_train_bit_for_bit_as_the_model(model_type, implementation):
    difference, graphed, model = _graph_layers_trained(_model(model_type, implementation))
    assert difference == 0.0
    names = _names(graphed)
    moe_blocks = [b for b in zoo.blocks_of(model) if adapter.experts_modules(b)]
    assert moe_blocks and not any(is_graphed_layer(b) for b in moe_blocks)
    # each MoE block: its attention and its router graphed; its experts eager, with why
    assert sum(n.endswith("attn") for n in names) >= len(moe_blocks)
    assert sum(n.rpartition(".")[2] in ("gate", "router") for n in names) == len(moe_blocks), names
    experts = [(n, why) for n, why in graphed.eager if n.rpartition(".")[2] == "experts"]
    assert len(experts) == len(moe_blocks)
    assert all(f"experts_implementation={implementation!r}" in why for _, why in experts)


@pytest.mark.parametrize("model_type", ["flex_olmo", "minimax"])
def test_a_part_whose_input_the_block_reads_elsewhere_too_is_given_back_to_eager(model_type):
    # their attention reads the residual stream (or a norm's output the block adds back): the
    # block's first training call finds it and runs those attentions eagerly from then on
    difference, graphed, model = _graph_layers_trained(_model(model_type, "eager"))
    assert difference == 0.0
    names = _names(graphed)
    assert names and not any(n.endswith("attn") for n in names), names
    given_back = [n for n, why in graphed.eager if "block reads it elsewhere too" in why]
    assert len(given_back) == len([b for b in zoo.blocks_of(model) if adapter.experts_modules(b)])
    assert all(n.endswith("self_attn") for n in given_back)
    assert not any(is_graphed_layer(m) for b in zoo.blocks_of(model) for n, m in b.named_modules()
                   if n.endswith("self_attn"))


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_the_load_balancing_loss_comes_from_the_routers_graphs(model_type):
    # output_router_logits=True: the model's loss adds the aux loss made of every router's logits,
    # recorded by hooks on the routers, which run around the routers' own graphs
    base = _model(model_type, "eager", output_router_logits=True, router_aux_loss_coef=0.5)
    own = copy.deepcopy(base)
    ids = torch.randint(0, base.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    out = own(ids, labels=ids)
    assert out.aux_loss is not None and out.aux_loss.item() > 0
    assert _trained_as_the_model_does(base, lambda m: graph_layers(zoo.blocks_of(m))) == 0.0


def test_a_block_graphed_whole_still_refuses_router_logits():
    model = _model("qwen3_moe", "batched_mm", output_router_logits=True)
    with pytest.raises(ValueError, match=r"output_router_logits=True.*set_experts_implementation\('eager'\)"):
        graph_layers(zoo.blocks_of(model))


@pytest.fixture
def fake_runtime():
    from fake_runtime import FakeGraphRuntime, serving

    rt = FakeGraphRuntime()
    current_process().reset(rt.name)
    with serving(rt):
        yield rt
    current_process().reset(rt.name)


def test_the_parts_capture_and_replay_and_the_experts_never_run_in_a_capture(fake_runtime, monkeypatch):
    rt = fake_runtime
    model = _model("qwen3_moe", "eager")
    experts = type(adapter.experts_modules(zoo.blocks_of(model)[0])[0][1])
    original = experts.forward
    calls = {"eager": 0}

    def reads_the_host(self, *args, **kwargs):  # what the eager dispatch does inside a real capture
        if rt.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")
        calls["eager"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(experts, "forward", reads_the_host)
    graphed = graph_layers(zoo.blocks_of(model), num_warmup_steps=1)
    steps, micro = 5, 2
    data = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no eager fallback of any kind
        for _ in range(steps):
            for _ in range(micro):
                ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=data)
                model(ids, labels=ids).loss.backward()
    assert calls["eager"] == steps * micro * len(zoo.blocks_of(model))
    for part in graphed:
        # one position: each micro-batch an episode. The block's first training call runs its parts
        # eagerly (the probe that checks each keeps eager's sums), and counts as their warmup call;
        # the next is recorded and captured after it, every later one replays the (forward, backward) pair
        assert (part.engine.captures, part.engine.replays, part.engine.in_flight) == (2, 2 * (steps * micro - 2), 0), \
            part.__dict__["_graphpp_name"]
        # no other live graphed layer holds a part's parameters: its graphs add them into .grad
        assert all(view.accumulate for view in part.engine.signatures().values()), part.__dict__["_graphpp_name"]


def test_parts_capture_in_the_same_episode_as_a_dense_block_graphed_whole_beside_them(fake_runtime, monkeypatch):
    # DeepSeek-V3's first blocks are dense (graphed whole, no probe). The call that judges the MoE
    # blocks' parts counts as their first warmup call, so that every graph is captured in one episode,
    # into one pool: a capture after replays began would open a second pool generation, which the
    # graphs of the first cannot share (on an H100 that second pool doubled the graphs' memory).
    rt = fake_runtime
    model = _model("deepseek_v3", "eager", first_k_dense_replace=1, num_hidden_layers=3)
    blocks = zoo.blocks_of(model)
    assert not adapter.experts_modules(blocks[0]) and adapter.experts_modules(blocks[1])
    graphed = graph_layers(blocks, num_warmup_steps=2)
    assert is_graphed_layer(blocks[0]) and not is_graphed_layer(blocks[1])  # dense whole; MoE in parts
    _run(model, micro_batches=1, steps=6)
    from paddle_graphpp.core.memory import memory_report

    assert memory_report()[rt.name]["pool_generations"] == 1
    for layer in [blocks[0], *graphed]:
        # calls 1 and 2 warm up (the parts' first one as the probe), 3 is recorded, 4 to 6 replay
        assert (layer.engine.captures, layer.engine.replays) == (2, 2 * 3), layer.__dict__["_graphpp_name"]


@pytest.mark.parametrize("how", ["undo", "ungraph_layers"])
def test_undo_gives_the_blocks_back_whole(how):
    model = _model("qwen3_moe", "eager")
    blocks = zoo.blocks_of(model)
    keys = list(model.state_dict())
    classes = [type(m) for m in model.modules()]
    graphed = graph_layers(blocks)
    assert list(model.state_dict()) == keys
    with pytest.raises(TypeError, match=r"Qwen3MoeDecoderLayer\[0\] is already graphed"):
        graph_layers(blocks)
    if how == "undo":
        graphed.undo()
    else:
        ungraph_layers(blocks)
    assert [type(m) for m in model.modules()] == classes
    assert list(model.state_dict()) == keys
    again = graph_layers(blocks)  # and graphed again
    assert len(again) == len(graphed)


def test_gradient_checkpointing_on_a_block_graphed_in_parts_is_refused_by_name():
    model = _model("qwen3_moe", "eager")
    graph_layers(zoo.blocks_of(model))
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    with pytest.raises(ValueError, match=r"Qwen3MoeDecoderLayer\[0\]\.self_attn: its block has gradient "
                                         r"checkpointing on, and it is graphed around its experts"):
        model(ids, labels=ids)


def _train_frozen_first(model, frozen):
    """Two AdamW steps, the input embedding frozen in the first (``frozen``), then trainable."""
    torch.manual_seed(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    embedding = model.get_input_embeddings().weight
    for step in range(2):
        embedding.requires_grad_(not (frozen and step == 0))
        for _ in range(2):
            ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
            model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["eval", "frozen_first"])
def test_a_part_is_judged_in_eval_mode_and_only_once_its_input_carries_a_gradient(how):
    # training in eval mode (dropout off) is probed as well; with the embedding frozen in the first
    # step, block 0's attention reads an input without a gradient: it stays eager and undecided
    # until a call where its input carries one, then is judged (flex_olmo's: given back)
    base = _model("flex_olmo", "eager")
    if how == "eval":
        base.eval()
    own, graphed_model = copy.deepcopy(base), copy.deepcopy(base)
    graphed = graph_layers(zoo.blocks_of(graphed_model))
    want = _train_frozen_first(own, frozen=how == "frozen_first")
    got = _train_frozen_first(graphed_model, frozen=how == "frozen_first")
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert not any(n.endswith("attn") for n in _names(graphed))
    assert not any("_graphpp_parts_probe" in b.__dict__ for b in zoo.blocks_of(graphed_model))


def test_a_first_training_call_that_raises_leaves_the_parts_graphed_and_undecided(monkeypatch):
    model = _model("qwen3_moe", "eager")
    graphed = graph_layers(zoo.blocks_of(model))
    names = _names(graphed)
    experts = type(adapter.experts_modules(zoo.blocks_of(model)[0])[0][1])
    original = experts.forward

    def fails(self, *args, **kwargs):
        raise RuntimeError("out of memory (a stand-in)")

    monkeypatch.setattr(experts, "forward", fails)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    with pytest.raises(RuntimeError, match="a stand-in"):
        model(ids, labels=ids)
    monkeypatch.setattr(experts, "forward", original)
    assert _names(graphed) == names and all(is_graphed_layer(p) for p in graphed)
    assert not any(p._forward_hooks for p in graphed)  # the probe's hooks on the parts are gone
    model(ids, labels=ids).loss.backward()  # judged now
    assert not any("_graphpp_parts_probe" in b.__dict__ for b in zoo.blocks_of(model))
    graphed.undo()
    graph_layers(zoo.blocks_of(model))


@pytest.mark.parametrize("when", ["before", "after"])
def test_ungraph_layers_on_the_returned_list_makes_the_blocks_whole(when):
    model = _model("flex_olmo", "eager")
    keys, classes = list(model.state_dict()), [type(m) for m in model.modules()]
    graphed = graph_layers(zoo.blocks_of(model))
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    if when == "after":  # the first training call gave the attentions back
        model(ids, labels=ids).loss.backward()
    ungraph_layers(list(graphed))
    assert [type(m) for m in model.modules()] == classes and list(model.state_dict()) == keys
    assert not any(k.startswith("_graphpp") for b in zoo.blocks_of(model) for k in b.__dict__)
    assert not any(b._forward_hooks or b._forward_pre_hooks for b in zoo.blocks_of(model))
    graph_layers(zoo.blocks_of(model))  # graphed again
    model(ids, labels=ids).loss.backward()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_a_whole_block_whose_capture_fails_is_graphed_around_its_experts_instead(fake_runtime, monkeypatch, model_type):
    # batched_mm is graphed whole (it reads nothing on the host); should its capture fail anyway,
    # the block goes on graphed around its experts, with one warning per block, and nothing raised.
    # (That the result equals the model's own training is the GPU test's claim, under real captures.)
    rt = fake_runtime
    model = _model(model_type, "batched_mm")
    blocks = zoo.blocks_of(model)
    experts = type(adapter.experts_modules(blocks[0])[0][1])
    original = experts.forward
    inside = {"captures": 0}

    def reads_the_host(self, *args, **kwargs):  # what a dispatch that reads the host does inside a real capture
        if rt.capturing:
            inside["captures"] += 1
            raise RuntimeError("operation not permitted when stream is capturing")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(experts, "forward", reads_the_host)  # on the class: transformers 5.0 refuses
    # a block whose submodules' forward is replaced on the instance (its output recording)
    graphed = graph_layers(blocks, num_warmup_steps=1)
    assert all(is_graphed_layer(b) for b in blocks)  # whole, as batched_mm captures
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(8):  # each micro-batch an episode: warm up, record, capture (fails), then in parts
            ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
            model(ids, labels=ids).loss.backward()
    failed = [w for w in seen if "graphed around its routed experts instead" in str(w.message)]
    assert len(failed) == len(blocks), [str(w.message)[:200] for w in seen]  # one per block
    assert all("capturing the forward failed (RuntimeError: operation not permitted" in str(w.message) for w in failed)
    assert inside["captures"] == len(blocks)  # each block's whole capture was tried once
    assert not any(is_graphed_layer(b) for b in blocks)  # in parts now
    names = _names(graphed)  # the list it returned names the parts, where the blocks were
    assert names[:2] == [f"{type(blocks[0]).__name__}[0].self_attn", f"{type(blocks[0]).__name__}[0].mlp.gate"], names
    assert sum(n.rpartition(".")[2] in ("gate", "router") for n in names) == len(blocks), names
    assert all(is_graphed_layer(m) for m in graphed)
    experts_eager = [(n, why) for n, why in graphed.eager if n.rpartition(".")[2] == "experts"]
    assert len(experts_eager) == len(blocks)
    assert all("its whole capture failed (RuntimeError: operation not permitted" in why for _, why in experts_eager)
    for part in graphed:
        # Micro-batch 3's capture, at block 0's call, failed for every block: block 0 ran it
        # eagerly and is graphed in parts at its call in micro-batch 4; the later blocks, called
        # after the failure, already in 3. The parts' first call runs eagerly (judged, their warmup
        # call), the next is recorded, and every later one replays (forward and backward).
        first = 4 if part.__dict__["_graphpp_name"].startswith(f"{type(blocks[0]).__name__}[0].") else 3
        replays = 8 - (first + 1)
        assert (part.engine.captures, part.engine.replays) == (2, 2 * replays), part.__dict__["_graphpp_name"]
        # the block's whole engine is retired: it does not count as a second holder of the parameters
        assert all(view.accumulate for view in part.engine.signatures().values()), part.__dict__["_graphpp_name"]
    graphed.undo()  # and the list it returned undoes them all
    assert not any(is_graphed_layer(m) for m in model.modules())


def _failing_whole_blocks(rt, monkeypatch, model_type="qwen3_moe", error=None):
    """A ``batched_mm`` model whose experts raise ``error()`` inside a capture (a host read by default)."""
    model = _model(model_type, "batched_mm")
    experts = type(adapter.experts_modules(zoo.blocks_of(model)[0])[0][1])
    original = experts.forward

    def fails_in_capture(self, *args, **kwargs):
        if rt.capturing:
            raise (error() if error else RuntimeError("operation not permitted when stream is capturing"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(experts, "forward", fails_in_capture)
    return model


def _run(model, micro_batches, in_flight=1, steps=4):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        losses = [model(ids, labels=ids).loss for ids in
                  [torch.randint(0, model.config.vocab_size, (2, 16), generator=gen) for _ in range(in_flight)]]
        for loss in losses:
            loss.backward()


def test_one_warning_per_block_with_several_micro_batches_in_flight(fake_runtime, monkeypatch):
    model = _failing_whole_blocks(fake_runtime, monkeypatch)
    graph_layers(zoo.blocks_of(model), num_warmup_steps=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _run(model, 0, in_flight=3, steps=4)
    blocks = zoo.blocks_of(model)
    assert not any(is_graphed_layer(b) for b in blocks)
    about = [str(w.message) for w in seen if "Qwen3MoeDecoderLayer[0]:" in str(w.message)]
    assert len(about) == 1 and "graphed around its routed experts instead" in about[0], about


@pytest.mark.filterwarnings("ignore:another capture failed as well")  # every block's, after the first's error
@pytest.mark.parametrize("case", ["checkpointing", "out of memory", "empty message"])
def test_a_failure_parts_would_not_mend_follows_the_fallback_option(fake_runtime, monkeypatch, case):
    """Out of memory, or a block under its library's checkpointing (its parts would refuse it), is
    left to the fallback option (here "error"): the block stays whole and the capture error is raised."""
    # (an error that says nothing is still mended by parts: the warning names its type)
    error = {"out of memory": lambda: torch.OutOfMemoryError("out of memory"),
             "empty message": lambda: RuntimeError()}.get(case)
    model = _failing_whole_blocks(fake_runtime, monkeypatch, error=error)
    if case == "checkpointing":
        from paddle_graphpp.torch import recompute

        class NoMirrors(recompute.Mirrors):  # no CUDA generators to mirror on CPU
            def __init__(self):
                self.generators, self.mirrors = [], []

        monkeypatch.setattr(recompute, "Mirrors", NoMirrors)
        model.gradient_checkpointing_enable()
        model.train()
    blocks = zoo.blocks_of(model)
    graph_layers(blocks, num_warmup_steps=1)
    if case == "empty message":
        with pytest.warns(Warning, match=r"capturing the forward failed \(RuntimeError: \); from its next call"):
            _run(model, 0, steps=5)
        assert not any(is_graphed_layer(b) for b in blocks)
        return
    from paddle_graphpp import CaptureError

    with pytest.raises(CaptureError, match="capturing the forward failed"):
        _run(model, 0, steps=5)
    assert all(is_graphed_layer(b) for b in blocks)  # whole still: fallback="error" decided
