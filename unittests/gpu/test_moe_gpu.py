"""Mixtures of experts captured on a GPU: Hugging Face Qwen3-MoE, Mixtral and DeepSeek-V3 blocks
graphed around their host-reading dispatch (``eager`` experts: attention and router graphed, the
loop over hit experts eager between them), graphed whole (``batched_mm``) and, in bf16 on an sm90+
GPU, graphed whole with ``grouped_mm``. Each trains as the model's own code does: fp32 (TF32 off)
bit for bit, the router's load-balancing loss included where the door takes it; and every graph
is captured once and replayed in every later micro-batch (exact counts), so a block that quietly
ran eagerly fails.

Run on the GPU machine: ``python -m pytest unittests/gpu/test_moe_gpu.py -q``.
"""
import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires a CUDA device")
transformers = pytest.importorskip("transformers")

from testing import zoo  # noqa: E402

from paddle_graphpp.torch import graph_layers  # noqa: E402

MOE = ["qwen3_moe", "mixtral", "deepseek_v3"]
STEPS, MICRO = 5, 2


def _build(model_type, implementation, dtype=torch.float32, **extra):
    try:
        model = zoo.build(model_type, experts_implementation=implementation, **extra)
    except Exception as exc:  # noqa: BLE001 - a class this transformers does not ship
        pytest.skip(f"{model_type} does not build here: {exc}")
    return model.to(device="cuda", dtype=dtype).train()


def _train(model, run=None):
    """Per micro-batch (loss, aux loss) and the weights after STEPS AdamW steps of MICRO micro-batches;
    each step run by ``run(step, batch)`` (default: called)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(2)
    losses = []

    def step(batch):
        out = []
        for ids in batch:
            result = model(ids, labels=ids)
            result.loss.backward()
            aux = getattr(result, "aux_loss", None)
            out.append((result.loss.item(), None if aux is None else aux.item()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    for _ in range(STEPS):
        batch = [torch.randint(0, model.config.vocab_size, (2, 16), generator=gen).cuda() for _ in range(MICRO)]
        losses += run(step, batch) if run is not None else step(batch)
    return losses, [p.detach().clone() for p in model.parameters()]


def _assert_same(reference, run):
    (l0, p0), (l1, p1) = reference, run
    assert l0 == l1
    assert all(torch.equal(x, y) for x, y in zip(p0, p1))


def _assert_captured_once_and_replayed(graphed):
    # one position: a micro-batch warms up, the next is recorded and captured, every later one replays;
    # for the parts of a block graphed around its experts, the warmup call is the block's first training
    # call, which runs them eagerly (it reads the autograd graph to check each part keeps eager's sums):
    # they capture with the blocks graphed whole beside them (DeepSeek-V3's dense first), in one episode
    for module in graphed:
        engine = module.engine
        assert (engine.captures, engine.replays, engine.in_flight) == (2, 2 * (STEPS * MICRO - 2), 0), \
            module.__dict__["_graphpp_name"]


@pytest.mark.parametrize("model_type", MOE)
def test_blocks_graphed_around_their_experts_train_bit_for_bit(model_type, fp32_exact):
    base = _build(model_type, "eager", output_router_logits=True)
    reference = _train(copy.deepcopy(base))
    # the aux loss is part of the model's loss (DeepSeek-V3 balances its experts by a bias instead)
    assert (reference[0][0][1] is not None) == (model_type != "deepseek_v3")
    model = copy.deepcopy(base)
    graphed = graph_layers(zoo.blocks_of(model), num_warmup_steps=1)
    assert any(n.endswith(".experts") for n, _ in graphed.eager)
    _assert_same(reference, _train(model))
    _assert_captured_once_and_replayed(graphed)


@pytest.mark.parametrize("model_type", MOE)
def test_blocks_with_batched_experts_are_graphed_whole_bit_for_bit(model_type, fp32_exact):
    base = _build(model_type, "batched_mm")
    reference = _train(copy.deepcopy(base))
    model = copy.deepcopy(base)
    graphed = graph_layers(zoo.blocks_of(model), num_warmup_steps=1)
    assert not graphed.eager and list(graphed) == list(zoo.blocks_of(model))
    _assert_same(reference, _train(model))
    _assert_captured_once_and_replayed(graphed)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_a_whole_block_whose_capture_fails_trains_on_graphed_around_its_experts(model_type, fp32_exact, monkeypatch):
    """batched_mm blocks are graphed whole; here their experts read the host inside a capture
    (as a dispatch the adapter misjudged would), so each block's whole capture fails: the block
    is graphed around its experts from its next call, with one warning, and training equals the
    model's own bit for bit. (No router logits: graph_layers refuses batched_mm blocks that record
    them, because a whole block's graph would not run the router's hooks.)"""
    base = _build(model_type, "batched_mm")
    experts = type(next(m for m in base.modules() if type(m).__name__.endswith("Experts")))
    original = experts.forward

    def reads_the_host(self, hidden, *args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            hidden.sum().item()  # not permitted while capturing: the capture fails
        return original(self, hidden, *args, **kwargs)

    monkeypatch.setattr(experts, "forward", reads_the_host)
    reference = _train(copy.deepcopy(base))
    model = copy.deepcopy(base)
    blocks = zoo.blocks_of(model)
    graphed = graph_layers(blocks, num_warmup_steps=1)
    with pytest.warns(Warning, match="graphed around its routed experts instead") as seen:
        run = _train(model)
    _assert_same(reference, run)
    assert len([w for w in seen if "graphed around its routed experts instead" in str(w.message)]) == len(blocks)
    # block 1 went to parts first (micro-batch 3), block 0 at micro-batch 4: listed in that order
    assert sorted(n for n, _ in graphed.eager if n.endswith(".experts")) == [
        f"{type(blocks[0]).__name__}[{i}].mlp.experts" for i in range(len(blocks))]
    # micro-batch 3's capture (at block 0's call) failed for every block; block 0 is graphed in
    # parts at micro-batch 4, the others already in 3; then one eager call (judged: their warm-up),
    # one recorded, and replays
    for part in graphed:
        first = 4 if part.__dict__["_graphpp_name"].startswith(f"{type(blocks[0]).__name__}[0].") else 3
        engine = part.engine
        assert (engine.captures, engine.replays, engine.in_flight) == (2, 2 * (STEPS * MICRO - first - 1), 0), \
            part.__dict__["_graphpp_name"]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="torch's grouped matmul is sync-free only for bf16 on sm90+")
def test_grouped_experts_in_bf16_are_captured_whole():
    base = _build("qwen3_moe", "grouped_mm", dtype=torch.bfloat16)
    reference = _train(copy.deepcopy(base))
    model = copy.deepcopy(base)
    graphed = graph_layers(zoo.blocks_of(model), num_warmup_steps=1)
    assert not graphed.eager
    run = _train(model)
    _assert_captured_once_and_replayed(graphed)
    # bf16: eager's own kernels are not deterministic here (the experts' scatter); the losses stay close
    assert max(abs(a[0] - b[0]) for a, b in zip(reference[0], run[0])) < 5e-2


@pytest.mark.parametrize("door", ["graph_model", "causal_lm_stage"])
def test_one_graph_over_a_host_reading_dispatch_is_refused_at_build(door):
    from paddle_graphpp.torch import causal_lm_stage, graph_model

    model = _build("qwen3_moe", "eager")
    with pytest.raises(ValueError, match=r"mlp.experts dispatches its routed experts with experts_implementation="
                                         r"'eager'.*graph_layers\(\), which graphs around the dispatch"):
        if door == "graph_model":
            graph_model(model)
        else:
            causal_lm_stage(model, 0, 1, scope="stage")


def _loss_func_captures(model):
    """Whether the model's own load_balancing_loss_func can be captured: a real capture of it."""
    import sys

    from paddle_graphpp.torch.integrations.transformers import experts_modules

    func = sys.modules[type(model).__module__].load_balancing_loss_func
    experts = experts_modules(model)[0][1].num_experts
    logits = (torch.randn(64, experts, device="cuda"),)
    func(logits, experts, model.config.num_experts_per_tok, None)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            func(logits, experts, model.config.num_experts_per_tok, None)
    except RuntimeError:
        return False
    finally:
        torch.cuda.synchronize()
    return True


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_the_whole_model_graph_takes_the_load_balancing_loss_where_it_captures_and_refuses_it_at_build_otherwise(
        model_type, fp32_exact):
    from paddle_graphpp.torch import graph_model
    from paddle_graphpp.torch.integrations.transformers import aux_loss_capture_problem

    base = _build(model_type, "batched_mm", output_router_logits=True)
    why = aux_loss_capture_problem(base)
    assert (why is None) == _loss_func_captures(base), why  # the probe says what a capture does
    model = copy.deepcopy(base)
    if why is not None:  # transformers 5.16 to 5.22 count with torch.bincount, which reads the host
        with pytest.raises(ValueError, match=r"output_router_logits=True in its config.*load_balancing_loss_func "
                                             r"reads the host"):
            graph_model(model)
        return
    reference = _train(copy.deepcopy(base))
    assert reference[0][0][1] is not None
    graph_model(model)
    _assert_same(reference, _train(model))
    engine = model._graphpp_whole.graphed._engine
    assert engine.captures == 2 and engine.replays > 0


def test_a_model_graphed_on_the_cpu_probes_its_load_balancing_loss_at_its_first_call_on_the_gpu(fp32_exact, caplog):
    """Trainers move the model after it is graphed: the build cannot probe, the first GPU call does,
    and the model then trains as its own code does, graphed where its loss captures and through its
    own forward (one warning) where it reads the host."""
    import logging

    from paddle_graphpp.torch import graph_model
    from paddle_graphpp.torch.integrations.transformers import aux_loss_capture_problem

    cpu = zoo.build("qwen3_moe", experts_implementation="batched_mm", output_router_logits=True)
    reference = _train(copy.deepcopy(cpu).cuda().train())
    model = copy.deepcopy(cpu)
    graph_model(model)  # on the CPU: nothing to probe yet, nothing refused
    model.cuda().train()
    why = aux_loss_capture_problem(model)
    with caplog.at_level(logging.WARNING, logger="paddle_graphpp"):
        run = _train(model)
    _assert_same(reference, run)
    assert reference[0][0][1] is not None  # the aux loss was computed and compared
    engine = model._graphpp_whole.graphed._engine
    warned = [r.getMessage() for r in caplog.records if "load-balancing loss cannot be captured" in r.getMessage()]
    if why is None:
        assert engine.captures == 2 and engine.replays > 0 and not warned
    else:  # transformers 5.16 to 5.22 count with torch.bincount, which reads the host
        assert engine.captures == 0 and len(warned) == 1 and "model's own forward" in warned[0]


@pytest.mark.parametrize("model_type", MOE)
def test_blocks_in_capacity_mode_are_captured_whole_and_count_what_they_drop_in_replays(model_type, fp32_exact):
    from paddle_graphpp.torch import capacity_experts, capacity_overflows

    base = _build(model_type, "eager")
    capacity_experts(base, 0.5, on_overflow="drop")  # half an even share: pairs are dropped every call
    eager = copy.deepcopy(base)
    reference = _train(eager)
    model = copy.deepcopy(base)
    graphed = graph_layers(zoo.blocks_of(model), num_warmup_steps=1)
    assert not graphed.eager
    _assert_same(reference, _train(model))
    _assert_captured_once_and_replayed(graphed)
    dropped, replayed = capacity_overflows(eager), capacity_overflows(model)
    assert sum(dropped.values()) > 0 and replayed == dropped  # the replays counted every drop


def test_an_overflow_inside_replays_stops_the_optimizer_step():
    from paddle_graphpp.torch import CapacityOverflow, capacity_experts

    model = _build("qwen3_moe", "eager")
    capacity_experts(model, 0.5)
    graph_layers(zoo.blocks_of(model), num_warmup_steps=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)).cuda()
    for _ in range(4):  # warm up, record and capture, then replay
        model(ids, labels=ids).loss.backward()
    assert model.model.layers[0].engine.replays > 0
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CapacityOverflow, match="this step was not taken"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_an_overflowed_step_is_re_run_eagerly_as_the_models_own_experts_train(model_type, fp32_exact):
    """``on_overflow="rerun"``: every step drops pairs in its graphed blocks (replays included), is
    abandoned at its optimizer step and run again with the model's own experts and the blocks'
    plain calls. Training equals the model's own bit for bit, and the blocks' engines count only
    the first runs (captured once, replayed after: the re-runs did not replay)."""
    from paddle_graphpp.torch import capacity_experts

    base = _build(model_type, "eager")
    reference = _train(copy.deepcopy(base))
    model = copy.deepcopy(base)
    mode = capacity_experts(model, 0.5, on_overflow="rerun")
    graphed = graph_layers(zoo.blocks_of(model), num_warmup_steps=1)
    assert not graphed.eager
    with pytest.warns(RuntimeWarning, match="re-run eagerly"):
        _assert_same(reference, _train(model, mode.step))
    assert mode.reruns == STEPS and mode.rerun_dropped > 0
    _assert_captured_once_and_replayed(graphed)
