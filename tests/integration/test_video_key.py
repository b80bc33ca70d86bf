"""A video's mm_hash covers every option that changes its processed item (docs/architecture.md,
"mm_hash"): for generated pairs of ``mm_processor_kwargs`` on the tiny Qwen2-VL and Qwen3-VL
checkpoints, equal keys mean equal processed items (tensors and layout, decoded and processed for
real), so no request can be answered with another sampling's frames from a cache. Spellings of one
sampling (``fps`` 2 and 2.0, ``min_pixels`` and the ``size`` it stands for) are one key; the image
options of a request never enter a video's key."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from app.errors import InvalidRequestError
from app.inputs.preprocess.video_item import VideoRules, decode_and_process_video
from app.media.video import VideoLimits
from tests.video_clips import make_clip
from wire.hashing import mm_hash
from workers.families import load_processing
from workers.families.errors import FamilyInputError
from workers.families.processing import FamilyProcessor, ProcessedItem
from workers.families.qwen_vl.video_processing import VideoKind

pytestmark = pytest.mark.slow  # real decoding and processing of generated clips, per family

CLIP = make_clip(width=64, height=48, fps=10, num_frames=30, seed=3)  # 3 s
RULES = VideoRules(VideoLimits(), max_sampled_frames=64)
PIXELS = st.sampled_from([28 * 28 * 4, 28 * 28 * 8, 28 * 28 * 16, 28 * 28 * 64])

video_kwargs = st.fixed_dictionaries(
    {},
    optional={
        "fps": st.sampled_from([0.5, 1, 1.0, 2, 2.0, 3.5]),
        "num_frames": st.sampled_from([2, 4, 6, 8]),
        "min_pixels": PIXELS,
        "max_pixels": PIXELS,
        "cap_pixels_per_frame": st.booleans(),
        "do_rescale": st.just(True),  # an image option: not the video's
    },
)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def family(request: pytest.FixtureRequest, tiny_model: Callable[[str], Path]) -> FamilyProcessor:
    return load_processing(tiny_model(request.param))


def key(family: FamilyProcessor, kwargs: dict[str, Any]) -> str:
    options = family.hash_video_options(kwargs)
    return mm_hash(model_id=family.model_id, modality="video", data=CLIP, options=options)


def processed(family: FamilyProcessor, kwargs: dict[str, Any]) -> ProcessedItem:
    return _processed(family, tuple(sorted(kwargs.items())))


@cache
def _processed(family: FamilyProcessor, kwargs: tuple[tuple[str, Any], ...]) -> ProcessedItem:
    options = family.hash_video_options(dict(kwargs))
    return decode_and_process_video(family, CLIP, options, "messages[0].content[0].video_url", RULES)


def same_item(a: ProcessedItem, b: ProcessedItem) -> bool:
    return a.layout == b.layout and all(torch.equal(a.tensors[name], b.tensors[name]) for name in a.tensors)


def key_or_none(family: FamilyProcessor, kwargs: dict[str, Any]) -> str | None:
    try:
        return key(family, kwargs)
    except FamilyInputError:  # options the family refuses (both fps and num_frames, Qwen3's min_pixels)
        return None


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=video_kwargs, second=video_kwargs)
def test_equal_keys_mean_equal_items(family: FamilyProcessor, first: dict, second: dict) -> None:
    key_a, key_b = key_or_none(family, first), key_or_none(family, second)
    assume(key_a is not None and key_b is not None)
    try:
        item_a, item_b = processed(family, first), processed(family, second)
    except InvalidRequestError:  # a sampling this clip cannot give: the request gets a 400, no item
        assume(False)
        raise
    if key_a == key_b:
        assert same_item(item_a, item_b), (first, second)
    if not same_item(item_a, item_b):
        assert key_a != key_b, (first, second)


def test_samplings_are_separate_entries(family: FamilyProcessor) -> None:
    by_fps, other_fps, by_count = {"fps": 2}, {"fps": 1}, {"num_frames": 8}
    keys = {key(family, kwargs) for kwargs in (by_fps, other_fps, by_count, {})}
    assert len(keys) == 4
    items = [processed(family, kwargs) for kwargs in (by_fps, other_fps, by_count)]
    assert not same_item(items[0], items[1]) and not same_item(items[1], items[2])


def test_spellings_of_one_sampling_are_one_entry(family: FamilyProcessor) -> None:
    assert key(family, {"fps": 2}) == key(family, {"fps": 2.0})
    assert key(family, {"fps": 2}) == key(family, {"fps": 2, "do_rescale": True})  # an image option
    if family.video_config.kind is VideoKind.QWEN2_VL:
        size = dict(family.video_config.size, shortest_edge=28 * 28 * 8)
        assert key(family, {"min_pixels": 28 * 28 * 8}) == key(family, {"size": size})


def test_the_key_is_the_content_and_the_modality(family: FamilyProcessor) -> None:
    other_clip = make_clip(width=64, height=48, fps=10, num_frames=30, seed=4)
    options = family.hash_video_options({})
    assert mm_hash(model_id=family.model_id, modality="video", data=other_clip, options=options) != key(
        family, {}
    )
    assert mm_hash(model_id=family.model_id, modality="image", data=CLIP, options=options) != key(family, {})
