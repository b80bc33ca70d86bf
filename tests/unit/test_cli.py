"""The command line: every settings field is a documented flag and an environment variable."""

from __future__ import annotations

import pytest

from app.cli import build_parser, engine_config, main, settings_from_args, worker_config
from app.settings import Settings


@pytest.mark.parametrize("role", ["serve", "api", "engine", "worker"])
def test_every_setting_is_a_documented_flag(role: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([role, "--help"])
    help_text = capsys.readouterr().out
    for name, field in Settings.model_fields.items():
        assert "--" + name.replace("_", "-") in help_text
        assert f"MMSERVE_{name.upper()}" in help_text
        assert field.description


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMSERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("MMSERVE_PORT", "9000")
    args = build_parser().parse_args(["api", "--port", "8123"])
    settings = settings_from_args(args)
    assert settings.port == 8123  # flag wins
    assert settings.max_num_seqs == 7  # environment fills what flags leave out


def test_settings_reach_engine_and_worker_configs(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        '{"model_type": "llava", "text_config": {"max_position_embeddings": 1234},'
        ' "vision_config": {"image_size": 336, "patch_size": 14}}'
    )
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            str(tmp_path),
            "--max-num-batched-tokens",
            "512",
            "--encoder-cache-tokens",
            "0",
            "--worker-addr",
            "tcp://127.0.0.1:7001",
            "--device",
            "cpu",
        ]
    )
    settings = settings_from_args(args)
    engine = engine_config(settings)
    assert engine.max_model_len == 1234  # from the checkpoint when --max-model-len is not given
    # defaults to the step's token budget, but never below the largest image (576 LLaVA tokens)
    assert engine.encoder_compute_budget_tokens == 576
    assert engine.encoder_cache_tokens == 0
    assert worker_config(settings).worker_addr == engine.worker_addr == "tcp://127.0.0.1:7001"
    assert settings.model_name == tmp_path.name


def test_invalid_settings_exit_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    assert main(["engine", "--engine-addr", "http://nope"]) == 2


def test_missing_model_folder_is_reported(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", str(tmp_path / "absent")]) == 2
    assert "build-tiny-model" in capsys.readouterr().err
