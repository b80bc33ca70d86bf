"""Fixtures of the worker tests: the HF model, the prompts with generate's reference outputs (computed
once per session), and a fresh ModelRunner per test."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from tests.integration.fake_engine import Prompt
from tests.integration.runner_support import KV_CACHE_TOKENS, NUM_NEW_TOKENS, placements
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
        with torch.no_grad():
            generated = hf_model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=NUM_NEW_TOKENS,
                min_new_tokens=NUM_NEW_TOKENS,
                output_logits=True,
                return_dict_in_generate=True,
            )
        logprobs = torch.log_softmax(torch.cat(generated.logits).float(), dim=-1)
        input_ids = inputs["input_ids"][0].tolist()
        items = [{"pixel_values": p.unsqueeze(0)} for p in inputs["pixel_values"]] if images else []
        hashes = [hashlib.sha256(i["pixel_values"].numpy().tobytes()).hexdigest() for i in items]
        features = placements(input_ids, hf_model.config.image_token_id, hashes)
        reference = generated.sequences[0, len(input_ids) :].tolist()
        out[name] = Prompt(input_ids, items, features, reference, logprobs)
    return out


@pytest.fixture
def runner(tiny_model_dir) -> ModelRunner:
    # the oracle runs fp32 on CPU
    return ModelRunner(str(tiny_model_dir), device="cpu", kv_cache_tokens=KV_CACHE_TOKENS)
