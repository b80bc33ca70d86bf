"""app/inputs/prompts.py: the prompt's ids with each image token repeated, never tokenizing
placeholders, equal
the HF processor's own ``input_ids`` (and the family's ``tokenize``) for LLaVA and every Qwen family, for
every message shape, repeated prompts (the caches) included; a cached render equals the template's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from app.inputs.prompts import PromptBuilder, messages_key
from workers.families import load_processing
from workers.families.errors import FamilyInputError
from workers.families.processing import DEFAULT_TEMPLATE, FamilyProcessor, ItemLayout, TemplateOptions
from workers.families.tiny import TINY_FAMILIES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def family(request: pytest.FixtureRequest, tiny_model: Callable[[str], Path]) -> FamilyProcessor:
    model_dir = tiny_model(request.param)
    return load_processing(model_dir)


def image(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


IMAGES = [image(0, 224, 224), image(1, 320, 160), image(2, 112, 300)]
IMG: dict[str, Any] = {"type": "image"}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": [IMG, text("What is in this image?")]}],
    [{"role": "user", "content": [text("Describe"), IMG]}],
    [{"role": "user", "content": [IMG]}],
    [{"role": "user", "content": [IMG, IMG, text("  two   adjacent\n\nimages ")]}],
    [{"role": "user", "content": [text(" leading space"), IMG, text("\ttab, ünïcödé, 日本語 ")]}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [text("Compare"), IMG]},
        {"role": "assistant", "content": "The first one is noisy."},
        {"role": "user", "content": [IMG, text("and this one?"), IMG]},
    ],
    [{"role": "user", "content": "No image at all."}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_equals_the_hf_processor(
    family: FamilyProcessor, conversation: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = PromptBuilder(family)
    prompt = fast.render(conversation)
    assert prompt == family.render_prompt(conversation)
    assert fast.render(conversation) == prompt  # from the cache
    num_images = prompt.count(family.image_token)
    images = IMAGES[:num_images]
    layouts = [family.process_image(im, {}, param="p").layout for im in images]

    slow = family.tokenize(prompt, layouts)
    with monkeypatch.context() as patch:  # the fast path answers: the family's method is not called
        patch.setattr(family, "tokenize", lambda *args: pytest.fail("fell back to family.tokenize"))
        token_ids, spans = fast.tokenize(prompt, layouts)
    assert (token_ids, spans) == slow
    if images:
        expected = family.hf_processor(text=[prompt], images=images, return_tensors="pt")
    else:
        expected = family.hf_processor.tokenizer([prompt], return_tensors="pt")
    assert token_ids == expected["input_ids"][0].tolist()
    assert fast.tokenize(prompt, layouts) == (token_ids, spans)  # from the cache
    assert [end - first for first, end in spans] == [layout.num_tokens for layout in layouts]


def test_cached_prompt_with_other_placeholder_counts(family: FamilyProcessor) -> None:
    """One prompt, images of other sizes (Qwen: other counts): the cache keys on the text only."""
    prompt = family.render_prompt(CONVERSATIONS[3])
    fast = PromptBuilder(family)
    for num_tokens in ([64, 64], [5, 300], [1, 1], [300, 7]):
        layouts = [ItemLayout(n) for n in num_tokens]
        assert fast.tokenize(prompt, layouts) == family.tokenize(prompt, layouts)


def test_what_the_family_refuses_is_refused_alike(family: FamilyProcessor) -> None:
    fast = PromptBuilder(family)
    prompt = family.render_prompt(CONVERSATIONS[0])
    for wrong in ([], [ItemLayout(16)] * 2):
        with pytest.raises(FamilyInputError) as family_error:
            family.tokenize(prompt, wrong)
        with pytest.raises(FamilyInputError) as fast_error:
            fast.tokenize(prompt, wrong)
        assert fast_error.value.message == family_error.value.message
    # a user who types the image token gets the family's answer (an error: one image too many)
    typed = family.render_prompt([{"role": "user", "content": [IMG, text(f"see {family.image_token} here")]}])
    with pytest.raises(FamilyInputError) as family_error:
        family.tokenize(typed, [ItemLayout(16)])
    with pytest.raises(FamilyInputError) as fast_error:
        fast.tokenize(typed, [ItemLayout(16)])
    assert fast_error.value.message == family_error.value.message


def outcome(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as exc:
        return type(exc), str(exc)


def test_no_placeholder_is_left_to_the_family(family: FamilyProcessor) -> None:
    """An image of 0 tokens never reaches tokenize (every item has some); the family answers it."""
    prompt = family.render_prompt(CONVERSATIONS[1])
    fast = PromptBuilder(family)
    layouts = [ItemLayout(0)]
    assert outcome(lambda: fast.tokenize(prompt, layouts)) == outcome(
        lambda: family.tokenize(prompt, layouts)
    )


def test_template_options_are_part_of_the_render_and_its_cache_key(family: FamilyProcessor) -> None:
    fast = PromptBuilder(family)
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
    continued = TemplateOptions(add_generation_prompt=False, continue_final_message=True)
    opened = fast.render(conversation)
    assert opened == family.render_prompt(conversation)
    assert fast.render(conversation, continued) == family.render_prompt(conversation, continued)
    assert fast.render(conversation, continued).rstrip().endswith("Hello, I")
    assert fast.render(conversation) == opened  # each kept under its own key


def test_the_caches_are_bounded_in_characters(family: FamilyProcessor) -> None:
    fast = PromptBuilder(family, max_cached_chars=400)
    conversations = [[{"role": "user", "content": f"question {i}"}] for i in range(40)]
    prompts = [fast.render(conversation) for conversation in conversations]
    for prompt in prompts:
        assert fast.tokenize(prompt, []) == family.tokenize(prompt, [])
    for cache, keys in (
        (fast._short_ids, prompts),
        (fast._prompts, [(messages_key(c)[0], DEFAULT_TEMPLATE) for c in conversations]),
    ):
        assert 0 < cache.num_chars <= 400
        assert cache.keys() == keys[-len(cache.keys()) :]  # the newest kept
    huge = fast.render([{"role": "user", "content": "x" * 1000}])
    fast.tokenize(huge, [])
    assert fast._short_ids.get(huge) is None


def test_messages_keys_tell_every_difference_apart() -> None:
    variants: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": "a"}],
        [{"role": "user", "content": [text("a")]}],
        [{"role": "user", "content": [text("a"), IMG]}],
        [{"role": "user", "content": [IMG, text("a")]}],
        [{"role": "user", "content": [text(""), IMG]}],
        [{"role": "user", "content": [IMG]}],
        [{"role": "system", "content": "a"}],
        [{"role": "user", "content": "a"}, {"role": "user", "content": ""}],
    ]
    keys = [messages_key(v)[0] for v in variants]
    assert len(set(keys)) == len(keys)
    assert messages_key(variants[2]) == messages_key([{"role": "user", "content": [text("a"), IMG]}])


def test_a_template_that_reads_the_clock_is_rendered_every_time(family: FamilyProcessor) -> None:
    fast = PromptBuilder(family)
    assert fast._cache_renders
    fast._cache_renders = False  # as for a template calling strftime_now
    conversation = CONVERSATIONS[0]
    assert fast.render(conversation) == family.render_prompt(conversation)
    assert fast._prompts.keys() == []
