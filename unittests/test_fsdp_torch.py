"""Graphed blocks under FSDP2 (``fully_shard``) on CPU: one gloo rank, the blocks running eagerly
(no CUDA), so what is checked here is the bookkeeping; that the graphs replay under FSDP2, equal
to FSDP2 eager, is unittests/gpu/test_fsdp_gpu.py.

* Graphed blocks (graphed before or after sharding) keep their unsharded storage from their first
  call on, and train exactly like the same FSDP2 model without graphs.
* ``unsharded_view`` sets the unsharded parameters where FSDP2 has the sharded ones, and puts
  those back.
* Layouts that cannot work are refused, naming the one that does.
"""
import socket

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from paddle_graphpp.core.errors import SignatureError  # noqa: E402
from paddle_graphpp.torch import CUDAGraphedModule, graph_layers  # noqa: E402
from paddle_graphpp.torch.integrations import fsdp as graphs_fsdp  # noqa: E402

pytestmark = pytest.mark.timeout(120)
VOCAB = 64


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def build():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1, use_cache=False)
    return LlamaForCausalLM(config)


def train(model, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    torch.manual_seed(2)
    for _ in range(steps):
        for _ in range(2):
            x = torch.randint(0, VOCAB, (2, 16), generator=g)
            loss = model(x, labels=x).loss
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.parametrize("order", ["graph_then_shard", "shard_then_graph"])
def test_graphed_blocks_under_fsdp2_keep_their_storage_and_train_like_fsdp2(order):
    ref = build()
    for block in ref.model.layers:
        fully_shard(block)
    fully_shard(ref)
    model = build()
    if order == "graph_then_shard":
        graph_layers(model.model.layers)
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    if order == "shard_then_graph":
        graph_layers(model.model.layers)
    with pytest.warns(RuntimeWarning, match="CUDA graphs are not used"):
        assert train(model) == train(ref)
    for block in model.model.layers:
        records = graphs_fsdp.fsdp_params(block)
        assert records and all(fp.free_unsharded_param is graphs_fsdp._keep_storage for fp in records)
        # resharded between steps, its unsharded storage still allocated
        assert type(block.self_attn.q_proj.weight).__name__ == "DTensor"
        assert all(fp._unsharded_param.untyped_storage().size() > 0 for fp in records)
    for block in ref.model.layers:
        assert all("free_unsharded_param" not in vars(fp) for fp in graphs_fsdp.fsdp_params(block))


def test_unsharded_view_sets_and_restores_the_parameters():
    model = build()
    graph_layers(model.model.layers)
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    with pytest.warns(RuntimeWarning):
        train(model, steps=1)
    block = model.model.layers[0]
    sharded = block.mlp.up_proj.weight
    unsharded = {id(fp._unsharded_param) for fp in graphs_fsdp.fsdp_params(block)}
    with graphs_fsdp.unsharded_view(block):
        assert {id(p) for p in block.parameters()} == unsharded
    assert block.mlp.up_proj.weight is sharded
    assert block.engine.layer.hooks.capture_view() is not None


def test_layouts_that_cannot_work_are_refused():
    model = build()
    fully_shard(model)  # the root only: the blocks hold the root's sharded parameters
    with pytest.raises(TypeError, match=r"sharded by an enclosing fully_shard\(\).*fully_shard\(\) on each graphed block"):
        graph_layers(model.model.layers)
    block = build().model.layers[0]
    fully_shard(block)
    with pytest.raises(TypeError, match="is an FSDP2 module.*Graph first, then shard"):
        CUDAGraphedModule(block)


def test_fsdp2_inside_a_block_or_only_around_it_is_refused_in_either_order():
    model = build()
    fully_shard(model.model.layers[0].mlp)  # an FSDP module inside the block
    with pytest.raises(TypeError, match=r"submodule mlp is an FSDP2 module.*on the graphed block itself"):
        graph_layers(model.model.layers)
    model = build()
    graph_layers(model.model.layers)
    fully_shard(model)  # only the root, after graphing: refused at the first call
    x = torch.randint(0, VOCAB, (2, 16))
    with pytest.raises(TypeError, match=r"sharded by an enclosing fully_shard\(\)"):
        model(x, labels=x)


def test_ungraph_layers_gives_fsdp2_its_storage_back_or_refuses():
    model = build()
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    graph_layers(model.model.layers)
    with pytest.warns(RuntimeWarning):
        train(model, steps=1)
    from paddle_graphpp.torch import ungraph_layers
    ungraph_layers(model.model.layers)
    assert all("free_unsharded_param" not in vars(fp)
               for block in model.model.layers for fp in graphs_fsdp.fsdp_params(block))
    assert all(type(b).__name__.startswith("FSDP") for b in model.model.layers)
    other = build()
    graph_layers(other.model.layers)
    for block in other.model.layers:
        fully_shard(block)
    with pytest.raises(TypeError, match="wrapped again after graph_layers"):
        ungraph_layers(other.model.layers)


def test_a_parameter_fsdp2_shards_given_to_a_graphed_block_is_refused():
    # Megatron's head handed the embedding's weight, the embedding under fully_shard: what FSDP2
    # hands over is not the parameter but a tensor its own autograd function makes (it frees and
    # gathers the storage around each use), an activation carrying a gradient beside the hidden
    # state, which graph_layers refuses before anything runs, whether FSDP2 reshards after the
    # forward or not.
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(VOCAB))

        def forward(self, hidden, weight):
            return hidden @ weight.t() + self.bias

    class TiedLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(VOCAB, 8)
            self.head = Head()

        def forward(self, tokens):
            return self.head(self.embedding(tokens), weight=self.embedding.weight)

    for reshard in (True, False):
        model = TiedLM()
        graph_layers([model.head], name="output_layer")
        fully_shard(model.embedding, reshard_after_forward=reshard)
        fully_shard(model.head)
        fully_shard(model)
        with pytest.raises(SignatureError, match=r"output_layer\.0: graph_layers\(\) takes blocks whose only input "
                                                 r"carrying a gradient is the hidden state; this call passes 2 "
                                                 r"\(argument 0, weight\)"):
            model(torch.randint(0, VOCAB, (2, 16)))
        assert model.head.engine.in_flight == 0
