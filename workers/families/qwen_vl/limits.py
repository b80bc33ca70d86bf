"""The Qwen families' limits from the checkpoint's JSON alone (no torch): what the launcher and the
engine need to derive the encoder budgets without loading a processor."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def largest_item_tokens(model_dir: Path, max_video_frames: int) -> int:
    """The largest image's or video's placeholders, with the checkpoint's own pixel bounds and at most
    ``max_video_frames`` sampled frames (what vLLM's ``compute_encoder_budget`` derives budgets from)."""
    return max(_largest_image(model_dir), _largest_video(model_dir, max_video_frames))


def _largest_image(model_dir: Path) -> int:
    """``max_pixels`` over the area of one merged patch: smart_resize never goes above max_pixels."""
    config = json.loads((model_dir / "preprocessor_config.json").read_text())
    size = config.get("size") or {}
    max_pixels = config.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
    factor = int(config.get("patch_size", 14)) * int(config.get("merge_size", 2))
    return int(max_pixels) // (factor * factor)


def _largest_video(model_dir: Path, max_frames: int) -> int:
    """Qwen2-VL and Qwen2.5-VL bound each frame by ``longest_edge`` pixels: one temporal group of
    ``temporal_patch_size`` frames gives at most ``longest_edge / factor²`` placeholders. Qwen3-VL bounds
    all frames together: n frames share ``longest_edge``, in ceil(n / temporal_patch_size) groups."""
    config = _video_config(model_dir)
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    qwen3 = model_type == "qwen3_vl"
    size = config.get("size") or {}
    longest = int(
        config.get("max_pixels") or size.get("longest_edge") or (32 * 32 * 768 if qwen3 else 28 * 28 * 768)
    )
    factor = int(config.get("patch_size", 16 if qwen3 else 14)) * int(config.get("merge_size", 2))
    tps = int(config.get("temporal_patch_size", 2))
    per_group = longest // (factor * factor)
    if not qwen3:
        return math.ceil(max_frames / tps) * per_group
    return max(
        (math.ceil(n / tps) * longest // n) // (factor * factor) for n in range(tps, max(tps, max_frames) + 1)
    )


def _video_config(model_dir: Path) -> dict[str, Any]:
    """The video processor's JSON where transformers looks for it (processor_config.json's
    ``video_processor``, video_preprocessor_config.json, else the image processor's)."""
    nested = model_dir / "processor_config.json"
    if nested.exists() and (video := json.loads(nested.read_text()).get("video_processor")) is not None:
        return dict(video)
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (model_dir / name).exists():
            return dict(json.loads((model_dir / name).read_text()))
    return {}
