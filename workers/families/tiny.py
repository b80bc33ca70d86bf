"""Tiny, randomly initialised checkpoints of every family, for tests, benchmarks and `make serve`.

Each is built locally in about a second (no hub, no downloads), has the family's real vision geometry
and processor settings, and is deterministic: same family and seed ⇒ bit-identical files.
"""

from __future__ import annotations

from pathlib import Path

TINY_FAMILIES = ("llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def build_tiny_model(family: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny ``family`` checkpoint into ``out_dir`` (replacing a checkpoint already there) and
    return its path. ValueError for a family not in ``TINY_FAMILIES``."""
    if family == "llava":
        from workers.families.llava.tiny import build_tiny as build_llava

        return build_llava(out_dir, seed=seed)
    if family in TINY_FAMILIES:
        from workers.families.qwen_vl.tiny import build_tiny as build_qwen

        return build_qwen(out_dir, family, seed=seed)
    raise ValueError(f"no tiny checkpoint for family {family!r}; known: {list(TINY_FAMILIES)}")
