"""Encoder budgets derived from the model (as vLLM's compute_encoder_budget), and the per-prompt limit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.inputs.encoder_budgets import budget_warnings, derive_encoder_budgets, startup_error
from app.settings import Settings
from workers.families import UnsupportedModelError, largest_item_tokens


def llava_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llava", "vision_config": {"image_size": 336, "patch_size": 14}})
    )
    return tmp_path


def qwen_dir(tmp_path: Path, model_type: str, patch_size: int, max_pixels: int) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "patch_size": patch_size,
                "merge_size": 2,
                "size": {"shortest_edge": 3136, "longest_edge": max_pixels},
            }
        )
    )
    return tmp_path


def test_largest_item_per_family(tmp_path: Path) -> None:
    (tmp_path / "l").mkdir()
    assert largest_item_tokens(llava_dir(tmp_path / "l"), 64) == 576
    (tmp_path / "q2").mkdir()
    assert largest_item_tokens(qwen_dir(tmp_path / "q2", "qwen2_vl", 14, 28 * 28 * 1280), 1) == 1280
    (tmp_path / "q3").mkdir()
    assert largest_item_tokens(qwen_dir(tmp_path / "q3", "qwen3_vl", 16, 4096 * 4096), 1) == 16384
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(UnsupportedModelError, match="bert"):
        largest_item_tokens(tmp_path / "x", 1)


def test_the_largest_video_is_frames_times_the_per_frame_cap(tmp_path: Path) -> None:
    """Qwen2-VL / Qwen2.5-VL: each group of 2 frames up to the per-frame cap; Qwen3-VL: the cap counts
    all frames together (3 frames in 2 groups is the worst case)."""
    (tmp_path / "q2").mkdir()
    q2 = qwen_dir(tmp_path / "q2", "qwen2_5_vl", 14, 28 * 28 * 1280)
    (q2 / "video_preprocessor_config.json").write_text(json.dumps({"size": {"longest_edge": 28 * 28 * 256}}))
    assert largest_item_tokens(q2, 64) == 32 * 256  # 64 frames: 32 groups of 256
    assert largest_item_tokens(q2, 9) == 5 * 256
    (tmp_path / "q3").mkdir()
    q3 = qwen_dir(tmp_path / "q3", "qwen3_vl", 16, 32 * 32 * 64)
    (q3 / "video_preprocessor_config.json").write_text(json.dumps({"size": {"longest_edge": 32 * 32 * 3000}}))
    assert largest_item_tokens(q3, 64) == 2000  # 2 groups x 3000 / 3 frames
    derived = derive_encoder_budgets(Settings(model=str(q2), max_video_frames=64))
    assert derived.encoder_cache_tokens == derived.encoder_compute_budget_tokens == 32 * 256


def test_defaults_never_go_below_the_largest_item(tmp_path: Path) -> None:
    settings = Settings(
        model=str(qwen_dir(tmp_path, "qwen2_vl", 14, 28 * 28 * 1280)),
        max_num_batched_tokens=256,
        max_video_frames=2,  # one group of the image's size
    )
    budgets = derive_encoder_budgets(settings)
    assert budgets.largest_item_tokens == 1280
    assert budgets.encoder_compute_budget_tokens == 1280  # max(256, 1280)
    assert budgets.encoder_cache_tokens == 8192  # max(8192, 1280)
    assert budget_warnings(settings, budgets) == [] and startup_error(settings, budgets) is None

    big = Settings(model=str(tmp_path), max_num_batched_tokens=4096, max_video_frames=2)
    assert derive_encoder_budgets(big).encoder_compute_budget_tokens == 4096


def test_llava_with_a_small_step_budget_gets_the_whole_image(tmp_path: Path) -> None:
    settings = Settings(model=str(llava_dir(tmp_path)), max_num_batched_tokens=128)
    assert derive_encoder_budgets(settings).encoder_compute_budget_tokens == 576


def test_explicit_budgets_below_the_largest_item_are_honoured_with_a_warning(tmp_path: Path) -> None:
    settings = Settings(
        model=str(llava_dir(tmp_path)), encoder_compute_budget_tokens=100, encoder_cache_tokens=300
    )
    budgets = derive_encoder_budgets(settings)
    assert (budgets.encoder_compute_budget_tokens, budgets.encoder_cache_tokens) == (100, 300)
    warnings = budget_warnings(settings, budgets)
    assert len(warnings) == 2
    assert "--encoder-cache-tokens 300" in warnings[0] and "576" in warnings[0]
    assert "--encoder-compute-budget-tokens 100" in warnings[1]
    # 0 turns caching off (unbounded), which is no reason to warn
    off = Settings(model=str(tmp_path), encoder_cache_tokens=0)
    assert budget_warnings(off, derive_encoder_budgets(off)) == []


def test_disable_chunked_mm_input_needs_a_step_that_holds_the_largest_item(tmp_path: Path) -> None:
    settings = Settings(
        model=str(llava_dir(tmp_path)), max_num_batched_tokens=512, disable_chunked_mm_input=True
    )
    error = startup_error(settings, derive_encoder_budgets(settings))
    assert error is not None and "--max-num-batched-tokens" in error and "576" in error
    ok = Settings(model=str(tmp_path), max_num_batched_tokens=576, disable_chunked_mm_input=True)
    assert startup_error(ok, derive_encoder_budgets(ok)) is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("image=4", {"image": 4, "video": 4}),
        ('{"image": 2}', {"image": 2, "video": 4}),
        ("image=0,video=1", {"image": 0, "video": 1}),
        ({"image": 3, "video": 0}, {"image": 3, "video": 0}),
    ],
)
def test_limit_mm_per_prompt_spellings(value: object, expected: dict[str, int]) -> None:
    """A modality left out keeps its default."""
    assert Settings(limit_mm_per_prompt=value).limit_mm_per_prompt == expected


@pytest.mark.parametrize("value", ["image=4", '{"image": 4}'])
def test_limit_mm_per_prompt_from_the_environment(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMSERVE_LIMIT_MM_PER_PROMPT", value)
    assert Settings().limit_mm_per_prompt == {"image": 4, "video": 4}


def test_limit_mm_per_prompt_default_and_bad_values() -> None:
    assert Settings().limit_mm_per_prompt == {"image": 999, "video": 4}
    for bad in ("image", "image=-1", "audio=2", "image=x", "video=-1"):
        with pytest.raises(ValidationError):
            Settings(limit_mm_per_prompt=bad)
