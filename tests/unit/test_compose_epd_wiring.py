"""docker-compose.yml's ``epd`` profile (encoder / LM split over Mooncake), checked without a Docker
engine: only under the profile, every instance's environment builds valid Settings in the role its half
plays, and the addresses wire master ⇐ holder, instances ⇒ master, proxy ⇒ encoder and LM.
tests/e2e/test_compose_epd.py runs the same commands as processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from app.settings import Settings

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "docker-compose.yml"
EPD = ("mooncake-master", "mooncake-holder", "epd-encoder", "epd-lm", "epd-proxy")


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(COMPOSE_FILE.read_text())["services"]


def flag(argv: list[str], name: str) -> str:
    """The value of ``--name=value`` or ``--name value`` in ``argv``."""
    for index, arg in enumerate(argv):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name:
            return argv[index + 1]
    raise KeyError(name)


def settings_of(service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Settings:
    for key, value in service["environment"].items():
        monkeypatch.setenv(key, str(value))
    return Settings()


def test_the_split_runs_only_under_its_profile(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        assert (name in EPD) == ("epd" in service.get("profiles", [])), name


def test_instances_play_their_half(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    encoder = settings_of(services["epd-encoder"], monkeypatch)
    assert services["epd-encoder"]["command"] == ["mmserve", "serve", "--encoder-only"]
    assert encoder.ec_connector == "mooncake" and encoder.ec_role in ("producer", "both")
    monkeypatch.delenv("MMSERVE_EC_ROLE")
    lm = settings_of(services["epd-lm"], monkeypatch)
    assert services["epd-lm"]["command"] == ["mmserve", "serve"]
    assert lm.ec_connector == "mooncake" and lm.ec_role in ("consumer", "both")
    for settings, name in ((encoder, "epd-encoder"), (lm, "epd-lm")):
        assert settings.host == "0.0.0.0"
        assert settings.ec_mooncake_local_hostname == name, "other clients reach it by its service name"
        assert str(settings.port) in [str(p) for p in services[name]["expose"]]


def test_store_addresses_meet(services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    master_argv = services["mooncake-master"]["command"]
    assert master_argv[0] == "mooncake_master"
    rpc_port = flag(master_argv, "--rpc_port")
    assert rpc_port in [str(p) for p in services["mooncake-master"]["expose"]]
    holder_argv = services["mooncake-holder"]["command"]
    assert holder_argv[0] == "mooncake_client"
    assert flag(holder_argv, "--master_server_address") == f"mooncake-master:{rpc_port}"
    assert int(flag(holder_argv, "--global_segment_size")) >= 16 << 20, "mooncake_client's minimum"
    assert flag(holder_argv, "--local_buffer_size") == "0"
    for name in ("epd-encoder", "epd-lm"):
        assert settings_of(services[name], monkeypatch).ec_mooncake_master == f"mooncake-master:{rpc_port}"
        assert "mooncake-holder" in services[name]["depends_on"]


def test_proxy_fronts_the_encoder_and_the_lm(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = services["epd-proxy"]["command"]
    assert argv[:2] == ["mmserve", "proxy"]
    for option, name in (("--encoder-url", "epd-encoder"), ("--lm-url", "epd-lm")):
        url = urlsplit(flag(argv, option))
        assert url.hostname == name
        assert url.port == settings_of(services[name], monkeypatch).port
    port = flag(argv, "--port")
    assert f"{port}:{port}" in [str(p) for p in services["epd-proxy"]["ports"]]
    assert f":{port}/health" in " ".join(services["epd-proxy"]["healthcheck"]["test"])
