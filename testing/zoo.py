"""Tiny causal LMs of the installed ``transformers``, built from their configs (no download).

``build(model_type)`` gives the class ``AutoModelForCausalLM`` maps ``model_type`` to, shrunk from
its config's defaults: fp32, every dropout 0, no cache, sliding windows shorter than the
sequences the tests use (so the window matters), Gemma's logit softcapping on, small expert
counts for mixtures of experts. ``OVERRIDES`` holds what a class needs beyond the shrinking.
"""

from __future__ import annotations

from typing import Any

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, head_dim=16, use_cache=False,
             tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)
WINDOW = 8  # sliding windows, shorter than the test sequences
OVERRIDES: dict[str, dict] = {
    "mistral": dict(sliding_window=WINDOW),
    "phi3": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    "gemma2": dict(sliding_window=WINDOW, final_logit_softcapping=30.0),
    "gemma3_text": dict(sliding_window=WINDOW, final_logit_softcapping=30.0, sliding_window_pattern=2),
    "gpt_oss": dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, head_dim=None),
    "gpt2": dict(n_embd=64, n_layer=4, n_head=4, n_positions=128),
}
# Attention kernels: sdpa where the class takes it, else eager (both deterministic on a CPU).
KERNELS = ("sdpa", "eager")


def config(model_type: str, **overrides: Any):
    """The tiny config of ``model_type`` (every float ``*dropout*``/``*pdrop`` field 0)."""
    from transformers import AutoConfig

    kwargs = {**SMALL, **OVERRIDES.get(model_type, {}), **overrides}
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k.endswith("_token_id")}
    made = AutoConfig.for_model(model_type, **kwargs)
    for name, value in list(vars(made).items()):
        if isinstance(value, float) and ("dropout" in name or name.endswith("pdrop")):
            setattr(made, name, 0.0)
    return made


def build(model_type: str, *, seed: int = 0, experts_implementation: str | None = None, **overrides: Any):
    """The tiny model of ``model_type``, fp32, its weights drawn from ``seed``."""
    import torch
    from transformers import AutoModelForCausalLM

    made = config(model_type, **overrides)
    extra = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    error = None
    for kernel in KERNELS:
        torch.manual_seed(seed)
        try:
            return AutoModelForCausalLM.from_config(made, attn_implementation=kernel, **extra)
        except (ValueError, ImportError) as exc:  # this class does not take the kernel (or the option)
            error = exc
    raise error


def blocks_of(model):
    """The model's list of decoder blocks."""
    from paddle_graphpp.torch.hf import layout_of

    layout = layout_of(model)
    return getattr(getattr(model, layout.base), layout.layers)
