"""The zoo: every causal LM of the installed transformers through each front door.

For each class whose tiny configuration builds (``testing/zoo.py``: fp32, dropout 0, sliding
windows shorter than the sequence, Gemma's softcapping, small mixtures of experts), each door
(``graph_layers``, ``graph_model``, ``causal_lm_stage`` as a two-stage chain, ``graph_step``)
trains an AdamW step of two micro-batches against the model's own forward and backward: the
first logits, every loss, every gradient and the parameters after the last step must be equal
bit for bit (or within the model's own eager run-to-run difference, where its kernels differ
between two runs), or the door must refuse the class when it is built, saying what to do. On
CPU the graphed parts run eagerly, so this checks what each door computes; graph capture of the
zoo is ``tools/bench_zoo.py`` on a GPU.

A few classes run in the fast suite; the rest are marked ``zoo`` (and ``slow``), which the
default run leaves out (``pyproject.toml``) and CI runs in a step of its own at both ends of the
supported transformers range: ``python -m pytest unittests/test_hf_zoo.py -m zoo``. The table:
``python -m testing.zoo --markdown docs/zoo.md``.
"""

import pytest
import torch  # noqa: F401  (the zoo needs torch; without it this module is skipped, not an error)

from testing import zoo

FAST = ("llama", "gpt2", "mistral", "gemma2", "qwen3_moe")


def check(model_type):
    row = zoo.check(model_type)
    print(model_type, row)
    failed = {door: outcome for door, outcome in row.items() if outcome.failed}
    assert not failed, f"{model_type}: {failed}"
    return row


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_type", FAST)
def test_representative_classes_are_exact_through_every_door(model_type):
    row = check(model_type)
    assert {outcome.kind for outcome in row.values()} <= {"exact", "spread"}, row


@pytest.mark.slow
@pytest.mark.zoo
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_type", [t for t in zoo.model_types() if t not in FAST])
def test_every_class_is_exact_or_refused_when_built(model_type):
    check(model_type)
