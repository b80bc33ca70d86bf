"""The tiny LLaVA checkpoint: loads through transformers' own classes, has llava-1.5's geometry, is
deterministic per seed, and answers differently for different images (else cache bugs would hide)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

from workers.families.tiny import build_tiny_model

pytestmark = pytest.mark.slow

NUM_IMAGE_TOKENS = 576
PROMPT_MESSAGES = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
]


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path):
    return AutoProcessor.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> LlavaForConditionalGeneration:
    return LlavaForConditionalGeneration.from_pretrained(tiny_model_dir).eval()


def noise_image(seed: int, size: tuple[int, int] = (400, 300)) -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)


def greedy(processor, model, image: PIL.Image.Image, num_tokens: int = 16) -> list[int]:
    prompt = processor.apply_chat_template(PROMPT_MESSAGES, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=prompt, images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=num_tokens, min_new_tokens=num_tokens)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_size_and_ids(model: LlavaForConditionalGeneration, tiny_model_dir: Path) -> None:
    num_params = sum(p.numel() for p in model.parameters())
    assert 500_000 <= num_params <= 3_000_000
    assert model.dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids("<image>")
    assert model.config.text_config.vocab_size == len(tokenizer)
    assert model.config.text_config.num_key_value_heads < model.config.text_config.num_attention_heads
    ids = tokenizer("a <image> b").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(model.config.image_token_id) == 1
    text = "Héllo, wörld! 12 + 3 = 15\n\ttabs and 🙂"
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text


def test_chat_template(processor) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "Hi?"}],
        },
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And now?"},
    ]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "Be brief. USER: <image>\nHi? ASSISTANT: Hello.</s>USER: And now? ASSISTANT:"


def test_geometry(processor) -> None:
    prompt = processor.apply_chat_template(PROMPT_MESSAGES, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=prompt, images=[noise_image(0)], return_tensors="pt")
    assert inputs["pixel_values"].shape == (1, 3, 336, 336)
    assert (inputs["input_ids"] == processor.image_token_id).sum().item() == NUM_IMAGE_TOKENS
    two = processor(text=prompt + prompt, images=[noise_image(0), noise_image(1)], return_tensors="pt")
    assert (two["input_ids"] == processor.image_token_id).sum().item() == 2 * NUM_IMAGE_TOKENS


def test_same_seed_same_files_other_seed_other_weights(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = build_tiny_model("llava", tmp_path / "again", seed=0)
    other = build_tiny_model("llava", tmp_path / "other", seed=1)
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in tiny_model_dir.iterdir())
    for path in tiny_model_dir.iterdir():
        assert (again / path.name).read_bytes() == path.read_bytes(), path.name
    first = LlavaForConditionalGeneration.from_pretrained(tiny_model_dir).state_dict()
    second = LlavaForConditionalGeneration.from_pretrained(again).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    third = LlavaForConditionalGeneration.from_pretrained(other).state_dict()
    assert not torch.equal(first["lm_head.weight"], third["lm_head.weight"])
    assert (other / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    rebuilt = build_tiny_model("llava", other, seed=0)  # overwrites in place
    assert (rebuilt / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()


def test_output_depends_on_image(processor, model) -> None:
    outputs = [tuple(greedy(processor, model, noise_image(seed))) for seed in range(8)]
    assert len(set(outputs)) >= 7
    assert all(len(set(output)) > 1 for output in outputs)  # no collapse into one repeated token
    assert greedy(processor, model, noise_image(3)) == list(outputs[3])


def test_output_depends_on_solid_colour(processor, model) -> None:
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 0, 0), (255, 255, 255)]
    outputs = {tuple(greedy(processor, model, PIL.Image.new("RGB", (64, 48), c), 8)) for c in colours}
    assert len(outputs) >= 5
