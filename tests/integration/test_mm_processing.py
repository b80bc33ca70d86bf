"""The LLaVA family's processing on the tiny checkpoint: the split steps give exactly what the HF processor
gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from app.errors import from_family_error
from wire.hashing import mm_hash
from workers.families import load_processing
from workers.families.errors import FamilyInputError
from workers.families.processing import FamilyProcessor as MMProcessor
from workers.families.processing import ItemLayout, ProcessedItem

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mm(tiny_model_dir: Path) -> MMProcessor:
    return load_processing(tiny_model_dir)


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    return AutoProcessor.from_pretrained(tiny_model_dir)


def process(mm: MMProcessor, image: Image.Image, kwargs: dict[str, Any]) -> ProcessedItem:
    return mm.process_image(image, mm.hash_options(kwargs), param="messages[0].content[0].image_url.url")


def make_image(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8))


IMAGES = [make_image(0, (320, 240)), make_image(1, (200, 410))]

ONE_IMAGE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
TWO_IMAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"}]},
    {"role": "assistant", "content": "The first one is noisy."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this one?"}]},
]


def test_identity(mm: MMProcessor, hf: Any, tiny_model_dir: Path) -> None:
    assert mm.image_token_id == hf.image_token_id == hf.tokenizer.convert_tokens_to_ids("<image>")
    assert mm.tokenizer.eos_token_id in mm.eos_token_ids
    assert mm.model_id.startswith("llava:")
    assert load_processing(tiny_model_dir).model_id == mm.model_id  # stable across loads


@pytest.mark.parametrize(("messages", "num_images"), [(ONE_IMAGE, 1), (TWO_IMAGES, 2)])
def test_render_and_tokenize_equal_the_hf_processor(
    mm: MMProcessor, hf: Any, messages: list[dict[str, Any]], num_images: int
) -> None:
    images = IMAGES[:num_images]
    prompt = mm.render_prompt(messages)
    assert prompt == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.count("<image>") == num_images and prompt.endswith("ASSISTANT:")

    items = [process(mm, image, {}) for image in images]
    token_ids, spans = mm.tokenize(prompt, [item.layout for item in items])
    offsets = [first for first, _ in spans]

    expected = hf(text=prompt, images=images, return_tensors="pt")
    assert token_ids == expected.input_ids[0].tolist()
    assert torch.equal(torch.cat([item.tensors["pixel_values"] for item in items]), expected.pixel_values)
    image_positions = [i for i, token in enumerate(token_ids) if token == mm.image_token_id]
    assert image_positions == [
        o + k for o, item in zip(offsets, items, strict=True) for k in range(item.num_tokens)
    ]
    assert offsets[0] > 0 and token_ids[offsets[0] - 1] != mm.image_token_id


def test_string_content_renders_like_a_text_part(mm: MMProcessor) -> None:
    as_string = mm.render_prompt([{"role": "user", "content": "Hello"}])
    as_parts = mm.render_prompt([{"role": "user", "content": [{"type": "text", "text": "Hello"}]}])
    assert as_string == as_parts and "<image>" not in as_string
    token_ids, spans = mm.tokenize(as_string, [])
    assert spans == [] and token_ids[0] == mm.tokenizer.bos_token_id


def test_process_image_matches_the_hf_image_processor(mm: MMProcessor, hf: Any) -> None:
    item = process(mm, IMAGES[1], {})
    assert set(item.tensors) == {"pixel_values"}
    assert item.tensors["pixel_values"].shape == (1, 3, 336, 336)
    assert item.num_tokens == 576
    assert item.num_bytes == 3 * 336 * 336 * 4
    assert torch.equal(
        item.tensors["pixel_values"], hf(text="<image>", images=[IMAGES[1]], return_tensors="pt").pixel_values
    )
    replacement = hf.replace_image_token({"pixel_values": item.tensors["pixel_values"]}, image_idx=0)
    assert item.num_tokens == replacement.count("<image>")


@pytest.mark.parametrize(
    "kwargs", [{"do_normalize": False}, {"resample": 0}, {"image_mean": [0.5, 0.5, 0.5]}]
)
def test_kwargs_change_tensors_and_hash(mm: MMProcessor, hf: Any, kwargs: dict[str, Any]) -> None:
    default = process(mm, IMAGES[0], {})
    changed = process(mm, IMAGES[0], kwargs)
    assert not torch.equal(default.tensors["pixel_values"], changed.tensors["pixel_values"])
    expected = hf(text="<image>", images=[IMAGES[0]], images_kwargs=kwargs, return_tensors="pt").pixel_values
    assert torch.equal(changed.tensors["pixel_values"], expected)
    assert changed.num_tokens == default.num_tokens == 576

    options = mm.hash_options(kwargs)
    assert options and options != mm.hash_options({})

    def digest(opts: dict[str, Any]) -> str:
        return mm_hash(model_id=mm.model_id, modality="image", data=b"png", options=opts)

    assert digest(options) != digest(mm.hash_options({}))


def test_kwargs_equal_to_defaults_share_the_hash(mm: MMProcessor) -> None:
    assert mm.hash_options(None) == mm.hash_options({}) == {}
    assert mm.hash_options({"do_normalize": True, "resample": 3, "size": {"shortest_edge": 336}}) == {}
    assert mm.hash_options({"do_normalize": False, "do_resize": True}) == {"do_normalize": False}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"not_a_kwarg": 1},
        {"return_tensors": "np"},  # reserved: the worker relies on torch tensors
        {"do_normalize": "yes"},
        {"do_normalize": 1},
        {"size": {"shortest_edge": 100_000}},  # would allocate gigabytes before the crop
        {"crop_size": {"height": 0, "width": 336}},
        {"image_std": [float("nan"), 0.5, 0.5]},  # JSON's NaN, which Python's parser takes
        {"image_mean": [float("inf"), 0.5, 0.5]},
        {"rescale_factor": float("-inf")},
        {"rescale_factor": 10**400},  # an integer no float holds: the type check's 400, not OverflowError
    ],
)
def test_invalid_kwargs_are_rejected_up_front(mm: MMProcessor, kwargs: dict[str, Any]) -> None:
    with pytest.raises(FamilyInputError) as info:
        mm.hash_options(kwargs)
    assert info.value.param == "mm_processor_kwargs" and from_family_error(info.value).http_status == 400


@pytest.mark.parametrize(
    "kwargs",
    [
        {"resample": 99},  # valid type, rejected by the processor itself
        {"image_mean": [0.5, 0.5]},
        {"crop_size": {"height": 224, "width": 224}},  # the vision tower takes 336x336 only
        {"do_center_crop": False},
        # finite options whose pixels are not: the model would answer NaN
        {"image_std": [0.0, 0.0, 0.0]},
        {"image_std": [1e-300, 1.0, 1.0]},
        {"image_mean": [1e308, 0.0, 0.0]},
    ],
)
def test_kwargs_the_processor_or_model_cannot_take(mm: MMProcessor, kwargs: dict[str, Any]) -> None:
    with pytest.raises(FamilyInputError) as info:
        process(mm, IMAGES[1], kwargs)
    assert info.value.param == "mm_processor_kwargs"


def test_image_count_mismatch(mm: MMProcessor) -> None:
    prompt = mm.render_prompt(TWO_IMAGES)
    with pytest.raises(FamilyInputError):
        mm.tokenize(prompt, [ItemLayout(576)])
    with pytest.raises(FamilyInputError):
        mm.tokenize(prompt, [ItemLayout(576)] * 3)
    # A user typing the placeholder themselves adds one more than the request carries.
    typed = mm.render_prompt(
        [{"role": "user", "content": [{"type": "text", "text": "<image>"}, {"type": "image"}]}]
    )
    with pytest.raises(FamilyInputError):
        mm.tokenize(typed, [ItemLayout(576)])


def test_integers_where_the_processor_takes_floats_are_floats(mm: MMProcessor) -> None:
    """JSON writes 0.0 as 0, as JavaScript clients always do: [0, 0, 0] is the image_mean [0.0, 0.0, 0.0]
    (it was a 400 naming Python's types)."""
    as_ints = mm.hash_options({"image_mean": [0, 0, 0], "image_std": [1, 1, 1], "rescale_factor": 1})
    as_floats = mm.hash_options(
        {"image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0], "rescale_factor": 1.0}
    )
    assert as_ints == as_floats and as_ints["image_mean"] == [0.0, 0.0, 0.0]
    with pytest.raises(FamilyInputError):
        mm.hash_options({"image_mean": [True, 0, 0]})  # a boolean stays one
