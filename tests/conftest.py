"""Fixtures shared by every test tier."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from workers.families.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model(family)``: that family's tiny checkpoint (seed 0), built once per test session (a few
    seconds each on a CPU) and read, never written, by every test. The folder name is the served model
    name: ``tiny-<family>``, as in `make serve`."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny_model(
                family, tmp_path_factory.mktemp("models") / f"tiny-{family}", seed=0
            )
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model: Callable[[str], Path]) -> Path:
    """The tiny LLaVA checkpoint."""
    return tiny_model("llava")
