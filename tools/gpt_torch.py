"""The GPT of the demo trainer and the benchmarks, in PyTorch.

Token + position embeddings whose token table is tied to the output head, pre-norm transformer
blocks (causal self-attention and a 4x GELU MLP, each with residual dropout), a final norm and
the head. :func:`build_chunk` builds one pipeline chunk; every module is seeded by its position
in the whole model, so weights do not depend on how the model is split.

Attention is ``"explicit"`` (the score matrix is materialised: deterministic forward and
backward, so eager and graphed runs compare bit for bit) or ``"sdpa"``
(``scaled_dot_product_attention``, flash kernels on the GPU: the memory and speed of real
training at long sequences).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tools.gpt_shape import GPT3_1P3B, GPTShape

__all__ = ["GPTShape", "Embedding", "Head", "Block", "build_chunk", "GPT3_1P3B"]


class Embedding(nn.Module):
    """Token + position embeddings; the token table ``weight`` is tied to the output head."""

    def __init__(self, shape: GPTShape, tied: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(tied.clone())
        self.pos = nn.Parameter(torch.randn(shape.seq_len, shape.hidden) * 0.02)
        self.drop = nn.Dropout(shape.dropout)

    def forward(self, ids):
        return self.drop(F.embedding(ids, self.weight) + self.pos[: ids.shape[1]])


class Head(nn.Module):
    """Logits through the tied token table."""

    def __init__(self, tied: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(tied.clone())

    def forward(self, x):
        return F.linear(x, self.weight)


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each with residual dropout."""

    def __init__(self, shape: GPTShape):
        super().__init__()
        h = shape.hidden
        self.heads = shape.heads
        self.attention = shape.attention
        self.p = shape.dropout
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)
        self.drop = nn.Dropout(shape.dropout)
        if shape.attention == "explicit":
            mask = torch.ones(shape.seq_len, shape.seq_len, dtype=torch.bool).triu(1)
            self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.p if self.training else 0.0)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            att = att.masked_fill(self.mask[:t, :t], float("-inf")).softmax(-1)
            y = self.drop(att) @ v
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def build_chunk(shape: GPTShape, blocks: range, *, first: bool, last: bool, seed: int):
    """One pipeline chunk as ``nn.Sequential`` (embedding if ``first``, the blocks in ``blocks``,
    final norm and head if ``last``), and its tied module(s): the embedding, the head, both as a
    tuple when one chunk holds both ends, or ``None``."""
    gen = torch.Generator().manual_seed(seed)
    tied_init = torch.randn(shape.vocab, shape.hidden, generator=gen) * 0.02
    modules, tied = [], None
    if first:
        torch.manual_seed(seed + 1)
        tied = Embedding(shape, tied_init)
        modules.append(tied)
    for index in blocks:
        torch.manual_seed(seed + 100 + index)
        modules.append(Block(shape))
    if last:
        head = Head(tied_init)
        modules += [nn.LayerNorm(shape.hidden), head]
        tied = (modules[0], head) if first else head
    return nn.Sequential(*modules), tied
