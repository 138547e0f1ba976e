"""Test support: PaddleFormers 1.2.0 on CPU ranks, around its own defects.

Not part of paddle_graphpp: the library never changes PaddleFormers.

:func:`stand_in_for_paddlefleet` (the pipe-model worker, ``paddleformers_worker.py``, calls it
before importing a pipe class) lets the modules of Qwen2/3, Qwen2/3-MoE, GLM-4-MoE and
DeepSeek-V3 import without paddlefleet, which the package index does not have:

* ``qwen2``, ``qwen3``, ``qwen2_moe``, ``qwen3_moe`` and ``glm4_moe``'s ``modeling.py`` import
  ``transformers/gpt_provider.py`` at the top, which raises ``ImportError: paddlefleet is required
  for gpt_provider``; only their paddlefleet classes (``Qwen2ForCausalLMPipe``, ...) use it, to
  subclass ``GPTModelProvider``. Stand-in: a ``gpt_provider`` module whose ``GPTModelProvider``
  (with the empty ``transform_rules`` that ``glm4_moe`` extends) refuses to provide a model, with
  that message; the ``...PipeDeprecated`` classes never call it.
* ``qwen3_moe`` and ``deepseek_v3`` reach ``transformers/fused_a2a.py``, which imports
  ``is_deep_ep_available`` from ``paddlefleet_ops`` (not on the index either). Stand-in: a
  ``paddlefleet_ops`` whose ``is_deep_ep_available()`` is False, the module's own path without
  DeepEP.

The Trainer test
(``unittests/test_paddleformers_trainer.py``, through ``paddleformers_trainer_worker.py``) calls
:func:`work_around_trainer_defects` once per process before building a ``Trainer``. Each
work-around is for a defect seen in PaddleFormers 1.2.0 with Paddle 3.3.1 (CPU wheel, gloo, pp=2),
none of which the project's code causes:

* fp32 gradient clipping under pipeline parallelism: ``Trainer._wrap_distributed_optimizer``
  reads ``self.optimizer._inner_opt._grad_clip`` (trainer.py:3638) on the optimizer *before*
  fleet wrapped it; only ``MixPrecisionOptimizer`` (``amp_master_grad=True``, which needs fp16 or
  bf16) has ``_inner_opt``, so ``max_grad_norm > 0`` in fp32 fails with
  ``'AdamW' object has no attribute '_inner_opt'``. This affects GPU runs in fp32 as well.
  Work-around: the optimizer the Trainer creates names itself as its own ``_inner_opt``, so
  that line reaches the same ``_grad_clip`` fleet's optimizer holds.
* With ``gradient_accumulation_steps > 1`` the Trainer calls ``paddle.device.synchronize()``
  before scaling the gradients (trainer.py:2463); a CPU build raises
  ``TypeError: device should be gpu, xpu, ...`` there. Work-around (CPU builds only): that call
  does nothing, which is what synchronising a CPU's work means.

``amp_master_grad=False`` without fp16/bf16 is an argument, not a work-around: the Trainer
refuses its own default otherwise (docs/paddle.md lists what a CPU run needs).
"""

import importlib.util
import sys
import types

import paddle

_DONE = False
_PADDLEFLEET = "paddlefleet is required for gpt_provider (PaddleFormers' paddlefleet models); it is not installed"


def stand_in_for_paddlefleet() -> None:
    """Put the two stand-ins above in ``sys.modules`` where paddlefleet is not installed
    (idempotent; call before importing PaddleFormers' model modules)."""
    provider_name = "paddleformers.transformers.gpt_provider"
    if provider_name not in sys.modules and importlib.util.find_spec("paddlefleet") is None:
        provider = types.ModuleType(provider_name)

        class GPTModelProvider:
            """Stand-in: the paddlefleet models cannot be built without paddlefleet."""

            transform_rules = {}  # glm4_moe's provider extends it at class definition

            @classmethod
            def from_config(cls, *args, **kwargs):
                raise ImportError(_PADDLEFLEET)

        provider.GPTModelProvider = GPTModelProvider
        sys.modules[provider_name] = provider
    if "paddlefleet_ops" not in sys.modules and importlib.util.find_spec("paddlefleet_ops") is None:
        ops = types.ModuleType("paddlefleet_ops")
        ops.is_deep_ep_available = lambda: False
        sys.modules["paddlefleet_ops"] = ops


def work_around_trainer_defects() -> None:
    """Apply the two work-arounds above in this process (idempotent)."""
    global _DONE
    if _DONE:
        return
    from paddleformers.trainer import Trainer

    create_optimizer = Trainer.create_optimizer

    def create_optimizer_with_inner_opt(self, *args, **kwargs):
        optimizer = create_optimizer(self, *args, **kwargs)
        if not hasattr(optimizer, "_inner_opt"):
            optimizer._inner_opt = optimizer  # trainer.py:3638 reads it on the unwrapped optimizer
        return optimizer

    Trainer.create_optimizer = create_optimizer_with_inner_opt
    if not (paddle.is_compiled_with_cuda() or paddle.is_compiled_with_xpu()):
        paddle.device.synchronize = lambda device=None: None
    _DONE = True
