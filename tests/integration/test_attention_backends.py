"""The attention backends against each other on the tiny LLaVA: the same logits for every token of
steps that mix prefill chunks through images, decodes and a resumed request (the Qwen families run the
same check in test_qwen_runner.py)."""

from __future__ import annotations

import pytest

from tests.integration.runner_support import KV_CACHE_TOKENS, assert_backends_agree

pytestmark = pytest.mark.slow


def test_backends_give_the_same_logits_on_mixed_steps(tiny_model_dir, hf_model, prompts):
    assert_backends_agree(str(tiny_model_dir), KV_CACHE_TOKENS, hf_model, prompts)
