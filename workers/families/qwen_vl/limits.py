"""The Qwen families' limits from the checkpoint's JSON alone (no torch): what the launcher and the
engine need to derive the encoder budgets without loading a processor."""

from __future__ import annotations

import json
from pathlib import Path


def largest_item_tokens(model_dir: Path) -> int:
    """``max_pixels`` over the area of one merged patch: smart_resize never goes above max_pixels."""
    config = json.loads((model_dir / "preprocessor_config.json").read_text())
    size = config.get("size") or {}
    max_pixels = config.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
    factor = int(config.get("patch_size", 14)) * int(config.get("merge_size", 2))
    return int(max_pixels) // (factor * factor)
