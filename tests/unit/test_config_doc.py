"""docs/configuration.md is what app/launch/config_doc.py renders from the code, and names every setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.launch.cli import build_parser, is_env_only
from app.launch.config_doc import GROUPS, render
from app.settings import Settings

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_committed_page_is_current() -> None:
    assert PAGE.read_text(encoding="utf-8") == render(), (
        "docs/configuration.md is out of date: run `make docs`"
    )


def test_every_setting_is_on_the_page_as_its_flag_and_variable() -> None:
    page = PAGE.read_text(encoding="utf-8")
    for name in Settings.model_fields:
        assert f"`MMSERVE_{name.upper()}`" in page, name
        if not is_env_only(name):
            assert f"`--{name.replace('_', '-')}`" in page, name


def test_every_setting_is_in_one_group() -> None:
    grouped = [name for _, fields in GROUPS for name, _ in fields]
    assert sorted(grouped) == sorted(Settings.model_fields)


def test_each_default_is_the_one_serve_help_prints(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "100000")  # one line per flag: argparse wraps at the terminal's width
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    rows = [
        line.split(" | ") for line in PAGE.read_text(encoding="utf-8").splitlines() if "| `MMSERVE_" in line
    ]
    assert len(rows) == len(Settings.model_fields)
    for row in rows:
        env, default = row[1].strip("`"), row[3].strip("`")
        if not is_env_only(env.removeprefix("MMSERVE_").lower()):
            assert f"(default: {default}; env {env})" in help_text, env
