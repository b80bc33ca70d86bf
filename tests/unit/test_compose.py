"""docker-compose.yml, Dockerfile targets and bench/locustfile.py, checked without Docker.

The schema is the compose-spec JSON schema shipped inside the ``docker-compose==1.29.2`` wheel
(``compose/config/compose_spec.json``); the Makefile installs it with

    pip install --no-deps docker-compose==1.29.2

(``--no-deps``: only the JSON file is used; its own dependencies would clash with ours).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shlex
import sys
import types
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from app.settings import Settings
from wire.curve import leaves_host

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
LOCUSTFILE = ROOT / "bench" / "locustfile.py"

ROLES = ("api", "engine", "worker")
SCHEMA_PIP = "pip install --no-deps docker-compose==1.29.2"
ENV_NAME = re.compile(r"\bMMSERVE_[A-Z0-9_]+\b")


# --- helpers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def _argv(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(arg) for arg in command]


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # ["KEY=value", ...]
        env = dict(item.split("=", 1) for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def _is_server(service: dict[str, Any]) -> bool:
    """An mmserve process (a role or model-init), configured by Settings; not the locust client, nor
    the proxy (its own flags) or Mooncake's processes (tests/unit/test_compose_epd_wiring.py)."""
    argv = _argv(service)
    return "mmserve" in " ".join(argv).split() and "proxy" not in argv


def _mounts(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(source, target, read_only) for each volume entry, short or long syntax."""
    mounts = []
    for entry in service.get("volumes", []):
        if isinstance(entry, str):
            parts = entry.split(":")
            mounts.append((parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(",")))
        else:
            mounts.append((entry.get("source", ""), entry["target"], bool(entry.get("read_only"))))
    return mounts


def _settings_from_env(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings exactly as the process builds it from its environment."""
    for name in list(os.environ):
        if name.startswith("MMSERVE_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return Settings()


def _bench_env_names() -> set[str]:
    return set(re.findall(r"os\.environ\.get\(\s*\"(MMSERVE_[A-Z0-9_]+)\"", LOCUSTFILE.read_text()))


def _settings_env_names() -> set[str]:
    return {f"MMSERVE_{field.upper()}" for field in Settings.model_fields}


# --- schema -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_schema() -> dict[str, Any]:
    spec = importlib.util.find_spec("compose")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    paths = [Path(location) / "config" / "compose_spec.json" for location in locations]
    found = [path for path in paths if path.is_file()]
    if not found:
        pytest.skip(f"compose-spec schema not installed; run: {SCHEMA_PIP}")
    return json.loads(found[0].read_text())


def _schema_errors(schema: dict[str, Any], document: dict[str, Any]) -> list[str]:
    from jsonschema import Draft201909Validator

    # The file declares "http://json-schema.org/draft/2019-09/schema#", a spelling jsonschema does not
    # map to a draft by itself (it would warn and fall back to the latest one), so name it here.
    assert "2019-09" in schema["$schema"], schema["$schema"]
    Draft201909Validator.check_schema(schema)
    # No format checker: the spec's "duration" format means Go durations ("10s"), which jsonschema's
    # checker would judge as ISO 8601.
    validator = Draft201909Validator(schema)
    return [
        f"{'/'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
        for error in sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.path)))
    ]


def test_compose_file_validates_against_compose_spec(compose, compose_schema):
    assert _schema_errors(compose_schema, compose) == []


def test_schema_validation_catches_mistakes(compose, compose_schema):
    broken = copy.deepcopy(compose)
    broken["services"]["api"]["enviroment"] = {"MMSERVE_PORT": "8000"}
    broken["services"]["worker"]["depends_on"]["engine"]["condition"] = "service_ready"
    errors = _schema_errors(compose_schema, broken)
    assert any("enviroment" in error for error in errors), errors
    assert any("service_ready" in error or "depends_on" in error for error in errors), errors


def test_every_named_volume_is_declared(compose):
    """The schema does not check it; compose refuses to start a service whose named volume (e.g. the
    monitoring profile's prometheus-data) is not declared at the top level."""
    declared = set(compose.get("volumes") or {})
    for name, service in _services(compose).items():
        for source, _, _ in _mounts(service):
            assert source.startswith(("./", "/")) or source in declared, f"{name}: volume {source}"


# --- roles and settings -------------------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_each_role_is_its_own_service(compose, role):
    assert _argv(_services(compose)[role]) == ["mmserve", role]


def test_every_mmserve_env_var_in_the_file_is_known():
    """Catches typos anywhere, comments included: a Settings field or a knob the locustfile reads."""
    used = set(ENV_NAME.findall(COMPOSE_FILE.read_text()))
    unknown = used - _settings_env_names() - _bench_env_names()
    assert not unknown, f"not Settings fields nor locustfile knobs: {sorted(unknown)}"


def test_server_services_use_only_settings_fields(compose):
    servers = {name: svc for name, svc in _services(compose).items() if _is_server(svc)}
    assert set(ROLES) <= set(servers)
    for name, service in servers.items():
        unknown = {key for key in _env(service) if key.startswith("MMSERVE_")} - _settings_env_names()
        assert not unknown, f"{name}: {sorted(unknown)} are not fields of app.settings.Settings"


@pytest.mark.parametrize("role", ROLES)
def test_role_environment_builds_valid_settings(compose, role, monkeypatch):
    settings = _settings_from_env(_env(_services(compose)[role]), monkeypatch)
    assert settings.model_name == "tiny-llava"


def test_ipc_cache_size_is_set_where_it_is_decided(compose):
    """The API's mirror alone decides what the engine's receiver cache holds
    (docs/architecture.md, "IPC mirror"): the size is
    an API setting; the engine, which obeys, is not given one that could disagree."""
    assert "MMSERVE_MM_IPC_CACHE_GB" in _env(_services(compose)["api"])
    assert "MMSERVE_MM_IPC_CACHE_GB" not in _env(_services(compose)["engine"])


# --- wiring -------------------------------------------------------------------------------------


def test_engine_binds_and_peers_connect_to_it_by_service_name(compose):
    services = _services(compose)
    engine_env = _env(services["engine"])
    engine_side = urlsplit(engine_env["MMSERVE_ENGINE_ADDR"])
    worker_side = urlsplit(engine_env["MMSERVE_WORKER_ADDR"])
    for bound in (engine_side, worker_side):
        assert bound.scheme == "tcp" and bound.hostname in ("0.0.0.0", "*"), bound.geturl()
    assert engine_side.port != worker_side.port

    api_connects = urlsplit(_env(services["api"])["MMSERVE_ENGINE_ADDR"])
    worker_connects = urlsplit(_env(services["worker"])["MMSERVE_WORKER_ADDR"])
    assert (api_connects.scheme, api_connects.hostname, api_connects.port) == (
        "tcp",
        "engine",
        engine_side.port,
    )
    assert (worker_connects.scheme, worker_connects.hostname, worker_connects.port) == (
        "tcp",
        "engine",
        worker_side.port,
    )
    assert {str(engine_side.port), str(worker_side.port)} <= {
        str(p) for p in services["engine"].get("expose", [])
    }


def test_sockets_between_containers_are_curve_secured(compose):
    """Every role whose ZeroMQ address leaves its container mounts the deployment's CURVE key as a
    secret and names it (wire/curve.py: without it the role refuses to start); `make compose-keys`
    writes the file the secret reads."""
    services = _services(compose)
    secret_file = compose["secrets"]["mmserve_curve"]["file"]
    for role in ROLES:
        env = _env(services[role])
        addrs = [v for k, v in env.items() if k in ("MMSERVE_ENGINE_ADDR", "MMSERVE_WORKER_ADDR")]
        assert addrs and all(leaves_host(addr) for addr in addrs), role
        assert services[role]["secrets"] == ["mmserve_curve"], role
        assert env["MMSERVE_CURVE_KEY_FILE"] == "/run/secrets/mmserve_curve", role
    makefile = (ROOT / "Makefile").read_text()
    assert f"curve-keygen --out {secret_file.removeprefix('./')}" in makefile


def test_api_is_published_and_health_checked(compose):
    api = _services(compose)["api"]
    env = _env(api)
    assert env["MMSERVE_HOST"] == "0.0.0.0"
    port = env["MMSERVE_PORT"]
    assert f"{port}:{port}" in [str(p) for p in api["ports"]]
    check = api["healthcheck"]["test"]
    check = check if isinstance(check, str) else " ".join(check)
    assert f":{port}/health" in check
    assert set(api["depends_on"]) >= {"engine", "worker"}
    assert "engine" in _services(compose)["worker"]["depends_on"]


@pytest.mark.parametrize("role", ROLES)
def test_dead_roles_restart_and_drain_before_they_are_killed(compose, role):
    """A SIGKILLed role comes back (restart policy); on stop, Docker's SIGKILL comes only after the
    role's SIGTERM drain had its --shutdown-timeout."""
    service = _services(compose)[role]
    assert service["restart"] in ("always", "unless-stopped", "on-failure")
    grace = str(service["stop_grace_period"])
    assert grace.endswith("s") and float(grace[:-1]) > Settings().shutdown_timeout


def test_model_volume_is_shared_and_built_first(compose):
    services = _services(compose)
    volume_names = set(compose.get("volumes") or {})
    model_paths = set()
    for name, service in services.items():
        if not _is_server(service):
            continue
        model_path = _env(service).get("MMSERVE_MODEL")
        assert model_path, f"{name} has no MMSERVE_MODEL"
        model_paths.add(model_path)
        mounted = [
            (src, dst, ro) for src, dst, ro in _mounts(service) if Path(model_path).is_relative_to(dst)
        ]
        assert len(mounted) == 1, f"{name}: {model_path} is not on exactly one mount"
        source, _, read_only = mounted[0]
        assert source in volume_names, f"{name}: {source} is not a named volume"
        assert read_only == (name != "model-init"), f"{name}: only model-init writes the model"
    assert len(model_paths) == 1, model_paths

    (model_path,) = model_paths
    assert model_path in " ".join(_argv(services["model-init"]))
    for role in ROLES:
        condition = services[role]["depends_on"]["model-init"]["condition"]
        assert condition == "service_completed_successfully"


def test_build_targets_exist_in_dockerfile(compose):
    stages = set(
        re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", DOCKERFILE.read_text(), re.IGNORECASE | re.MULTILINE)
    )
    for name, service in _services(compose).items():
        build = service.get("build")
        if isinstance(build, dict) and "target" in build:
            assert build["target"] in stages, f"{name}: no stage {build['target']!r} in Dockerfile"


def test_locust_service_is_optional_and_targets_the_api(compose):
    services = _services(compose)
    locust = services["locust"]
    assert locust.get("profiles"), "locust must sit behind a profile so `docker compose up` skips it"
    assert all(not services[role].get("profiles") for role in ROLES)

    argv = _argv(locust)
    assert argv[:3] == ["locust", "-f", "/bench/locustfile.py"]
    api_port = _env(services["api"])["MMSERVE_PORT"]
    assert argv[argv.index("--host") + 1] == f"http://api:{api_port}"
    assert ("./bench", "/bench") in [(src, dst) for src, dst, _ in _mounts(locust)]

    env = _env(locust)
    assert {key for key in env if key.startswith("MMSERVE_")} <= _bench_env_names()
    if "MMSERVE_MODEL_NAME" in env:
        assert env["MMSERVE_MODEL_NAME"] == Path(_env(services["api"])["MMSERVE_MODEL"]).name


# --- bench/locustfile.py builders -------------------------------------------------------------


@pytest.fixture(scope="module")
def bench() -> types.ModuleType:
    """The locustfile with a stub ``locust``: importing the real one gevent-patches the whole test
    process, and locust is in the `bench` extra only. The builders under test never touch it."""
    pytest.importorskip("PIL")
    stub = types.ModuleType("locust")
    stub.HttpUser = type("HttpUser", (), {})  # type: ignore[attr-defined]
    stub.between = lambda low, high: None  # type: ignore[attr-defined]
    stub.task = lambda weight=1: lambda fn: fn  # type: ignore[attr-defined]
    spec = importlib.util.spec_from_file_location("mmserve_bench_locustfile", LOCUSTFILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "locust", stub)
        patch.setitem(sys.modules, spec.name, module)  # @dataclass looks its module up there
        spec.loader.exec_module(module)
    return module


def test_pngs_are_deterministic_sized_and_distinct(bench):
    import io

    from PIL import Image

    png = bench.make_png(64, seed=7)
    assert png == bench.make_png(64, seed=7)
    assert png != bench.make_png(64, seed=8)
    assert Image.open(io.BytesIO(png)).size == (64, 64)
    assert bench.unique_image_url(32) != bench.unique_image_url(32)


def test_repeated_pool_is_fixed(bench):
    pool = bench.image_pool(32, 3)
    assert len(set(pool)) == 3
    assert bench.image_pool(32, 3) is pool
    assert all(url.startswith("data:image/png;base64,") for url in pool)


def test_chat_payload_streams_with_usage(bench):
    text = bench.chat_payload("tiny-llava", "hi", max_tokens=5)
    assert text["messages"] == [{"role": "user", "content": "hi"}]
    assert text["stream"] is True and text["stream_options"] == {"include_usage": True}
    assert text["max_tokens"] == 5

    image = bench.chat_payload("tiny-llava", "what?", "data:image/png;base64,AAAA")
    parts = image["messages"][0]["content"]
    assert [part["type"] for part in parts] == ["image_url", "text"]
    assert parts[0]["image_url"]["url"] == "data:image/png;base64,AAAA"


def _sse(*chunks: Any) -> list[bytes]:
    lines = []
    for chunk in chunks:
        data = chunk if isinstance(chunk, str) else json.dumps(chunk)
        lines += [f"data: {data}".encode(), b""]
    return lines


def _delta(content: str | None, role: str | None = None) -> dict[str, Any]:
    delta = {"content": content} | ({"role": role} if role else {})
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def test_read_sse_times_first_content_and_reads_usage(bench):
    ticks = iter([1.25, 9.0])
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    lines = _sse(
        _delta("", role="assistant"), _delta("Hel"), _delta("lo"), {"choices": [], "usage": usage}, "[DONE]"
    )
    result = bench.read_sse([b": keep-alive", *lines], t_start_s=1.0, clock=lambda: next(ticks))
    assert result.error is None
    assert result.ttft_s == pytest.approx(0.25)
    assert result.text == "Hello"
    assert result.completion_tokens == 2


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ((_delta("a"), {"error": {"message": "boom", "type": "internal_error"}}, "[DONE]"), "boom"),
        ((_delta("a"), {"choices": [], "usage": {"completion_tokens": 1}}), "[DONE]"),
        ((_delta("a"), "[DONE]"), "usage"),
        (("{not json",), "malformed"),
    ],
)
def test_read_sse_reports_broken_streams(bench, chunks, message):
    result = bench.read_sse(_sse(*chunks), t_start_s=0.0, clock=lambda: 0.0)
    assert result.error is not None and message in result.error


# --- docker-compose.shm.yml ---------------------------------------------------------------------

SHM_OVERRIDE = ROOT / "docker-compose.shm.yml"


def _merge(base: Any, override: Any) -> Any:
    """Compose's merge of a second -f file: mappings merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {key: _merge(base.get(key), value) for key, value in override.items()} | {
            key: value for key, value in base.items() if key not in override
        }
    return copy.deepcopy(override)


@pytest.fixture(scope="module")
def compose_shm(compose: dict[str, Any]) -> dict[str, Any]:
    return _merge(compose, yaml.safe_load(SHM_OVERRIDE.read_text()))


def test_shm_override_validates_against_compose_spec(compose_shm, compose_schema):
    assert _schema_errors(compose_schema, compose_shm) == []


def test_shm_override_shares_one_ipc_namespace_without_a_cycle(compose_shm):
    services = _services(compose_shm)
    assert services["engine"]["ipc"] == "shareable"
    assert services["api"]["ipc"] == services["worker"]["ipc"] == "service:engine"
    # the owner starts first: api and worker already depend on the engine, the engine on neither
    assert "engine" in services["api"]["depends_on"] and "engine" in services["worker"]["depends_on"]
    assert not {"api", "worker"} & set(services["engine"]["depends_on"])


def test_shm_override_sizes_dev_shm_for_the_ring(compose_shm, monkeypatch):
    services = _services(compose_shm)
    settings = _settings_from_env(_env(services["api"]), monkeypatch)
    assert settings.mm_processor_cache_type == "shm"
    size = services["engine"]["shm_size"]
    assert size.endswith("gb") and int(size[:-2]) * (1 << 30) > settings.processor_cache_bytes


def test_shm_override_env_names_are_settings_fields():
    assert set(ENV_NAME.findall(SHM_OVERRIDE.read_text())) <= _settings_env_names()
