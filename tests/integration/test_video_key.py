"""A video's mm_hash covers every option that changes its processed item (docs/architecture.md,
"mm_hash"): for generated pairs of ``mm_processor_kwargs`` on the tiny Qwen2-VL and Qwen3-VL
checkpoints, equal keys mean equal processed items (tensors and layout, decoded and processed for
real), so no request can be answered with another sampling's frames from a cache. Spellings of one
sampling (``fps`` 2 and 2.0, ``min_pixels`` and the ``size`` it stands for) are one key; the image
options of a request never enter a video's key."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from app.errors import InvalidRequestError, MediaError
from app.inputs.preprocess.video_item import VideoRules, decode_and_process_video
from app.media.video import VideoLimits
from tests.video_clips import make_clip
from wire.hashing import mm_hash
from workers.families import load_processing
from workers.families.processing import FamilyProcessor, ProcessedItem
from workers.families.qwen_vl.video_processing import VideoKind

pytestmark = pytest.mark.slow  # real decoding and processing of generated clips, per family

CLIP = make_clip(width=64, height=48, fps=10, num_frames=30, seed=3)  # 3 s
RULES = VideoRules(VideoLimits(), max_sampled_frames=64, max_decoded_pixels=1 << 28)
PIXELS = st.sampled_from([28 * 28 * 4, 28 * 28 * 8, 28 * 28 * 16, 28 * 28 * 64])
# fps or num_frames (never both: a 400 for any family), or neither
SAMPLING = st.one_of(
    st.just({}),
    st.fixed_dictionaries({"fps": st.sampled_from([0.5, 1, 1.0, 2, 2.0, 3.5])}),
    st.fixed_dictionaries({"num_frames": st.sampled_from([2, 4, 6, 8])}),
)
BOUNDS = st.lists(PIXELS, min_size=2, max_size=2).map(sorted)  # min_pixels <= max_pixels
OTHER = st.fixed_dictionaries(
    {},
    optional={"cap_pixels_per_frame": st.booleans(), "do_rescale": st.just(True)},  # do_rescale: an image's
)


def as_size(low: int, high: int) -> dict[str, Any]:
    return {"size": {"shortest_edge": low, "longest_edge": high}}


def video_kwargs(kind: VideoKind) -> st.SearchStrategy[dict[str, Any]]:
    """Options the family accepts, in each spelling it takes: Qwen2-VL's ``min_pixels`` alone or with
    ``max_pixels``, or the ``size`` they stand for; Qwen3-VL's ``size`` only. (``max_pixels`` alone
    below the checkpoint's minimum, and Qwen3-VL's ``min_pixels``, are refused:
    test_qwen_video_processing.py checks that.)"""
    if kind is VideoKind.QWEN3_VL:
        pixels = st.one_of(st.just({}), BOUNDS.map(lambda b: as_size(*b)))
    else:
        pixels = st.one_of(
            st.just({}),
            BOUNDS.map(lambda b: {"min_pixels": b[0]}),
            BOUNDS.map(lambda b: {"min_pixels": b[0], "max_pixels": b[1]}),
            BOUNDS.map(lambda b: as_size(*b)),
        )
    return st.tuples(SAMPLING, pixels, OTHER).map(lambda parts: {k: v for p in parts for k, v in p.items()})


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def family(request: pytest.FixtureRequest, tiny_model: Callable[[str], Path]) -> FamilyProcessor:
    return load_processing(tiny_model(request.param))


def key(family: FamilyProcessor, kwargs: dict[str, Any]) -> str:
    options = family.hash_video_options(kwargs)
    return mm_hash(model_id=family.model_id, modality="video", data=CLIP, options=options)


def processed(family: FamilyProcessor, kwargs: dict[str, Any]) -> ProcessedItem:
    return _processed(family, json.dumps(kwargs, sort_keys=True))  # ints and floats keep their type


@cache
def _processed(family: FamilyProcessor, kwargs: str) -> ProcessedItem:
    options = family.hash_video_options(json.loads(kwargs))
    return decode_and_process_video(family, CLIP, options, "messages[0].content[0].video_url", RULES)


def same_item(a: ProcessedItem, b: ProcessedItem) -> bool:
    return a.layout == b.layout and all(torch.equal(a.tensors[name], b.tensors[name]) for name in a.tensors)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_equal_keys_mean_equal_items(family: FamilyProcessor, data: st.DataObject) -> None:
    options = video_kwargs(family.video_config.kind)
    first, second = data.draw(options, label="first"), data.draw(options, label="second")
    key_a, key_b = key(family, first), key(family, second)
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
    by_fps, other_fps, by_count = {"fps": 3}, {"fps": 1}, {"num_frames": 8}
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


def test_spelling_out_a_default_is_the_default_entry(family: FamilyProcessor) -> None:
    """As for images: the checkpoint's own sampling rate (2 fps by default) and pixel bounds, spelt
    out, share the entry (and a media id bound without them)."""
    config = family.video_config
    default_fps = config.fps if config.fps is not None else 2
    for spelt in ({"fps": default_fps}, {"size": dict(config.size)}, {"cap_pixels_per_frame": False}):
        assert key(family, spelt) == key(family, {}), spelt
        assert same_item(processed(family, spelt), processed(family, {})), spelt


def test_the_key_is_the_content_and_the_modality(family: FamilyProcessor) -> None:
    other_clip = make_clip(width=64, height=48, fps=10, num_frames=30, seed=4)
    options = family.hash_video_options({})
    assert mm_hash(model_id=family.model_id, modality="video", data=other_clip, options=options) != key(
        family, {}
    )
    assert mm_hash(model_id=family.model_id, modality="image", data=CLIP, options=options) != key(family, {})


def test_sampled_pixels_past_the_budget_are_refused_before_decoding(family: FamilyProcessor) -> None:
    """--max-video-pixels bounds what decoding allocates (sampled frames x width x height): a small
    upload of large frames cannot make a preprocessing process take gigabytes."""
    param = "messages[0].content[0].video_url"
    options = family.hash_video_options({"num_frames": 4})
    exactly = dataclasses.replace(RULES, max_decoded_pixels=4 * 64 * 48)
    assert decode_and_process_video(family, CLIP, options, param, exactly).layout.num_tokens > 0
    with pytest.raises(MediaError) as refused:
        decode_and_process_video(
            family, CLIP, options, param, dataclasses.replace(exactly, max_decoded_pixels=4 * 64 * 48 - 1)
        )
    assert (refused.value.code, refused.value.param) == ("video_too_large", param)
    assert "--max-video-pixels" in refused.value.message


def test_a_clip_too_short_for_the_models_own_sampling_is_the_clips_fault(family: FamilyProcessor) -> None:
    """One frame: Qwen2-VL's sampling cannot make a temporal patch of it, Qwen3-VL's gives the one frame,
    which its processing refuses. Either way the video's part is named, with a code, not the options the
    request did not send."""
    param = "messages[0].content[0].video_url"
    one_frame = make_clip(width=64, height=48, fps=10, num_frames=1, seed=5)
    with pytest.raises(MediaError) as refused:
        decode_and_process_video(family, one_frame, family.hash_video_options({}), param, RULES)
    assert (refused.value.code, refused.value.param) == ("video_too_short", param)
