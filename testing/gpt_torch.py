"""The GPT that the tests, the demo trainer and the benchmarks run, in PyTorch.

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

from testing.gpt_shape import GPT3_1P3B, GPTShape

__all__ = ["GPTShape", "Embedding", "Head", "Block", "ParallelBlock", "build_chunk", "GPT3_1P3B"]


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
        self.head_dim = h // shape.heads
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
        b, t, _ = x.shape
        hd = self.head_dim
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.p if self.training else 0.0)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            att = att.masked_fill(self.mask[:t, :t], float("-inf")).softmax(-1)
            y = self.drop(att) @ v
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, self.heads * hd)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class ParallelBlock(nn.Module):
    """:class:`Block` split over a tensor-parallel group, Megatron-style: each rank holds
    ``heads / tp`` attention heads and ``1 / tp`` of the MLP's inner features.

    ``qkv`` and ``fc1`` are column-parallel (their input gradient is all-reduced in backward),
    ``proj`` and ``fc2`` row-parallel (their output is all-reduced in forward): two all-reduces
    per forward, two per backward, all through ``dispatcher`` (inside CUDA graphs, the captured
    custom kernel where it applies). Layer norms and residuals are replicated. Built from a
    dense :class:`Block`, so a tensor-parallel model computes what the dense one does (up to
    the order of the sums).

    Dropout draws from each rank's default generator: seed it the same on every rank of the
    group (replicated residual activations must get the same masks); attention dropout on the
    rank's heads then repeats the same pattern on every rank.
    """

    def __init__(self, dense: Block, dispatcher):
        super().__init__()
        from paddle_graphpp.torch.collectives.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        tp = dispatcher.backend.world_size
        h = dense.qkv.in_features
        if dense.heads % tp:
            raise ValueError(f"ParallelBlock: {dense.heads} heads do not split over a tensor-parallel group of {tp}; "
                             f"use a group size that divides the head count")
        self.heads = dense.heads // tp
        self.head_dim = dense.head_dim
        self.attention = dense.attention
        self.p = dense.p
        self.ln1, self.ln2, self.drop = dense.ln1, dense.ln2, dense.drop
        if dense.attention == "explicit":
            self.register_buffer("mask", dense.mask, persistent=False)
        w = dense.qkv.weight.detach()
        dtype = w.dtype
        # rows of qkv are (q|k|v, head, channel); regroup them rank-major, so that each rank's
        # contiguous shard holds q, k and v of its own heads
        order = lambda t: t.reshape(3, tp, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)  # noqa: E731
        self.qkv = ColumnParallelLinear(h, 3 * h, dispatcher=dispatcher, dtype=dtype).load_dense(
            order(w), order(dense.qkv.bias.detach()))
        self.proj = RowParallelLinear(h, h, dispatcher=dispatcher, dtype=dtype).load_dense(
            dense.proj.weight.detach(), dense.proj.bias.detach())
        self.fc1 = ColumnParallelLinear(h, 4 * h, dispatcher=dispatcher, dtype=dtype).load_dense(
            dense.fc1.weight.detach(), dense.fc1.bias.detach())
        self.fc2 = RowParallelLinear(4 * h, h, dispatcher=dispatcher, dtype=dtype).load_dense(
            dense.fc2.weight.detach(), dense.fc2.bias.detach())

    forward = Block.forward  # the same computation; views use the rank's head count


def build_chunk(shape: GPTShape, blocks: range, *, first: bool, last: bool, seed: int, tp=None):
    """One pipeline chunk as ``nn.Sequential`` (embedding if ``first``, the blocks in ``blocks``,
    final norm and head if ``last``), and its tied module(s): the embedding, the head, both as a
    tuple when one chunk holds both ends, or ``None``.

    ``tp``: an all-reduce dispatcher of a tensor-parallel group
    (:func:`paddle_graphpp.torch.collectives.allreduce.create_allreduce`); the blocks become
    :class:`ParallelBlock` shards of the same dense weights, embeddings and head stay replicated."""
    gen = torch.Generator().manual_seed(seed)
    tied_init = torch.randn(shape.vocab, shape.hidden, generator=gen) * 0.02
    modules, tied = [], None
    if first:
        torch.manual_seed(seed + 1)
        tied = Embedding(shape, tied_init)
        modules.append(tied)
    for index in blocks:
        torch.manual_seed(seed + 100 + index)
        block = Block(shape)
        modules.append(block if tp is None else ParallelBlock(block, tp))
    if last:
        head = Head(tied_init)
        modules += [nn.LayerNorm(shape.hidden), head]
        tied = (modules[0], head) if first else head
    return nn.Sequential(*modules), tied
