"""PaddleFormers 1.2.0's routers graphed in place, each reading its own copy of its mixture's input
(paddle_graphpp/paddle/own_input.py), with their shared experts where they have them, on CPU with
the fake runtime, against the same mixture trained eagerly: for GLM-4-MoE, DeepSeek-V3 and GPT-OSS
(their tiny configurations from paddleformers_zoo.py), the watched call and the parts' first
graphed call (their recorded step, computed through the graphed nodes), bit for bit; and the
router graphed reading the mixture's input itself, which sums that input's gradient in another
order where the mixture reads it three times or more. Prints one JSON line: per class, the parts graphed, their engines' captures after a
third call, and whether each compared call was equal.

Run by unittests/test_paddle_own_input.py in a process of its own: importing PaddleFormers
switches transformers' PyTorch support off for the whole process.
"""
import importlib
import json
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import numpy as np  # noqa: E402
import paddle  # noqa: E402

from fake_paddle_runtime import FakePaddleRuntime  # noqa: E402
from fake_runtime import serving  # noqa: E402
from paddleformers_zoo import CASES  # noqa: E402

from paddle_graphpp.core.options import EngineOptions  # noqa: E402
from paddle_graphpp.core.process import current_process  # noqa: E402
from paddle_graphpp.paddle.in_place import graphed_forward, swap_in  # noqa: E402
from paddle_graphpp.paddle.own_input import OwnInput  # noqa: E402

MIXTURES = {"glm4_moe": "Glm4MoeMoE", "deepseek_v3": "DeepseekV3MoE", "gpt_oss": "GptOssMLP"}
SHARED = {"glm4_moe": ("shared_experts",), "deepseek_v3": ("shared_experts",), "gpt_oss": ()}


def build(name):
    case = CASES[name]
    module = importlib.import_module(case.pipe_cls().__module__)
    paddle.seed(0)
    return getattr(module, MIXTURES[name])(case.build_config()), case.router


def train(block, inputs):
    got = []
    for x0 in inputs:
        x = x0.clone()
        x.stop_gradient = False
        out = block(paddle.tanh(x))  # the input has a producer, as the norm's output has
        out = out[0] if isinstance(out, (tuple, list)) else out
        (out * out).mean().backward()
        got.append([x.grad.numpy().copy()] + [p.grad.numpy().copy() for p in block.parameters()
                                              if p.grad is not None])
        block.clear_gradients()
    return got


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(u, v) for u, v in zip(a, b))


def graphed(name, copy):
    """The mixture with its router and shared experts graphed in place, each reading its own copy
    of the input (``copy``), or its router alone reading the mixture's input itself: the parts'
    engines and the OwnInput (or None)."""
    block, router_name = build(name)
    names = (router_name, *SHARED[name]) if copy else (router_name,)
    parts = []
    for part_name in names:
        part = getattr(block, part_name)
        layer = graphed_forward(f"{name}.{part_name}", part, options=EngineOptions(num_warmup_steps=0))
        swap_in(part, layer)
        parts.append((part_name, part, layer))
    own = OwnInput(block, block, parts) if copy else None
    return block, [layer for _, _, layer in parts], own


def check(name):
    eager, _ = build(name)
    hidden = eager.config.hidden_size if hasattr(eager, "config") else eager.router.hidden_dim
    paddle.seed(1)
    inputs = [paddle.randn([2, 8, hidden]) for _ in range(3)]
    want = train(eager, inputs[:2])
    rt = FakePaddleRuntime()
    current_process().reset(rt.name)
    with serving(rt, "paddle"):
        block, layers, own = graphed(name, copy=True)
        got = train(block, inputs[:2])  # the watched call, then the parts' recorded steps
        train(block, inputs[2:])  # the captures
        result = {"graphed": [own.parts[i][0] for i in own.graphed_parts],
                  "captures": [layer.engine.captures for layer in layers],
                  "watched_equal": same(want[0], got[0]), "graphed_equal": same(want[1], got[1])}
        block, _, _ = graphed(name, copy=False)  # the router's recorded step, reading the mixture's input
        result["without_copy_equal"] = same(want[0], train(block, inputs[:1])[0])
    current_process().reset(rt.name)
    return result


def main():
    warnings.filterwarnings("ignore")
    print(json.dumps({name: check(name) for name in MIXTURES}))


if __name__ == "__main__":
    main()
