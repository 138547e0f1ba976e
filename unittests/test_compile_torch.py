"""``compile=`` on the graphed PyTorch layers, and ``torch.compile`` around graphed layers (CPU).

Without CUDA the graphed layers run eagerly through the engine, so these tests check what CPU
can show: the option's validation and its errors, that compiled blocks run compiled through the
engine (dynamo compiles them, once for blocks of one class) and train like eager, that
``torch.compile`` of a model holding graphed blocks and ``block.compile()`` before
``graph_layers`` run and train like eager, and that a recompile under the capture stance is
refused with dynamo's reason. Capture and replay of compiled code are checked on GPUs
(``unittests/gpu/test_compile_gpu.py``). Most tests use the ``aot_eager`` backend (AOTAutograd
without Inductor: eager numerics, fast); one runs Inductor's CPU backend.
"""
import copy
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from paddle_graphpp.torch import CUDAGraphedModule, graph_layers, graph_stage_module, ungraph_layers
from paddle_graphpp.torch.compile import compile_options, no_compile_in_capture
from paddle_graphpp.torch.runtime import RUNTIME

AOT = {"backend": "aot_eager"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA graphs are not used.*")
        yield
    torch._dynamo.reset()


class Block(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x, scale=1.0):
        return x + scale * self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Body(nn.Module):
    def __init__(self, blocks, width):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h


class Model(nn.Module):
    """Laid out as Hugging Face's causal LMs are: the block loop in an inner module, the head outside."""

    def __init__(self, blocks=3, width=16):
        super().__init__()
        self.body = Body(blocks, width)
        self.head = nn.Linear(width, 3)

    @property
    def blocks(self):
        return self.body.blocks

    def forward(self, x):
        return torch.tanh(self.head(self.body(x)))


def train(model, steps=3, micro_batches=2, seed=0):
    """Losses and final gradients of a few accumulated steps with SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        for _ in range(micro_batches):
            x, y = torch.randn(5, 4, generator=gen), torch.randn(5, 3, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss.detach())
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    return torch.stack(losses), grads


def pair(blocks=3):
    torch.manual_seed(0)
    model = Model(blocks)
    return model, copy.deepcopy(model)


def assert_trains_alike(a, b):
    (la, ga), (lb, gb) = train(a), train(b)
    assert torch.allclose(la, lb, rtol=1e-5, atol=1e-6), (la, lb)
    for x, y in zip(ga, gb):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- option
def test_the_option_is_checked_with_the_layer_named_and_the_fix():
    assert compile_options(None, "L") is None and compile_options(False, "L") is None
    assert compile_options(True, "L") == {} and compile_options({"dynamic": False}, "L") == {"dynamic": False}
    with pytest.raises(TypeError, match="L: compile must be True, False or a dict"):
        compile_options("inductor", "L")
    with pytest.raises(ValueError, match=r"L: compile=\{...\} has \['fullgraf'\].*use some of"):
        compile_options({"fullgraf": True}, "L")
    for bad in ({"mode": "reduce-overhead"}, {"mode": "max-autotune"}, {"backend": "cudagraphs"},
                {"options": {"triton.cudagraphs": True}}):
        with pytest.raises(ValueError, match="L: .*Inductor's own CUDA graphs.*max-autotune-no-cudagraphs"):
            compile_options(bad, "L")
    with pytest.raises(ValueError, match=r"blk: compile=\{'mode': 'reduce-overhead'\}"):
        CUDAGraphedModule(Block(), compile={"mode": "reduce-overhead"}, name="blk")
    with pytest.raises(ValueError, match=r"graph_layers\(\): compile=\{'mode': 'reduce-overhead'\}"):
        graph_layers(Model().blocks, compile={"mode": "reduce-overhead"})
    with pytest.raises(ValueError, match=r"graph_stage_module\(stage\): compile=\{'mode': 'reduce-overhead'\}"):
        graph_stage_module(nn.Sequential(Block()), compile={"mode": "reduce-overhead"})


def test_modules_compiled_with_inductor_graphs_or_twice_are_refused():
    with pytest.raises(ValueError, match=r"blk: the module was compiled with mode='reduce-overhead'"):
        CUDAGraphedModule(torch.compile(Block(), mode="reduce-overhead"), name="blk")
    with pytest.raises(ValueError, match="blk: the module is compiled already.*compile="):
        CUDAGraphedModule(torch.compile(Block()), compile=True, name="blk")
    model = Model()
    model.blocks[1].compile(mode="reduce-overhead")
    with pytest.raises(ValueError, match=r"Block\[1\]: the module was compiled with mode='reduce-overhead'"):
        graph_layers(model.blocks)
    assert not any(hasattr(b, "engine") for b in model.blocks)  # nothing changed


# --------------------------------------------------------------------- compiled blocks
def test_compiled_blocks_run_compiled_once_per_class_and_train_like_eager():
    eager, compiled = pair(blocks=12)  # more blocks than dynamo's recompile limit (8)
    graph_layers(compiled.blocks, compile=AOT)
    assert_trains_alike(eager, compiled)
    assert counters["stats"]["unique_graphs"] == 1  # the twelve blocks share one compiled entry
    assert not counters["recompiles"] if "recompiles" in counters else True


def test_a_compiled_graphed_module_and_a_compiled_stage_train_like_eager():
    eager, compiled = pair()
    compiled.blocks[0] = CUDAGraphedModule(compiled.blocks[0], compile=AOT)
    assert_trains_alike(eager, compiled)
    assert counters["stats"]["unique_graphs"] >= 1
    assert [n for n, _ in compiled.named_parameters()] == [
        n.replace("blocks.0.", "blocks.0.module.") for n, _ in eager.named_parameters()]
    assert not any("_orig_mod" in n or "CompiledModule" in n for n, _ in compiled.named_modules())

    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(4, 16), *[Block() for _ in range(3)], nn.Linear(16, 3))
    reference = copy.deepcopy(stage)
    graphed = graph_stage_module(stage, compile=AOT)
    (la, ga), (lb, gb) = train(reference), train(graphed)
    assert torch.allclose(la, lb) and all(torch.allclose(x, y) for x, y in zip(ga, gb))


def test_torch_compile_around_graphed_blocks_runs_them_as_a_boundary():
    eager, model = pair()
    graph_layers(model.blocks)
    compiled = torch.compile(model, backend="aot_eager")
    assert_trains_alike(eager, compiled)
    assert all(b.engine.in_flight == 0 for b in model.blocks)  # the engine ran, not a trace of it
    # The head compiles; the frame holding the block loop runs eagerly (dynamo skips a frame whose
    # loop holds a graph break), and each graphed block is called as it is.
    assert counters["stats"]["unique_graphs"] >= 1


def test_block_compile_before_graph_layers_runs_compiled_inside_and_ungraph_gives_it_back():
    eager, model = pair()
    for block in model.blocks:
        block.compile(backend="aot_eager")
    graph_layers(model.blocks)
    assert all(b._compiled_call_impl is None for b in model.blocks)
    assert_trains_alike(eager, model)
    assert counters["stats"]["unique_graphs"] == 1  # compiled inside the engine, once for the class
    ungraph_layers(model.blocks)
    assert all(b._compiled_call_impl is not None for b in model.blocks)


@pytest.mark.slow
def test_inductor_compiled_blocks_under_torch_compile_train_like_eager():
    eager, model = pair()
    graph_layers(model.blocks, compile=True)  # Inductor's CPU backend
    compiled = torch.compile(model)
    (la, ga), (lb, gb) = train(eager), train(compiled)
    assert torch.allclose(la, lb, rtol=1e-4, atol=1e-5)
    assert all(torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(ga, gb))


# ----------------------------------------------------------------------- the capture stance
def test_inside_a_capture_a_recompile_raises_with_dynamos_reason_and_the_hint_names_the_fix():
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    fn(torch.ones(3))
    with no_compile_in_capture():
        fn(torch.ones(3))  # what was compiled runs
        with pytest.raises(RuntimeError, match="fail_on_recompile") as info:
            fn(torch.ones(5))
    assert "size" in str(info.value)  # dynamo's guard failure: the shape changed
    hint = RUNTIME.capture_failure_hint(info.value, ())
    assert "compiled anew inside the capture" in hint and "shapes" in hint


# ------------------------------------------------------------------ Hugging Face models
@pytest.mark.parametrize("order", ["graph_then_compile_model", "block_compile_then_graph", "compile_option"])
def test_hugging_face_llama_trains_like_eager_in_every_order(order):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      use_cache=False)
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(config)
    model = copy.deepcopy(eager)
    if order == "graph_then_compile_model":
        graph_layers(model.model.layers)
        run = torch.compile(model, backend="aot_eager")
    elif order == "block_compile_then_graph":
        for block in model.model.layers:
            block.compile(backend="aot_eager")
        graph_layers(model.model.layers)
        run = model
    else:
        graph_layers(model.model.layers, compile=AOT)
        run = model
    tokens = torch.randint(0, 64, (4, 2, 9), generator=torch.Generator().manual_seed(1))
    for m in (eager, run):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m.losses = []
        for batch in tokens:
            loss = m(input_ids=batch, labels=batch).loss
            loss.backward()
            m.losses.append(loss.item())
        opt.step()
    assert run.losses == pytest.approx(eager.losses, rel=1e-5)
    for (n, a), b in zip(eager.named_parameters(), model.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), n
    assert counters["stats"]["unique_graphs"] >= 1
