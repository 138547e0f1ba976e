"""The zoo of PaddleFormers 1.2.0 pipe classes, as tiny CPU models: one table for the worker
(``paddleformers_worker.py --model NAME`` builds from it) and for the tests
(``test_paddleformers_zoo.py`` parametrizes over it, ``test_paddleformers_pipe.py`` runs Llama).

Each :class:`PipeCase` names the class, the tiny configuration (hidden 64, 4 heads, 2 key/value
heads, vocab 96), the settings the class needs to build and train on CPU, and, for a class that
does not train eagerly at pp=2 on CPU, why. docs/paddle.md renders the same facts for users.
Importing this module imports neither Paddle nor PaddleFormers (importing PaddleFormers switches
transformers' PyTorch support off for the whole process).
"""

import math
from dataclasses import dataclass, field

VOCAB, HIDDEN, SEQ = 96, 64, 8

# Every case: the shape, and the one setting every class needs on CPU.
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64,
              fuse_rms_norm=False)  # the fused RMSNorm kernel has no CPU build
# MoE cases: 4 experts, 2 per token, small experts.
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
# The pipe builds its decoder layers as a class named DecoderLayerPipe; where the config's default
# seg method names the model's own decoder class (ERNIE 4.5, GPT-OSS), fleet finds no layer to
# cut at ("weight_idxs' length should be greater than 0").
SEG = dict(pp_seg_method="layer:DecoderLayer|EmptyLayer")


@dataclass(frozen=True)
class PipeCase:
    """One pipe class of ``paddleformers.transformers`` and how to train it on CPU."""

    name: str
    """``--model NAME`` of the worker; the test ids."""
    pipe_class: str
    """The class's name in :attr:`module`."""
    config: dict = field(default_factory=dict)
    """Configuration beyond :data:`COMMON` (these win), passed to the class's ``config_class``."""
    layers: int = 4
    """Decoder layers (two per stage at pp=2)."""
    tie: bool = True
    """Whether tied embeddings (``tie_word_embeddings=True``) build and train."""
    labels_as_tuple: bool = False
    """The class's criterion reads ``labels[0]``: ``train_batch`` gets ``[x, (y,)]``."""
    not_trainable: str = ""
    """Why the class does not train eagerly at pp=2 on CPU; empty where it does."""
    module: str = "paddleformers.transformers"
    """Where the class is (two ``...PipeDeprecated`` classes are not exported by the package)."""
    router: str = ""
    """A mixture of experts: the name of its router beside its experts (``gate``, ``router``); each
    such decoder layer is graphed in parts (its attention in place); empty for a dense model."""
    dense_layers: int = 0
    """A mixture of experts: its leading dense decoder layers (``first_k_dense_replace``), graphed whole."""
    linear_router: bool = False
    """A mixture of experts whose router is a lone linear layer (its top-k in the mixture's own
    forward), left eager; any other router is graphed in place, reading its own copy of the input."""

    def pipe_cls(self):
        """The class (imports PaddleFormers, with paddleformers_cpu's stand-ins for paddlefleet;
        in the worker, whose folder is on ``sys.path``)."""
        import importlib

        from paddleformers_cpu import stand_in_for_paddlefleet

        stand_in_for_paddlefleet()
        return getattr(importlib.import_module(self.module), self.pipe_class)

    def build_config(self, *, layers=None, tie=None, vpp=1):
        """The class's config object."""
        kwargs = {**COMMON, **self.config, "num_hidden_layers": layers or self.layers,
                  "tie_word_embeddings": self.tie if tie is None else bool(tie)}
        config = self.pipe_cls().config_class(**kwargs)
        config.virtual_pipeline_model_parallel_size = vpp
        return config


# Settings a class needs beyond COMMON are commented where they appear (docs/paddle.md lists them).
# Qwen2/3, Qwen2/3-MoE, GLM-4-MoE, Qwen3-Next and DeepSeek-V3: their modules import paddlefleet
# (or paddlefleet_ops) at the top; pipe_cls() puts paddleformers_cpu.py's stand-ins in place.
CASES = {case.name: case for case in (
    PipeCase("llama", "LlamaForCausalLMPipe"),
    PipeCase("qwen2", "Qwen2ForCausalLMPipeDeprecated"),
    PipeCase("qwen3", "Qwen3ForCausalLMPipeDeprecated", dict(head_dim=16)),
    PipeCase("qwen2_moe", "Qwen2MoeForCausalLMPipeDeprecated",
             dict(**MOE, num_experts=4, shared_expert_intermediate_size=64), router="gate", linear_router=True),
    # qwen3_moe and glm4_moe: the package does not export their ...PipeDeprecated classes
    PipeCase("qwen3_moe", "Qwen3MoeForCausalLMPipeDeprecated", dict(**MOE, num_experts=4, head_dim=16),
             module="paddleformers.transformers.qwen3_moe.modeling", router="gate", linear_router=True),
    PipeCase("glm4_moe", "Glm4MoeForCausalLMPipeDeprecated",
             dict(**MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1),
             module="paddleformers.transformers.glm4_moe.modeling", router="gate", dense_layers=1),
    PipeCase("qwen3_next", "Qwen3NextForCausalLMPipe",  # 3 linear-attention (gated delta) layers, 1 full
             dict(**MOE, num_experts=4, shared_expert_intermediate_size=32, head_dim=16, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4), router="gate",
             linear_router=True),
    PipeCase("ernie4_5", "Ernie4_5ForCausalLMPipe", dict(**SEG, head_dim=16)),
    PipeCase("ernie4_5_moe", "Ernie4_5_MoeForCausalLMPipe",
             dict(**SEG, head_dim=16, moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
                  moe_group="dummy",  # the default "mp" asserts sequence_parallel
                  num_nextn_predict_layers=0),
             not_trainable="its MoE layer calls paddle.incubate.nn.functional.expand_modality_expert_id, whose "
                           "kernel has no CPU build (\"The kernel `expand_modality_expert_id` is not registered\")"),
    PipeCase("gemma3", "Gemma3ForCausalLMPipe", dict(head_dim=16, query_pre_attn_scalar=16)),
    PipeCase("phi3", "Phi3ForCausalLMPipe"),
    PipeCase("deepseek_v3", "DeepseekV3ForCausalLMPipe",
             dict(**MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                  kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                  # its attention reads rope_parameters["factor"] (KeyError without)
                  rope_scaling={"rope_type": "default", "factor": 1.0}),
             labels_as_tuple=True, router="gate", dense_layers=1,
             tie=False),  # tied: "'DeepseekV3LMHeadPipe' object has no attribute 'embedding_weight'"
    PipeCase("gpt_oss", "GptOssForCausalLMPipe", dict(**SEG, num_local_experts=4, num_experts_per_tok=2, head_dim=16),
             router="router"),
)}

# PaddleFormers 1.2.0's other pipe classes, and why the zoo leaves them out.
NOT_COVERED = {
    **dict.fromkeys(
        ("Qwen2ForCausalLMPipe", "Qwen3ForCausalLMPipe", "Qwen2MoeForCausalLMPipe", "Qwen3MoeForCausalLMPipe",
         "Glm4MoeForCausalLMPipe", "DeepseekV32ForCausalLMPipe", "DeepseekV4ForCausalLMPipe",
         "GlmMoeDsaForCausalLMPipe", "KimiK2ForCausalLMPipe", "MiniMaxM2ForCausalLMPipe"),
        "built by paddlefleet's model providers; paddlefleet is not on the package index"),
    "Ernie4_5_VLMoeForConditionalGenerationPipe": "vision-language; its MoE needs expand_modality_expert_id "
                                                  "(no CPU kernel), as ERNIE 4.5 MoE",
    "AutoModelForCausalLMPipe": "a factory for the classes above",
    "AutoModelForConditionalGenerationPipe": "a factory (vision-language models)",
}


def case(name: str) -> PipeCase:
    if name not in CASES:
        raise SystemExit(f"unknown --model {name!r}; known: {', '.join(CASES)}")
    return CASES[name]


# --------------------------------------------------------------------------- test side
ROUTES = ("eager", "graph_pipeline", "install")
# How a segmentation report shows PaddleFormers' tied embedding and head (kept eager).
SHARED = "shared:model_shared_weight: shared weights (gradients synced across stages)"


def check_routes_agree(results: dict, nranks: int, steps: int, micro: int) -> None:
    """The worker's results of every rank: the same per-step losses through every route (and no
    NaN), the same state_dict keys, parameter names unchanged by ``graph_pipeline``, every graphed
    run called once per micro-batch, and both graphed routes segmenting alike."""
    assert sorted(results) == list(range(nranks))
    reference = results[0]["eager"]["losses"]
    assert len(reference) == steps and not any(math.isnan(loss) for loss in reference)
    for rank, data in results.items():
        eager = data["eager"]
        for route in ROUTES:
            assert data[route]["losses"] == reference, f"rank {rank} {route}: {data[route]['losses']} != {reference}"
            assert data[route]["state_dict_keys"] == eager["state_dict_keys"], f"rank {rank} {route}: keys differ"
        assert data["graph_pipeline"]["names_before"] == data["graph_pipeline"]["names_after"]
        for route in ROUTES[1:]:
            calls, names = data[route]["graphed_calls"], data[route]["graphed_names"]
            # every graphed run took part in every micro-batch of every step; a router and shared
            # experts graphed in place from the first forward after the first micro-batch's backward
            # (own_input.py)
            routers = {key for key in calls
                       if names[int(key)].endswith((".mlp.gate", ".mlp.router", ".mlp.shared_experts"))}
            assert calls and {calls[key] for key in calls if key not in routers} == {steps * micro}, \
                f"rank {rank} {route}: {calls}"
            assert all(steps * micro - micro <= calls[key] < steps * micro for key in routers), \
                f"rank {rank} {route}: {calls}"
            assert data[route]["report"] == data["graph_pipeline"]["report"]
