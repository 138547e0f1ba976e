"""The shape of the GPT that the tests, the demo trainer and the benchmarks run, for both frameworks.

:class:`GPTShape` is what :mod:`testing.gpt_torch` and the trainer's Paddle GPT
(``tools/gpt_paddle.py``) build from; this module imports neither framework.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ATTENTION", "GPTShape", "GPT3_1P3B"]

ATTENTION = ("explicit", "sdpa")


@dataclass(kw_only=True, frozen=True, slots=True)
class GPTShape:
    """The model's shape; validated on construction."""

    hidden: int
    """Model width."""
    heads: int
    """Attention heads; ``hidden`` must be a multiple."""
    vocab: int
    """Token table rows (tied to the output head)."""
    seq_len: int
    """Longest sequence (position table rows, causal mask size)."""
    layers: int
    """Transformer blocks in the whole model."""
    dropout: float = 0.0
    """Dropout in the embeddings, on attention probabilities and on both residual branches."""
    attention: str = "explicit"
    """``"explicit"`` (the score matrix materialised: deterministic, so eager and graphed runs
    compare bit for bit) or ``"sdpa"`` (``scaled_dot_product_attention``; PyTorch only)."""

    def __post_init__(self):
        for name in ("hidden", "heads", "vocab", "seq_len", "layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"GPTShape: hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.attention not in ATTENTION:
            raise ValueError(f"GPTShape.attention must be one of {ATTENTION}, got {self.attention!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTShape.dropout must be in [0, 1), got {self.dropout}")


#: GPT-3 1.3B (hidden 2048, 24 layers, 16 heads, vocab 50304) at sequence length 2048.
GPT3_1P3B = GPTShape(hidden=2048, heads=16, vocab=50304, seq_len=2048, layers=24, dropout=0.1, attention="sdpa")
