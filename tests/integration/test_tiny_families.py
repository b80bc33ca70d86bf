"""The tiny checkpoints of every family (workers/families/tiny.py): deterministic per seed, loadable by
transformers' own classes with the family's real vision geometry, an image-only Qwen processor that
equals the stock one on a spread of sizes, and greedy output that depends on the image (else cache
bugs would hide)."""

from __future__ import annotations

import json
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from transformers import (
    AutoProcessor,
    LlavaForConditionalGeneration,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLForConditionalGeneration,
    Qwen2VLProcessor,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)

from tests.stock_processor import saved_processor_class, stock_processor
from workers.families import load_processing
from workers.families.qwen_vl.hf_processor import ImageOnlyQwenVLProcessor
from workers.families.tiny import TINY_FAMILIES, build_tiny_model

pytestmark = pytest.mark.slow

QWEN_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
HF_CLASSES = {
    "qwen2_vl": (Qwen2VLForConditionalGeneration, Qwen2VLProcessor),
    "qwen2_5_vl": (Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor),
    "qwen3_vl": (Qwen3VLForConditionalGeneration, Qwen3VLProcessor),
}
PATCH_SIZE = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16}
# (t, h, w) in patches for 224x224 and 1024x768. Qwen3-VL's real min_pixels (256x256) scales 224x224 up.
GRIDS = {
    "qwen2_vl": [(1, 16, 16), (1, 54, 74)],
    "qwen2_5_vl": [(1, 16, 16), (1, 54, 74)],
    "qwen3_vl": [(1, 16, 16), (1, 48, 64)],
}


@pytest.fixture(scope="module", params=QWEN_FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def family_dir(family: str, tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model(family)


@pytest.fixture(scope="module")
def processor(family_dir: Path) -> ImageOnlyQwenVLProcessor:
    return ImageOnlyQwenVLProcessor.from_pretrained(family_dir)


def user_prompt(processor: Any, num_images: int, text: str) -> str:
    parts = [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": text}]
    return processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )


def varied_images() -> list[Image.Image]:
    """8 images a cache bug could confuse: noise with different seeds, solid colours, shapes."""
    noise = [
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (224, 224, 3), dtype=np.uint8))
        for seed in range(3)
    ]
    solid = [Image.new("RGB", (224, 224), colour) for colour in [(255, 0, 0), (0, 0, 255), (255, 255, 255)]]
    circle = Image.new("RGB", (224, 224), (0, 0, 0))
    ImageDraw.Draw(circle).ellipse((40, 40, 180, 180), fill=(255, 255, 0))
    bar = Image.new("RGB", (224, 224), (255, 255, 255))
    ImageDraw.Draw(bar).rectangle((20, 100, 200, 140), fill=(0, 128, 0))
    return [*noise, *solid, circle, bar]


def assert_same_model_inputs(ours: Any, stock: Any, prompt: str, images: list[Any], **kwargs: Any) -> None:
    """Both processors make the same model inputs (every key, every tensor bit for bit)."""
    mine = ours(text=[prompt], images=images, return_tensors="pt", **kwargs)
    theirs = stock(text=[prompt], images=images, return_tensors="pt", **kwargs)
    assert sorted(mine.keys()) == sorted(theirs.keys())
    for key, value in theirs.items():
        assert torch.equal(value, mine[key]), key


def noise(width: int, height: int) -> Image.Image:
    return Image.fromarray(
        np.random.default_rng(width * height).integers(0, 256, (height, width, 3), np.uint8)
    )


# (width, height) and processor kwargs: sizes the resize rounds in every way, and the pixel bounds of a
# request's mm_processor_kwargs (``size``: min and max pixels, in every family's spelling)
BOUNDS = {"size": {"shortest_edge": 300 * 300, "longest_edge": 400 * 400}}
SIZES = {
    "tiny": ((1, 1), {}),
    "odd": ((333, 227), {}),
    "very wide": ((2000, 12), {}),
    "very tall": ((15, 1500), {}),
    "below min_pixels": ((64, 64), BOUNDS),
    "above max_pixels": ((640, 480), BOUNDS),
}


def test_same_seed_same_files_other_seed_other_weights(family: str, family_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(family, tmp_path / "again", seed=0)
    other = build_tiny_model(family, tmp_path / "other", seed=1)
    names = sorted(path.name for path in family_dir.iterdir())
    assert names == sorted(path.name for path in again.iterdir()) == sorted(p.name for p in other.iterdir())
    for name in names:
        assert (again / name).read_bytes() == (family_dir / name).read_bytes(), name
        if name != "model.safetensors":  # the seed changes the weights only
            assert (other / name).read_bytes() == (family_dir / name).read_bytes(), name
    first = HF_CLASSES[family][0].from_pretrained(family_dir).state_dict()
    third = HF_CLASSES[family][0].from_pretrained(other).state_dict()
    assert first.keys() == third.keys()
    assert not torch.equal(first["lm_head.weight"], third["lm_head.weight"])


def test_loads_with_real_geometry(family: str, family_dir: Path, processor: ImageOnlyQwenVLProcessor) -> None:
    model = HF_CLASSES[family][0].from_pretrained(family_dir)
    config = model.config
    assert config.model_type == family
    assert model.dtype == torch.float32
    assert 300_000 <= sum(p.numel() for p in model.parameters()) <= 3_000_000
    vision = config.vision_config
    geometry = (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)
    assert geometry == (PATCH_SIZE[family], 2, 2)
    image_processor = processor.image_processor
    assert (image_processor.patch_size, image_processor.merge_size) == (PATCH_SIZE[family], 2)
    if family == "qwen2_5_vl":
        assert vision.window_size == 112
        assert 0 < len(vision.fullatt_block_indexes) < vision.depth  # window and full-attention blocks
    if family == "qwen3_vl":
        assert vision.deepstack_visual_indexes and max(vision.deepstack_visual_indexes) < vision.depth
        rope = config.text_config.rope_parameters
        assert rope["mrope_interleaved"] and sum(rope["mrope_section"]) == config.text_config.head_dim // 2
    text = config.text_config
    assert text.num_key_value_heads < text.num_attention_heads
    assert text.vocab_size == len(processor.tokenizer)
    tokens = processor.tokenizer.convert_tokens_to_ids
    assert config.image_token_id == processor.image_token_id == tokens("<|image_pad|>")
    assert config.video_token_id == tokens("<|video_pad|>")
    assert config.vision_start_token_id == tokens("<|vision_start|>")
    assert config.vision_end_token_id == tokens("<|vision_end|>")
    assert processor.tokenizer.eos_token == "<|im_end|>"


def test_chat_template(family: str, processor: ImageOnlyQwenVLProcessor) -> None:
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "Hi?"}],
        },
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And now?"},
    ]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    system = "" if family == "qwen3_vl" else "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    assert prompt == (
        f"{system}<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi?<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nAnd now?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *messages[2:]]
    assert processor.apply_chat_template(with_system, tokenize=False).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAnd now?"
    )


def test_two_images_of_different_sizes(
    family: str, family_dir: Path, processor: ImageOnlyQwenVLProcessor
) -> None:
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)),
        Image.fromarray(rng.integers(0, 256, (768, 1024, 3), dtype=np.uint8)),
    ]
    prompt = user_prompt(processor, 2, "Compare the two pictures.")
    inputs = processor(text=[prompt], images=images, return_tensors="pt")
    grids = [tuple(row) for row in inputs["image_grid_thw"].tolist()]
    assert grids == GRIDS[family]
    num_tokens = [t * h * w // 4 for t, h, w in grids]
    ids = inputs["input_ids"][0].tolist()
    image_id = processor.image_token_id
    start = ids.index(processor.vision_start_token_id)
    assert ids[start + 1 : start + 1 + num_tokens[0]] == [image_id] * num_tokens[0]
    assert ids[start + 1 + num_tokens[0]] == processor.vision_end_token_id
    assert ids.count(image_id) == sum(num_tokens)
    assert inputs["pixel_values"].shape[0] == sum(t * h * w for t, h, w in grids)
    assert inputs["mm_token_type_ids"][0].tolist() == [int(i == image_id) for i in ids]

    assert_same_model_inputs(processor, stock_processor(family_dir), prompt, images)


@pytest.mark.parametrize("size", list(SIZES))
def test_image_only_processor_equals_the_stock_one(
    family: str, family_dir: Path, processor: ImageOnlyQwenVLProcessor, size: str
) -> None:
    """The product's processor and transformers' saved class (tests/stock_processor.py) agree on every
    family, on sizes the resize rounds differently, and with a request's min/max pixels."""
    (width, height), kwargs = SIZES[size]
    prompt = user_prompt(processor, 2, "Compare the two pictures.")
    images = [noise(width, height), noise(height, width)]
    assert_same_model_inputs(processor, stock_processor(family_dir), prompt, images, **kwargs)


def test_a_processor_that_differs_from_the_stock_one_is_caught(family: str, family_dir: Path) -> None:
    """The comparison above fails on a processor that resizes with another filter, or that expands an
    image to one placeholder too many."""
    stock = stock_processor(family_dir)
    prompt = user_prompt(stock, 1, "What is this?")
    bilinear = ImageOnlyQwenVLProcessor.from_pretrained(family_dir)
    bilinear.image_processor.resample = Image.Resampling.BILINEAR
    with pytest.raises(AssertionError, match="pixel_values"):
        assert_same_model_inputs(bilinear, stock, prompt, [noise(333, 227)])

    class OneTooMany(ImageOnlyQwenVLProcessor):
        def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs: Any) -> str:
            return super().replace_image_token(image_inputs, image_idx) + self.image_token

    with pytest.raises(AssertionError, match="input_ids"):
        assert_same_model_inputs(OneTooMany.from_pretrained(family_dir), stock, prompt, [noise(333, 227)])


def test_the_oracles_processor_is_the_saved_class(family: str, family_dir: Path) -> None:
    """The e2e oracle's processor (tests/e2e/conftest.py) is transformers' class that the checkpoint
    names, with its own image processor and template: nothing of the product's."""
    stock = stock_processor(family_dir)
    assert isinstance(stock, saved_processor_class(family_dir)) and isinstance(stock, HF_CLASSES[family][1])
    assert not isinstance(stock, ImageOnlyQwenVLProcessor)
    assert type(stock.image_processor).__module__.startswith("transformers.")
    jinja, json_file = family_dir / "chat_template.jinja", family_dir / "chat_template.json"
    saved = jinja.read_text() if jinja.exists() else json.loads(json_file.read_text())["chat_template"]
    assert stock.chat_template == saved


def test_qwen2_5_vl_keeps_tools_in_its_tokenizers_template_as_the_real_checkpoint(
    tiny_model: Callable[[str], Path],
) -> None:
    """A real Qwen2.5-VL: the processor's template (chat_template.json) has no tools, the tokenizer's
    (tokenizer_config.json, Qwen2.5's) has; the tool tokens are added, not special, and split out whole."""
    folder = tiny_model("qwen2_5_vl")
    processor = load_processing(folder)
    assert "tools" not in processor.hf_processor.chat_template
    assert (
        processor.tool_chat_template == processor.tokenizer.chat_template
        and "tools" in processor.tool_chat_template
    )
    added = processor.tokenizer.added_tokens_decoder
    ids = processor.tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert all(not added[i].special for i in ids)
    assert processor.tokenizer("a<tool_call>b")["input_ids"][1] == ids[0]


# The tokens each real tokenizer adds after its 2,048 trained merges here (151,643 in the real ones), in
# id order: Qwen's 14 specials, then (Qwen2.5-VL) the tool-call and fill-in-the-middle tokens and
# (Qwen3-VL) the tool-response and thinking markers, none of those special.
QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
QWEN2_5_NOT_SPECIAL = [
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
]  # fmt: skip
NOT_SPECIAL = {
    "qwen2_vl": [],
    "qwen2_5_vl": QWEN2_5_NOT_SPECIAL,
    "qwen3_vl": [*QWEN2_5_NOT_SPECIAL, "<tool_response>", "</tool_response>", "<think>", "</think>"],
}


def test_added_tokens_are_the_real_tokenizers_with_their_special_status(
    family: str, processor: ImageOnlyQwenVLProcessor
) -> None:
    """The saved tokenizer's added tokens, ids and special flags, as the real checkpoint's: each one is
    split out of text whole; ``skip_special_tokens`` drops the specials and keeps the others."""
    tokenizer = processor.tokenizer
    added = tokenizer.added_tokens_decoder
    expected = [(token, True) for token in QWEN_SPECIALS] + [(token, False) for token in NOT_SPECIAL[family]]
    assert [(added[i].content, added[i].special) for i in sorted(added)] == expected
    assert sorted(added) == list(range(2048, 2048 + len(expected))) and len(tokenizer) == 2048 + len(expected)
    for token, special in expected:
        ids = tokenizer(f"a{token}b")["input_ids"]
        assert tokenizer.convert_tokens_to_ids(token) in ids, token
        kept = tokenizer.decode(ids, skip_special_tokens=True)
        assert kept == ("ab" if special else f"a{token}b"), (token, kept)


@pytest.mark.parametrize("seed", [0, 1])
def test_output_depends_on_image(family: str, seed: int, tmp_path: Path) -> None:
    model_dir = build_tiny_model(family, tmp_path / family, seed=seed)
    model = HF_CLASSES[family][0].from_pretrained(model_dir).eval()
    processor = ImageOnlyQwenVLProcessor.from_pretrained(model_dir)
    prompt = user_prompt(processor, 1, "What is in this picture?")
    outputs = []
    for image in varied_images():
        inputs = processor(text=[prompt], images=[image], return_tensors="pt")
        with torch.no_grad():
            generated = model.generate(**inputs, max_new_tokens=16, do_sample=False)
        outputs.append(tuple(generated[0, inputs["input_ids"].shape[1] :].tolist()))
    assert len(set(outputs)) >= 7
    assert all(len(output) == 16 and len(set(output)) > 1 for output in outputs)  # no EOS, no collapse
    texts = [processor.tokenizer.decode(output) for output in outputs]
    assert all(set(text) <= set(string.printable) for text in texts), texts


def test_llava_still_builds(tmp_path: Path) -> None:
    first = build_tiny_model("llava", tmp_path / "first", seed=0)
    again = build_tiny_model("llava", tmp_path / "again", seed=0)
    for path in first.iterdir():
        assert (again / path.name).read_bytes() == path.read_bytes(), path.name
    model = LlavaForConditionalGeneration.from_pretrained(first)
    assert model.config.image_seq_length == 576
    processor = AutoProcessor.from_pretrained(first)
    inputs = processor(text=[user_prompt(processor, 1, "What is this?")], images=[varied_images()[0]])
    assert inputs["input_ids"][0].count(model.config.image_token_id) == 576


def test_unknown_family(tmp_path: Path) -> None:
    assert set(QWEN_FAMILIES) < set(TINY_FAMILIES)
    with pytest.raises(ValueError, match="no tiny checkpoint"):
        build_tiny_model("llama", tmp_path / "x")
