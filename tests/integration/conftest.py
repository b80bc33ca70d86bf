"""Fixtures of the worker tests: the HF model, the prompts with generate's reference outputs (computed
once per session), and a fresh ModelRunner per test."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from tests.integration.fake_engine import Prompt
from tests.integration.runner_support import KV_CACHE_TOKENS, reference_prompt
from workers.attention import ATTENTION_BACKENDS
from workers.model_runner import ModelRunner


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir) -> LlavaForConditionalGeneration:
    return LlavaForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def prompts(tiny_model_dir, hf_model) -> dict[str, Prompt]:
    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    rng = np.random.default_rng(0)
    cat, dog = (
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((240, 320), (300, 200))
    )
    contents = {
        "one": ([cat], "What is in this picture?"),
        "two": ([cat, dog], "Compare the two pictures."),
        "text": ([], "Tell me a story about a red car in the city, please."),
    }
    out = {}
    for name, (images, text) in contents.items():
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        chat = processor.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
        )
        inputs = processor(text=chat, images=images or None, return_tensors="pt")
        items = [{"pixel_values": p.unsqueeze(0)} for p in inputs["pixel_values"]] if images else []
        out[name] = reference_prompt(hf_model, inputs, items)
    return out


@pytest.fixture(params=ATTENTION_BACKENDS)
def runner(tiny_model_dir, request: pytest.FixtureRequest) -> ModelRunner:
    """One per attention backend: every parity test runs on each. The oracle runs fp32 on CPU."""
    return ModelRunner(
        str(tiny_model_dir), device="cpu", kv_cache_tokens=KV_CACHE_TOKENS, attention=request.param
    )
