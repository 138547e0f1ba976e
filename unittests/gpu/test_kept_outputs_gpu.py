"""Outputs a replay handed out, kept past a later replay that overwrites their graph memory.

A training loop keeps what a graphed call returned in many shapes: the output itself, its
``.detach()``, a slice, a ``.view(...)``, what a forward hook stored, a logged
``loss.detach()``. Each is compared, after several more steps of replays, with a clone taken
when it was returned. Each must equal it, or raise an error naming the layer and saying to
clone when read; never hold other values. Where torch can re-point a storage
(``UntypedStorage._swap_data_ptr_``) every one of them must equal it, and the output object
itself must always.

Cases: a ``CUDAGraphedModule`` whose one position replays again every step (the same
position's next launch overwrites it); blocks graphed with ``graph_layers`` under a
``f1 f2 b1 f3 b2 b3`` order, whose recorded step freed micro-batch 1's outputs after ``b1`` (the
graphs after that point may take their memory) while the replayed steps keep them through a
forward hook; ``graph_model`` on a tiny Hugging Face Llama with the loss logged detached.

Run on the GPU machine: ``python -m pytest unittests/gpu/test_kept_outputs_gpu.py -q``.
"""
import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires a CUDA device")

from paddle_graphpp.torch import CUDAGraphedModule, graph_layers  # noqa: E402
from paddle_graphpp.torch.memory.handout import views_keep_values  # noqa: E402

DEV = "cuda"
MICRO, STEPS, WIDTH = 4, 6, 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(nn.functional.gelu(self.fc1(self.norm(x)))))


def kept_forms(out, hooked):
    """What a loop keeps of ``out`` without a copy, by name (``hooked``: what a hook stored)."""
    return {"object": out, "detach": out.detach(), "slice": out[1:, 2:10], "view": out.view(-1), "hook": hooked}


def expected_forms(out):
    ref = out.detach().clone()
    return {"object": ref, "detach": ref, "slice": ref[1:, 2:10], "view": ref.view(-1), "hook": ref}


def check(kept, expected, layer):
    """Each kept tensor equals its expected value or raises naming ``layer``; how many raised
    per form (never the object itself, never any where torch can re-point storages)."""
    raised = {}
    for i, (forms, refs) in enumerate(zip(kept, expected)):
        for form, t in forms.items():
            try:
                same = torch.equal(t, refs[form])
            except RuntimeError as exc:
                text = str(exc)
                assert layer in text and "clone" in text.lower(), (i, form, text[:300])
                assert form != "object" and not views_keep_values(), (i, form, text[:300])
                raised[form] = raised.get(form, 0) + 1
                continue
            assert same, f"micro-batch {i}: the kept {form} holds other values than when it was returned"
    return raised


def test_what_a_loop_keeps_of_an_output_survives_the_next_replay_of_its_position():
    torch.manual_seed(0)
    graphed = CUDAGraphedModule(Block().to(DEV), num_warmup_steps=1)
    hooked = []
    graphed.register_forward_hook(lambda module, args, output: hooked.append(output.detach()))
    opt = torch.optim.SGD(graphed.parameters(), lr=1e-2)
    kept, expected = [], []
    for _ in range(STEPS):
        outs = []
        for _ in range(MICRO):  # all forwards, then all backwards: MICRO positions, each replayed every step
            y = graphed(torch.randn(8, WIDTH, device=DEV, requires_grad=True))
            kept.append(kept_forms(y, hooked[-1]))
            expected.append(expected_forms(y))
            outs.append(y)
        for y in outs:
            y.square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del outs, y
    torch.cuda.synchronize()
    counts = (graphed.engine.captures, graphed.engine.replays)  # MICRO positions, replayed from the third step
    assert counts == (2 * MICRO, 2 * MICRO * (STEPS - 2)), counts
    raised = check(kept, expected, graphed.engine.name)
    if not views_keep_values():  # torch 2.11: the forms other than the object raise once overwritten
        assert raised, "nothing kept was overwritten: the test saw no replay overwrite what it kept"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).square().mean()


def test_outputs_kept_past_their_recorded_release_point_survive_the_graphs_after_it():
    torch.manual_seed(0)
    net = Net().to(DEV)
    graph_layers(net.blocks, num_warmup_steps=1)
    keeping = {"on": False, "forms": []}

    def keep(module, args, output):
        if keeping["on"]:
            keeping["forms"].append((kept_forms(output, output.detach()), expected_forms(output)))

    net.blocks[1].register_forward_hook(keep)
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    kept, expected = [], []
    for step in range(STEPS):
        keeping["on"] = step >= 2  # warmup, then the recorded step without keeping: outputs die after b1
        losses = {}
        for tok in "f1 f2 b1 f3 b2 b3".split():
            n = int(tok[1:])
            if tok[0] == "f":
                losses[n] = net(torch.randn(8, 32, device=DEV))
            else:
                losses.pop(n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for forms, refs in keeping["forms"]:
            kept.append(forms)
            expected.append(refs)
        keeping["forms"].clear()
    torch.cuda.synchronize()
    engine = net.blocks[1].engine
    counts = (engine.captures, engine.replays)  # 3 positions, replayed from the third step
    assert counts == (2 * 3, 2 * 3 * (STEPS - 2)), counts
    check(kept, expected, engine.name)


def test_a_logged_loss_of_a_whole_model_graph_keeps_its_value():
    transformers = pytest.importorskip("transformers")
    from paddle_graphpp.torch import graph_model

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      attention_dropout=0.1, use_cache=False)
    model = graph_model(transformers.LlamaForCausalLM(config).to(DEV))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    logged, expected = [], []
    for _ in range(STEPS):
        for _ in range(MICRO):
            tokens = torch.randint(0, 256, (2, 32), generator=g).to(DEV)
            loss = model(tokens, labels=tokens).loss
            (loss / MICRO).backward()
            logged.append({"detach": loss.detach(), "view": loss.detach().view(1)})
            expected.append({"detach": loss.detach().clone(), "view": loss.detach().clone().view(1)})
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    engine = model._graphpp_whole.graphed._engine
    counts = (engine.captures, engine.replays)  # one position: the first step warms up and records
    assert counts == (2, 2 * MICRO * (STEPS - 1)), counts
    check(logged, expected, engine.name)
