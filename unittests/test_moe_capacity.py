"""The capacity mode of mixtures of experts (``capacity_experts``): each expert takes a fixed number
of (token, expert) slots per call, so the dispatch is sync-free and blocks are graphed whole; what
overflows is counted on the device and, by default, stops the next optimizer step before it
changes a parameter.

Checked on CPU against the model's own code: each pair's output is what its expert computes, or
zero when dropped (in token order, past the expert's capacity); graphed blocks and the whole-model
graph train bit for bit as the same capacity mode eagerly; without overflow the model trains as with
its own experts up to float order; undo, copies and the refusals. That the counters count inside
replays on a GPU is unittests/gpu/test_moe_gpu.py.
"""
import copy
import gc
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from testing import zoo  # noqa: E402

from paddle_graphpp import CaptureError, CaptureFallbackWarning  # noqa: E402
from paddle_graphpp.torch import (CapacityOverflow, capacity_experts, capacity_overflows, graph_layers,  # noqa: E402
                                  graph_model, graph_step)
from paddle_graphpp.torch.integrations import transformers as adapter  # noqa: E402

MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"]
EXPERTS, TOP_K = 4, 2  # the zoo's tiny mixtures of experts


def _model(model_type, implementation="eager", **overrides):
    try:
        return zoo.build(model_type, experts_implementation=implementation, **overrides)
    except Exception as exc:  # noqa: BLE001 - a class this transformers does not ship
        pytest.skip(f"{model_type} does not build here: {exc}")


def _train(model):
    data = zoo._batches(model.config.get_text_config().vocab_size)
    return zoo._train(model, zoo._own(model), data)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("factor", [0.5, EXPERTS / TOP_K])
def test_each_pair_gets_its_experts_output_or_zero_past_the_capacity(model_type, factor):
    model = _model(model_type)
    _, experts, _ = adapter.experts_modules(zoo.blocks_of(model)[0])[0]
    capacity_experts(model, factor, on_overflow="drop")
    tokens = 12
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, model.config.hidden_size, generator=gen)
    index = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen)
    got = experts(hidden, index, weights)
    slots = max(1, -(-int(factor * tokens * TOP_K) // EXPERTS))
    taken = [0] * EXPERTS
    want = torch.zeros_like(hidden)
    dropped = 0
    with torch.no_grad():
        model.config._experts_implementation = "eager"  # the module's own loop, one pair at a time
        for k in range(TOP_K):  # choice by choice: every token's first choice, then every second
            for t in range(tokens):
                e = int(index[t, k])
                taken[e] += 1
                if taken[e] > slots:
                    dropped += 1
                    continue
                one = torch.zeros_like(index[t:t + 1]) + e
                want[t] += experts(hidden[t:t + 1], one[:, :1], weights[t:t + 1, k:k + 1])[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert sum(capacity_overflows(model).values()) == dropped
    assert (dropped > 0) == (factor < EXPERTS / TOP_K)  # num_experts / top_k slots: nothing can be dropped


@pytest.mark.parametrize("model_type", MOE)
def test_blocks_in_capacity_mode_are_graphed_whole_and_train_as_the_capacity_mode(model_type):
    base = _model(model_type)
    capacity_experts(base, EXPERTS / TOP_K)  # nothing dropped
    eager = copy.deepcopy(base)
    reference = _train(eager)
    graphed_model = copy.deepcopy(base)
    graphed = graph_layers(zoo.blocks_of(graphed_model))
    assert not graphed.eager  # whole blocks: the capacity dispatch reads nothing on the host
    assert zoo._difference(reference, _train(graphed_model)) == 0.0
    whole = copy.deepcopy(base)
    graph_model(whole)
    assert zoo._difference(reference, _train(whole)) == 0.0
    assert not any(capacity_overflows(m) and sum(capacity_overflows(m).values()) for m in (eager, graphed_model, whole))
    # and, nothing dropped, as the model's own experts compute, up to float order
    own = _model(model_type)
    assert zoo._difference(reference, _train(own)) < 1e-3


def test_an_overflow_stops_the_next_optimizer_step_before_it_changes_anything():
    model = _model("qwen3_moe")
    capacity_experts(model, 0.25)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CapacityOverflow, match=r"pairs were dropped at their experts' capacity .*model\.layers\.0\."
                                               r"mlp\.experts: \d+.*this step was not taken.*on_overflow='drop'"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not any(capacity_overflows(model).values())  # reset by the check
    assert not opt.state  # the step did not run


def test_dropping_is_counted_when_the_user_accepts_it():
    model = _model("qwen3_moe")
    mode = capacity_experts(model, 0.25, on_overflow="drop")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    opt.step()
    counts = capacity_overflows(model, reset=True)
    assert sum(counts.values()) > 0 and set(counts) == {n for n, _, _ in adapter.experts_modules(model)}
    assert not any(mode.overflows().values())


def test_calls_without_grad_are_not_counted_and_the_counter_is_a_buffer_that_is_not_saved():
    model = _model("qwen3_moe")
    capacity_experts(model, 0.25, on_overflow="drop")
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)
    assert not any(capacity_overflows(model).values())
    model(ids)
    assert sum(capacity_overflows(model).values()) > 0
    buffers = [n for n, _ in model.named_buffers() if n.endswith("_graphpp_capacity_dropped")]
    assert len(buffers) == len(adapter.experts_modules(model))  # they move with the model
    assert not any(k.endswith("_graphpp_capacity_dropped") for k in model.state_dict())


def test_a_submodule_or_a_stale_mode_cannot_switch_the_model():
    model = _model("qwen3_moe")
    with pytest.raises(TypeError, match=r"holds a config that is not Qwen3MoeDecoderLayer's own.*whole model"):
        capacity_experts(model.model.layers[0])
    first = capacity_experts(model, 2.0)
    first.undo()
    second = capacity_experts(model, 2.0)
    first.undo()  # undone already: changes nothing
    assert {impl for _, _, impl in adapter.experts_modules(model)} == {"graphpp_capacity"}
    second.undo()
    assert {impl for _, _, impl in adapter.experts_modules(model)} == {"eager"}
    assert not any(n.endswith("_graphpp_capacity_dropped") for n, _ in model.named_buffers())


def test_undo_and_copies():
    model = _model("qwen3_moe")
    mode = capacity_experts(model, 0.25)
    with pytest.raises(ValueError, match="capacity mode already"):
        capacity_experts(model)
    copied = copy.deepcopy(model)  # the copy is watched: its overflow stops its own optimizer
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    copied(ids, labels=ids).loss.backward()
    with pytest.raises(CapacityOverflow):
        torch.optim.SGD(copied.parameters(), lr=0.1).step()
    assert mode.undo() is model
    assert {impl for _, _, impl in adapter.experts_modules(model)} == {"eager"}
    assert capacity_overflows(model) == {}
    model(ids, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # no capacity, nothing checked
    capacity_experts(model, 2.0)  # and again


def test_bad_arguments_are_refused_by_name():
    for factor in (0, float("nan"), True):
        with pytest.raises(ValueError, match="capacity_factor must be a finite number > 0"):
            capacity_experts(_model("qwen3_moe"), factor)
    with pytest.raises(ValueError, match=r"on_overflow must be one of \('raise', 'drop', 'rerun'\)"):
        capacity_experts(_model("qwen3_moe"), on_overflow="retry")
    with pytest.raises(TypeError, match="LlamaForCausalLM holds no mixture-of-experts experts module"):
        capacity_experts(_model("llama", None))
    model = _model("qwen3_moe")
    with pytest.raises(ValueError, match="group= names ranks of torch.distributed, which is not initialised"):
        capacity_experts(model, group=object())
    assert not capacity_overflows(model)  # refused before anything changed


def _graphed_step(model, fallback):
    graph_model(model)  # transformers builds its masks outside the step's graph
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(ids):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return graph_step(train_step, 1, optimizers=opt, fallback=fallback), opt


def test_a_captured_step_cannot_leave_overflows_unchecked(capturing_torch):
    """``"raise"`` reads the counters before an optimizer step, which a replay does not run:
    capturing a step of experts under it fails with that reason, before the step changes anything,
    and under ``fallback="eager"`` the step runs eagerly, where the check stops an overflow."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model = _model("qwen3_moe")
    capacity_experts(model, EXPERTS / TOP_K)  # nothing dropped: the warmup step passes the check
    step, _ = _graphed_step(model, "error")
    step(ids)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CaptureError, match=r"Qwen3MoeForCausalLM is in capacity mode with on_overflow='raise' "
                                           r"\(model\.layers\.0\.mlp\.experts and \d+ more\).*being captured.*"
                                           r"on_overflow='drop'"):
        step(ids)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert step.captures == 0

    model = _model("qwen3_moe")
    capacity_experts(model, 0.25)
    step, _ = _graphed_step(model, "eager")
    with pytest.raises(CapacityOverflow):  # the warmup step is eager: checked
        step(ids)
    with pytest.warns(CaptureFallbackWarning, match="on_overflow='raise'"), pytest.raises(CapacityOverflow):
        step(ids)  # the capture failed; this call ran eagerly and its check stopped the overflow
    assert step.captures == 0

    del model, step
    gc.collect()  # the models above are gone: their modes no longer count
    model = _model("qwen3_moe")
    capacity_experts(model, 0.25, on_overflow="drop")  # dropping accepted: captured
    step, _ = _graphed_step(model, "error")
    for _ in range(3):
        step(ids)
    assert (step.captures, step.replays) == (1, 2)

    other = _model("qwen3_moe")  # experts checked in another model: every step reads them (a head
    capacity_experts(other, 0.25)  # trained over frozen experts still trains on what they computed)
    step, _ = _graphed_step(_model("qwen3_moe"), "error")
    step(ids)
    with pytest.raises(CaptureError, match="Qwen3MoeForCausalLM is in capacity mode with on_overflow='raise'"):
        step(ids)


def test_a_step_of_a_head_over_frozen_experts_is_checked():
    model = _model("qwen3_moe")
    capacity_experts(model, 0.25)
    head = torch.nn.Linear(64, 1)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    x = _ids(1)[0]
    head(model(x, output_hidden_states=True).hidden_states[-1]).mean().backward()
    with pytest.raises(CapacityOverflow, match="this step was not taken"):
        opt.step()


@pytest.mark.parametrize("door,model_type", [("eager", "mixtral"), ("graph_layers", "qwen3_moe"),
                                             ("graph_model", "qwen3_moe")])
def test_an_overflowed_step_is_re_run_as_the_models_own_experts_train(door, model_type):
    """``"rerun"``: every step here drops pairs (a quarter of an even share), is abandoned at its
    optimizer step and run again with the model's own experts: the training equals the model's own,
    bit for bit (Mixtral's router jitter draws the same noise again), and the capacity mode is back
    after each step."""
    base = _model(model_type, **({"router_jitter_noise": 0.1} if model_type == "mixtral" else {}))
    data = zoo._batches(base.config.vocab_size)
    reference = zoo.train_steps(copy.deepcopy(base), data)
    model = copy.deepcopy(base)
    mode = capacity_experts(model, 0.25, on_overflow="rerun")
    if door == "graph_layers":
        assert not graph_layers(zoo.blocks_of(model)).eager
    elif door == "graph_model":
        graph_model(model)
    with pytest.warns(RuntimeWarning, match=rf"{type(model).__name__}: a step dropped .* re-run eagerly"):
        got = zoo.train_steps(model, data, mode.step)
    assert all(torch.equal(a, b) for a, b in zip(reference[0] + reference[1], got[0] + got[1]))
    assert mode.reruns == len(data) and mode.rerun_dropped > 0
    assert {impl for _, _, impl in adapter.experts_modules(model)} == {"graphpp_capacity"}
    assert not any(capacity_overflows(model).values())


def test_a_rerun_step_needs_its_step():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model = _model("qwen3_moe")
    mode = capacity_experts(model, 0.25, on_overflow="rerun")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(ids, labels=ids).loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CapacityOverflow, match=r"this step was not taken.*re-run only when it runs through the "
                                               r"model's CapacityMode\.step"):
        opt.step()  # outside step(): not re-run, and not taken
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(RuntimeError, match="inside another step"):
        mode.step(mode.step, lambda: None)
    mode.undo()
    with pytest.raises(RuntimeError, match="capacity mode was undone"):
        mode.step(lambda: None)
    gone = capacity_experts(_model("qwen3_moe"), 0.25, on_overflow="rerun")
    gc.collect()
    with pytest.raises(RuntimeError, match="Qwen3MoeForCausalLM this capacity mode was made for no longer exists"):
        gone.step(lambda: None)


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def _ids(n=2):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (2, 16), generator=gen) for _ in range(n)]


def _rerun_against_reference(train):
    """``train(model, run)`` on the model's own experts (steps called) and on a copy in
    ``"rerun"`` mode at a quarter of an even share (steps run by ``mode.step``): the two models,
    and the mode."""
    base = _model("qwen3_moe")
    reference = copy.deepcopy(base)
    train(reference, lambda step, *args: step(*args))
    model = copy.deepcopy(base)
    mode = capacity_experts(model, 0.25, on_overflow="rerun")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        train(model, mode.step)
    return reference, model, mode


def test_a_rerun_unscales_again_under_a_grad_scaler():
    """``scaler.step`` unscaled the abandoned run's gradients and noted it; the re-run's unscales its own."""
    def train(model, run):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

        def step(batch):
            for x in batch:
                scaler.scale(model(x, labels=x).loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        run(step, _ids())

    reference, model, mode = _rerun_against_reference(train)
    assert mode.reruns == 1 and _same(reference, model)


def test_a_caught_overflow_takes_no_step_and_the_step_is_re_run():
    """A step that catches ``CapacityOverflow`` (written for ``"raise"``), once or retrying: the
    optimizer raises again while the overflow is pending, and the step is re-run all the same."""
    for retries in (1, 2):
        def train(model, run):
            opt = torch.optim.SGD(model.parameters(), lr=1e-2)

            def step(batch):
                for x in batch:
                    model(x, labels=x).loss.backward()
                for _ in range(retries):
                    try:
                        opt.step()
                        break
                    except CapacityOverflow:
                        continue
                opt.zero_grad(set_to_none=True)
            run(step, _ids())

        reference, model, mode = _rerun_against_reference(train)
        assert mode.reruns == 1 and mode.rerun_dropped > 0 and _same(reference, model)


def test_a_second_optimizer_cleared_by_the_step_trains_as_eager():
    """A head outside the model with its own optimizer, stepped after the model's: the step
    clears the gradients first (as ``step()`` asks), so the abandoned run's head gradient is gone."""
    head_base = torch.nn.Linear(64, 1)
    heads = []

    def train(model, run):
        head = copy.deepcopy(head_base)
        heads.append(head)
        opts = [torch.optim.SGD(model.parameters(), lr=1e-2), torch.optim.SGD(head.parameters(), lr=1e-2)]

        def step(batch):
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            for x in batch:
                out = model(x, labels=x, output_hidden_states=True)
                (out.loss + head(out.hidden_states[-1]).mean()).backward()
            for opt in opts:
                opt.step()
        run(step, _ids())

    reference, model, mode = _rerun_against_reference(train)
    assert mode.reruns == 1 and _same(reference, model) and _same(*heads)


def test_a_step_without_an_optimizer_step_is_refused():
    """Gradient accumulation across ``step()`` calls: a re-run of the last call alone would lose
    the earlier micro-batches' gradients, so a call that takes no optimizer step is refused."""
    def train(model, run):
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)

        def micro(x, last):
            model(x, labels=x).loss.backward()
            if last:
                opt.step()
                opt.zero_grad(set_to_none=True)
        for i, x in enumerate(_ids()):
            run(micro, x, i == 1)

    with pytest.raises(RuntimeError, match="took no optimizer step.*run the whole window inside the function"):
        _rerun_against_reference(train)


def test_another_models_drops_inside_a_step_are_named():
    model = _model("qwen3_moe")
    mode = capacity_experts(model, 0.25, on_overflow="rerun")
    twin = copy.deepcopy(model)  # its own capacity mode
    opt = torch.optim.SGD(twin.parameters(), lr=1e-2)
    x = _ids(1)[0]

    def step():
        twin(x, labels=x).loss.backward()
        opt.step()
    with pytest.raises(CapacityOverflow, match=r"This step ran inside Qwen3MoeForCausalLM's CapacityMode\.step\(\), "
                                               r"and each model in 'rerun' mode re-runs only through its own"):
        mode.step(step)


def test_a_graphed_optimizer_of_checked_experts_is_refused_before_it_steps(capturing_torch, monkeypatch):
    import torch.optim.adam as adam  # a capturable AdamW over CPU tensors (the fake runtime's bookkeeping)
    from paddle_graphpp import GraphedOptimizer

    monkeypatch.setattr(adam, "_get_capturable_supported_devices", lambda *a, **k: ["cpu", "cuda"])
    model = _model("qwen3_moe")
    capacity_experts(model, EXPERTS / TOP_K)
    opt = GraphedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = _ids(1)[0]
    model(x, labels=x).loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"GraphedOptimizer: Qwen3MoeForCausalLM is in capacity mode with "
                                           r"on_overflow='raise'.*Nothing was stepped"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
