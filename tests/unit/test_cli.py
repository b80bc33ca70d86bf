"""The command line: every settings field is a documented flag and an environment variable."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import app.launch.launcher
from app.launch.cli import build_parser, is_env_only, main, settings_from_args
from app.launch.process_configs import engine_config, worker_config
from app.proxy.cli import config_from_args
from app.settings import Settings
from engine.step_plan import SchedulerConfig


@pytest.mark.parametrize("role", ["serve", "api", "engine", "worker"])
def test_every_setting_is_a_documented_flag(role: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every setting but a secret is a flag; a secret is an environment variable only."""
    with pytest.raises(SystemExit):
        build_parser().parse_args([role, "--help"])
    help_text = capsys.readouterr().out
    for name, field in Settings.model_fields.items():
        assert field.description
        if is_env_only(name):
            assert "--" + name.replace("_", "-") not in help_text
            continue
        assert "--" + name.replace("_", "-") in help_text
        assert f"MMSERVE_{name.upper()}" in help_text


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
    assert engine.scheduler.max_model_len == 1234  # from the checkpoint when --max-model-len is not given
    # defaults to the step's token budget, but never below the largest image (576 LLaVA tokens)
    assert engine.scheduler.encoder_compute_budget_tokens == 576
    assert engine.scheduler.encoder_cache_tokens == 0
    assert engine.scheduler.max_num_batched_tokens == 512
    assert worker_config(settings).worker_addr == engine.worker_addr == "tcp://127.0.0.1:7001"
    assert settings.model_name == tmp_path.name


def test_the_worker_completes_the_engines_scheduler_options() -> None:
    settings = Settings(max_model_len=512, encoder_cache_tokens=100, encoder_compute_budget_tokens=50)
    options = engine_config(settings).scheduler
    config = SchedulerConfig.for_worker(options, num_kv_blocks=8, block_size=32, can_encode=False)
    for field in dataclasses.fields(options):
        assert getattr(config, field.name) == getattr(options, field.name)
    assert (config.num_kv_blocks, config.block_size, config.can_encode) == (8, 32, False)
    # what the flags left out comes from the settings' defaults (the configs have none of their own)
    assert (config.max_num_seqs, config.max_waiting_requests) == (settings.max_num_seqs, 1024)
    assert worker_config(settings).block_size == settings.block_size


def test_the_proxy_defaults_as_an_api_process() -> None:
    args = build_parser().parse_args(["proxy", "--encoder-url", "http://e:1", "--lm-url", "http://l:2"])
    config = config_from_args(args)
    for name in ("host", "port", "max_request_body_mb", "log_level"):
        assert getattr(config, name) == Settings.model_fields[name].default


def test_the_launcher_does_not_import_the_cli() -> None:
    """The CLI starts the launcher; the launcher gets configs from app/launch/process_configs.py."""
    tree = ast.parse(Path(app.launch.launcher.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "app.launch.cli" not in imported and "app.launch.process_configs" in imported


def test_invalid_settings_exit_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    assert main(["engine", "--engine-addr", "http://nope"]) == 2


def test_missing_model_folder_is_reported(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", str(tmp_path / "absent")]) == 2
    assert "build-tiny-model" in capsys.readouterr().err
