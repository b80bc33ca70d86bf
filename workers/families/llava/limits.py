"""LLaVA-1.5's limits from the checkpoint's JSON alone (no torch): what the launcher and the engine need
to derive the encoder budgets without loading a processor."""

from __future__ import annotations

import json
from pathlib import Path


def largest_item_tokens(model_dir: Path, max_video_frames: int) -> int:
    """Every image becomes the vision tower's square: one token per patch (the CLS one dropped); LLaVA
    takes no video."""
    vision = json.loads((model_dir / "config.json").read_text()).get("vision_config", {})
    return int((vision.get("image_size", 336) // vision.get("patch_size", 14)) ** 2)
