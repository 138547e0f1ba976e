"""The GPT of the demo trainer, in Paddle, as fleet pipeline layers.

The same model as ``testing/gpt_torch.py`` (explicit attention only): token + position embeddings
whose token table is tied to the output head, pre-norm transformer blocks (causal
self-attention and a 4x GELU MLP, each with residual dropout), a final norm and the head. The
tie crosses stages through ``SharedLayerDesc("embed", EmbeddingPipe, ...)`` with
:func:`head_forward` as the head's forward. Every layer seeds Paddle's generator by its
position in the whole model, so weights do not depend on how the model is split.

Importing this module imports Paddle.
"""

from __future__ import annotations

import math

import paddle
import paddle.nn.functional as F
from paddle import nn

from testing.gpt_shape import GPTShape

__all__ = ["EmbeddingPipe", "head_forward", "Block", "LossPipe"]


def _normal() -> paddle.ParamAttr:
    return paddle.ParamAttr(initializer=nn.initializer.Normal(std=0.02))


class EmbeddingPipe(nn.Layer):
    """Token + position embeddings; the token table ``weight`` is shared with the head."""

    def __init__(self, shape: GPTShape, seed: int):
        super().__init__()
        paddle.seed(seed + 1)
        self.weight = self.create_parameter([shape.vocab, shape.hidden], attr=_normal())
        self.pos = self.create_parameter([shape.seq_len, shape.hidden], attr=_normal())
        self.drop = nn.Dropout(shape.dropout)

    def forward(self, ids):
        return self.drop(F.embedding(ids, self.weight) + self.pos[: ids.shape[1]])


def head_forward(embedding: EmbeddingPipe, x):
    """Logits through the tied token table (the ``forward_func`` of the head's ``SharedLayerDesc``)."""
    return paddle.matmul(x, embedding.weight, transpose_y=True)


class Block(nn.Layer):
    """Pre-norm causal self-attention and MLP, each with residual dropout; block ``index`` of the model."""

    def __init__(self, shape: GPTShape, index: int, seed: int):
        super().__init__()
        if shape.attention != "explicit":
            raise ValueError(f"the Paddle GPT has explicit attention only, got GPTShape.attention={shape.attention!r}")
        paddle.seed(seed + 100 + index)  # weights do not depend on pp/vpp
        h = shape.hidden
        self.heads = shape.heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)
        self.drop = nn.Dropout(shape.dropout)
        mask = paddle.triu(paddle.full([shape.seq_len, shape.seq_len], float("-inf")), 1)
        self.register_buffer("mask", mask, persistable=False)

    def forward(self, x):
        b, t, c = x.shape
        hd = c // self.heads
        qkv = self.qkv(self.ln1(x)).reshape([b, t, 3, self.heads, hd]).transpose([2, 0, 3, 1, 4])
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = paddle.matmul(q, k, transpose_y=True) * (1.0 / math.sqrt(hd)) + self.mask[:t, :t]
        y = paddle.matmul(self.drop(F.softmax(att, axis=-1)), v).transpose([0, 2, 1, 3]).reshape([b, t, c])
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class LossPipe(nn.Layer):
    """Mean next-token cross-entropy over ``vocab`` classes."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, logits, labels):
        return F.cross_entropy(logits.reshape([-1, self.vocab]), labels.reshape([-1, 1])).mean()
