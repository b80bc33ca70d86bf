"""Settings of the encoder-cache connector and of an encoder / LM split: invalid combinations are
refused at start with a message naming the flag to fix; valid ones become the ``ECConfig`` the engine
and the worker share; every knob is a CLI flag."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from app.launch.cli import build_parser, settings_from_args
from app.launch.process_configs import ec_config, worker_config
from app.settings import GIB, Settings
from wire.ec_store import ECConfig, ECRole
from workers.config import ModelParts

EC_FLAGS = [
    "--ec-connector",
    "--ec-role",
    "--ec-storage-path",
    "--ec-storage-max-gb",
    "--encoder-only",
    "--language-model-only",
]


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in Settings.model_fields:
        monkeypatch.delenv(f"MMSERVE_{name.upper()}", raising=False)


def refused(**values: Any) -> str:
    with pytest.raises(ValidationError) as info:
        Settings(**values)
    return str(info.value)


SHARED = {"ec_connector": "shared-storage", "ec_storage_path": "/srv/ec"}


@pytest.mark.parametrize("flag", ["encoder_only", "language_model_only"])
def test_a_split_half_without_a_connector_is_refused(flag: str) -> None:
    message = refused(**{flag: True})
    assert f"--{flag.replace('_', '-')} needs --ec-connector" in message


def test_both_halves_at_once_are_refused() -> None:
    message = refused(encoder_only=True, language_model_only=True, **SHARED)
    assert "--encoder-only and --language-model-only exclude each other" in message


def test_an_encoder_only_consumer_is_refused() -> None:
    message = refused(encoder_only=True, ec_role="consumer", **SHARED)
    assert "--encoder-only" in message and "--ec-role producer" in message


def test_a_language_model_only_producer_is_refused() -> None:
    message = refused(language_model_only=True, ec_role="producer", **SHARED)
    assert "--language-model-only" in message and "--ec-role consumer" in message


def test_shared_storage_without_a_folder_is_refused() -> None:
    assert "--ec-storage-path" in refused(ec_connector="shared-storage")
    assert "--ec-storage-path" in refused(ec_connector="shared-storage", ec_storage_path="")


@pytest.mark.parametrize(
    "values",
    [{"ec_connector": "nfs"}, {**SHARED, "ec_role": "reader"}, {**SHARED, "ec_storage_max_gb": -1}],
    ids=["unknown-connector", "unknown-role", "negative-bound"],
)
def test_unknown_or_negative_values_are_refused(values: dict[str, Any]) -> None:
    refused(**values)


def test_no_connector_means_no_ec_config() -> None:
    settings = Settings()
    assert settings.ec_connector is None and ec_config(settings) is None
    assert worker_config(settings).ec is None and worker_config(settings).parts is ModelParts.ALL


@pytest.mark.parametrize(
    ("split", "role", "parts"),
    [
        ({"encoder_only": True}, "producer", ModelParts.ENCODER),
        ({"encoder_only": True}, "both", ModelParts.ENCODER),
        ({"language_model_only": True}, "consumer", ModelParts.LANGUAGE_MODEL),
        ({}, "both", ModelParts.ALL),
    ],
)
def test_valid_combinations_give_the_shared_ec_config(
    split: dict[str, bool], role: str, parts: ModelParts
) -> None:
    settings = Settings(**SHARED, ec_role=role, ec_storage_max_gb=0.5, **split)
    expected = ECConfig("shared-storage", ECRole(role), storage_path="/srv/ec", storage_max_bytes=GIB // 2)
    assert ec_config(settings) == expected
    worker = worker_config(settings)
    assert worker.ec == expected and worker.parts is parts


def test_mooncake_needs_no_folder_and_carries_its_addresses() -> None:
    settings = Settings(
        ec_connector="mooncake", ec_mooncake_master="127.0.0.1:6000", ec_mooncake_local_hostname="127.0.0.2"
    )
    config = ec_config(settings)
    assert config is not None and config.connector == "mooncake" and config.role is ECRole.BOTH
    assert (config.mooncake_master, config.mooncake_local_hostname) == ("127.0.0.1:6000", "127.0.0.2")
    assert config.storage_path == ""


def test_the_default_bound_is_16_gib() -> None:
    config = ec_config(Settings(**SHARED))
    assert config is not None and config.storage_max_bytes == 16 * GIB


@pytest.mark.parametrize("role", ["serve", "engine", "worker"])
def test_the_cli_has_every_connector_flag(role: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([role, "--help"])
    help_text = capsys.readouterr().out
    for flag in EC_FLAGS:
        assert flag in help_text
    assert "--no-encoder-only" in help_text  # booleans are switches


def test_cli_flags_reach_the_ec_config(tmp_path) -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--ec-connector",
            "shared-storage",
            "--ec-role",
            "consumer",
            "--ec-storage-path",
            str(tmp_path),
            "--ec-storage-max-gb",
            "2",
            "--language-model-only",
        ]
    )
    settings = settings_from_args(args)
    assert settings.language_model_only and not settings.encoder_only
    assert ec_config(settings) == ECConfig(
        "shared-storage", ECRole.CONSUMER, storage_path=str(tmp_path), storage_max_bytes=2 * GIB
    )


def test_cli_refuses_a_split_without_a_connector() -> None:
    args = build_parser().parse_args(["serve", "--encoder-only"])
    with pytest.raises(ValidationError, match="--encoder-only needs --ec-connector"):
        settings_from_args(args)


def test_an_encoder_only_instance_refuses_the_priority_policy() -> None:
    """It takes requests as they come: a priority it would not read is refused at start, not ignored."""
    message = refused(encoder_only=True, scheduling_policy="priority", **SHARED)
    assert "--encoder-only" in message and "--scheduling-policy" in message
