"""Tiny causal LMs of the installed ``transformers``, built from their configs (no download).

``build(model_type)`` gives the class ``AutoModelForCausalLM`` maps ``model_type`` to, shrunk from
its config's defaults: fp32, every dropout 0, no cache, sliding windows shorter than the
sequences the tests use (so the window matters), Gemma's logit softcapping on, small expert
counts for mixtures of experts. ``OVERRIDES`` holds what a class needs beyond the shrinking.
"""

from __future__ import annotations

import functools
from typing import Any

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, head_dim=16, use_cache=False,
             tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)
WINDOW = 8  # sliding windows, shorter than the test sequences
_INKLING2 = dict(unpadded_vocab_size=128, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
                 moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2)
OVERRIDES: dict[str, dict] = {
    "inkling2_text": _INKLING2,
    "inkling2_loop_text": _INKLING2,
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


# Other names configs give the same sizes, set where a class's default config has them.
ALIASES = dict(n_embd=64, n_layer=4, n_head=4, n_positions=128, n_inner=64, d_model=64, num_layers=4,
               ffn_dim=64, ffn_hidden_size=64, num_experts=4, num_local_experts=4, n_routed_experts=4,
               moe_num_experts=4, num_experts_per_tok=2, moe_k=2, moe_intermediate_size=32,
               expert_intermediate_size=32, shared_expert_intermediate_size=32, moe_num_shared_experts=1,
               n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
               v_head_dim=16, rotary_dim=8, first_k_dense_replace=1, mamba_n_heads=4, mamba_d_head=32,
               mamba_d_state=16, mamba_chunk_size=16, mamba_n_groups=1, state_size=16, chunk_size=16, n_group=1, topk_group=1, num_kv_heads=2, n_kv_heads=2)
# Dropped one by one, in this order, where a config refuses them.
OPTIONAL = ("pad_token_id", "bos_token_id", "eos_token_id", "head_dim", "num_key_value_heads", "num_kv_heads",
            "n_kv_heads", "intermediate_size")


def config(model_type: str, **overrides: Any):
    """The tiny config of ``model_type`` (every float ``*dropout*``/``*pdrop`` field 0)."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type)
    aliases = {k: v for k, v in ALIASES.items() if k in vars(defaults) and k not in SMALL}
    kwargs = {**SMALL, **aliases, **OVERRIDES.get(model_type, {}), **overrides}
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k.endswith("_token_id")}
    dropped = list(OPTIONAL)
    while True:
        try:
            made = AutoConfig.for_model(model_type, **kwargs)
            break
        except Exception:  # noqa: BLE001 - a value this config refuses: build without it
            while dropped and dropped[0] not in kwargs:
                dropped.pop(0)
            if not dropped:
                raise
            kwargs.pop(dropped.pop(0))
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


# ----------------------------------------------------------------------------- the check
DOORS = ("graph_layers", "graph_model", "causal_lm_stage", "graph_step")
BATCH, SEQ, MICRO, STEPS = 2, 16, 2, 1  # the sequence is longer than WINDOW
MAX_PARAMETERS = 2_000_000  # a config the shrinking did not reach is skipped, not trained


class Outcome:
    """What one door did with one class: ``exact``, ``spread`` (within the model's own eager
    run-to-run difference), ``refused`` (at build, with the message; or, for blocks the model
    calls in an order no graph schedule replays, such as a loop over them, at the first backward
    with the engine's ``GraphScheduleError``; for a block given several tensors that carry a
    gradient, at its first forward with ``SignatureError``), ``skipped`` (the class does not build tiny, or the
    door does not apply), ``mismatch`` or ``error`` (failures)."""

    FAILURES = ("mismatch", "error")

    def __init__(self, kind: str, detail: str = ""):
        self.kind, self.detail = kind, detail

    @property
    def failed(self) -> bool:
        return self.kind in self.FAILURES

    def __repr__(self) -> str:
        return f"{self.kind}: {self.detail}" if self.detail else self.kind


def tiny(model_type: str):
    """The tiny model of ``model_type``, or an :class:`Outcome` saying why there is none."""
    import torch

    try:
        with torch.device("meta"):
            probe = build(model_type)
        count = sum(p.numel() for p in probe.parameters())
        if count > MAX_PARAMETERS:
            return Outcome("skipped", f"its tiny config still has {count / 1e6:.1f}M parameters")
        model = build(model_type)
    except Exception as exc:  # noqa: BLE001 - any class that does not build tiny is skipped, with why
        return Outcome("skipped", f"does not build from its shrunk config ({type(exc).__name__}: {_short(exc)})")
    needs = [n for n in ("pixel_values", "input_features", "decoder_input_ids") if n in _forward_params(model)]
    if needs or model.config.is_encoder_decoder:
        return Outcome("skipped", f"not a decoder-only text model (takes {needs or 'decoder inputs'})")
    return model


def _forward_params(model) -> set:
    import inspect

    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _short(exc: BaseException, n: int = 160) -> str:
    return " ".join(str(exc).split())[:n]


def _batches(vocab: int):
    import torch

    gen = torch.Generator().manual_seed(1)
    return [[torch.randint(0, vocab, (BATCH, SEQ), generator=gen) for _ in range(MICRO)] for _ in range(STEPS)]


def _train(model, forward, data, *, step_wrapper=None):
    """Losses per micro-batch, the first forward's logits, the first step's gradients and the
    parameters after the last step, training with ``forward(ids) -> (logits, loss)``."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    record = {"losses": [], "logits": None, "grads": None}
    torch.manual_seed(2)  # the same draws in every run (a router's jitter noise, a sampled expert)

    def step(batch):
        for ids in batch:
            logits, loss = forward(ids)
            if record["logits"] is None:
                record["logits"] = logits.detach().clone()
            loss.backward()
            record["losses"].append(loss.detach().clone())
        if record["grads"] is None:
            record["grads"] = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)

    run = step_wrapper(step, opt) if step_wrapper else step
    for batch in data:
        run(batch)
    record["params"] = [p.detach().clone() for p in model.parameters()]
    return record


def train_steps(model, data, run=None):
    """Losses per micro-batch and the parameters after training ``model`` (a causal LM) on
    ``data``, a list of steps of micro-batches of token ids, with AdamW; each step run by
    ``run(step, batch)`` (default: called), so that a caller can run it through something
    (``CapacityMode.step``). The same random draws in every run."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(2)
    losses = []

    def step(batch):
        out = []
        for ids in batch:
            loss = model(ids, labels=ids).loss
            loss.backward()
            out.append(loss.detach().clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    for batch in data:
        losses += run(step, batch) if run is not None else step(batch)
    return losses, [p.detach().clone() for p in model.parameters()]


def note_own_drops(mode) -> list:
    """A list that gets, at each check of the capacity mode ``mode`` (a ``CapacityMode``), the
    pairs this process's experts dropped, read before the check resets the counters (its
    ``overflows`` is wrapped for that)."""
    dropped = []
    original = mode.overflows

    def overflows(reset=False):
        found = original(reset)
        dropped.append(sum(found.values()))
        return found

    mode.overflows = overflows
    return dropped


def _difference(a: dict, b: dict) -> float:
    """The largest difference between two training records (inf where shapes or presence differ)."""
    import torch

    pairs = [(a["logits"], b["logits"]), *zip(a["losses"], b["losses"]), *zip(a["grads"], b["grads"]),
             *zip(a["params"], b["params"])]
    worst = 0.0
    for x, y in pairs:
        if x is None or y is None:
            if x is not y:
                return float("inf")
            continue
        if x.shape != y.shape:
            return float("inf")
        if not torch.equal(x, y):
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def _own(model, loss_function: bool = False):
    """The model's own forward; with ``loss_function``, its logits under ``model.loss_function``
    (the loss a pipeline's last stage computes from logits; a model's forward may compute another)."""
    def forward(ids):
        if loss_function:
            logits = model(ids).logits
            return logits, model.loss_function(logits=logits, labels=ids,
                                               vocab_size=model.config.get_text_config().vocab_size)
        out = model(ids, labels=ids)
        return out.logits, out.loss
    return forward


def check(model_type: str, doors=DOORS) -> dict:
    """``{door: Outcome}`` for ``model_type``: each door's training run against the model's own
    (on one CPU thread: these models are too small to gain from more, and lose much to them)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _check(model_type, doors)
    finally:
        torch.set_num_threads(threads)


def _check(model_type: str, doors) -> dict:
    import copy

    base = tiny(model_type)
    if isinstance(base, Outcome):
        return {door: base for door in doors}
    vocab = base.config.get_text_config().vocab_size
    data = _batches(vocab)
    try:
        first = copy.deepcopy(base)
        reference = _train(first, _own(first), data)
    except Exception as exc:  # noqa: BLE001 - the model's own training fails: nothing to compare with
        return {door: Outcome("skipped", f"its own training fails ({type(exc).__name__}: {_short(exc)})")
                for door in doors}
    spread = []  # the model's own run-to-run difference, measured when a door differs at all

    def own_spread() -> float:
        if not spread:
            second = copy.deepcopy(base)
            spread.append(_difference(reference, _train(second, _own(second), data)))
        return spread[0]

    references = {}

    def reference_for(door: str) -> dict:
        if door != "causal_lm_stage":
            return reference
        if door not in references:
            own = copy.deepcopy(base)
            references[door] = _train(own, _own(own, loss_function=True), data)
        return references[door]

    return {door: _door(door, base, data, reference_for(door), own_spread) for door in doors}


def _door(door: str, base, data, reference: dict, own_spread) -> Outcome:
    import copy

    from paddle_graphpp import GraphScheduleError
    from paddle_graphpp.core.errors import SignatureError
    from paddle_graphpp.torch import causal_lm_stage, graph_layers, graph_model, graph_step
    from paddle_graphpp.torch.hf import layout_of

    model = copy.deepcopy(base)
    wrapper = None
    try:  # building: what raises here is a refusal
        if door == "graph_layers":
            try:
                layout = layout_of(model)
            except TypeError as exc:
                return Outcome("skipped", f"no block list to pass ({_short(exc, 80)})")
            graph_layers(getattr(getattr(model, layout.base), layout.layers))
            forward = _own(model)
        elif door in ("graph_model", "graph_step"):
            graph_model(model)
            forward = _own(model)
            if door == "graph_step":
                wrapper = functools.partial(_graphed_step, graph_step)
        else:
            stages = [causal_lm_stage(model, s, 2) for s in range(2)]
            vocab = model.config.get_text_config().vocab_size

            def forward(ids):
                logits = stages[1](stages[0](ids))
                return logits, model.loss_function(logits=logits, labels=ids, vocab_size=vocab)
    except (TypeError, ValueError, NotImplementedError) as exc:
        return Outcome("refused", _short(exc))
    try:
        record = _train(model, forward, data, step_wrapper=wrapper)
    except GraphScheduleError as exc:  # blocks called in an order no schedule of graphs can replay
        return Outcome("refused", f"at the first backward: {_short(exc)}")
    except SignatureError as exc:  # a call a graphed block refuses before it runs (gradients in several inputs)
        return Outcome("refused", f"at the first forward: {_short(exc)}")
    except Exception as exc:  # noqa: BLE001 - a failure after building is the worst kind: recorded
        return Outcome("error", f"{type(exc).__name__}: {_short(exc)}")
    diff = _difference(reference, record)
    if diff == 0.0:
        return Outcome("exact")
    spread = own_spread()
    if diff <= spread:
        return Outcome("spread", f"{diff:.1e} <= eager's own {spread:.1e}")
    return Outcome("mismatch", f"max difference {diff:.3g} (eager's own {spread:.1e})")


def _graphed_step(graph_step, step, opt):
    return graph_step(step, optimizers=opt)


def model_types() -> list:
    """The causal-LM model types of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def markdown(results: dict) -> str:
    """The table ``results`` (``{model_type: {door: Outcome}}``) as markdown."""
    import transformers

    doors = list(next(iter(results.values())))
    lines = [f"transformers {transformers.__version__}; fp32, dropout 0, sequence {SEQ}, sliding windows of {WINDOW}; "
             f"{STEPS} AdamW steps of {MICRO} micro-batches against the model's own forward and backward.", "",
             "| model type | " + " | ".join(f"`{d}`" for d in doors) + " |", "|---" * (len(doors) + 1) + "|"]
    for name, row in results.items():
        lines.append(f"| {name} | " + " | ".join(repr(row[d]).replace("|", "/") for d in doors) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import argparse
    import warnings

    p = argparse.ArgumentParser(description="The zoo: every causal LM of the installed transformers, per door.")
    p.add_argument("--markdown", help="write the table there")
    p.add_argument("types", nargs="*", help="model types (default: all)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    results = {}
    for name in args.types or model_types():
        results[name] = check(name)
        print(name, results[name], flush=True)
    if args.markdown:
        from pathlib import Path

        Path(args.markdown).write_text(markdown(results))
    return int(any(o.failed for row in results.values() for o in row.values()))


if __name__ == "__main__":
    raise SystemExit(main())
