"""Fixtures shared by every test tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.families.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LLaVA checkpoint (seed 0), built once per test session; a few seconds on a CPU."""
    # the folder name is the served model name: "tiny-llava", as in `make serve`
    return build_tiny_model("llava", tmp_path_factory.mktemp("models") / "tiny-llava", seed=0)
