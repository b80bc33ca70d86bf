"""docker-compose.yml's ``monitoring`` profile and the files under monitoring/, checked without a Docker
engine: only under the profile, pinned images, published on loopback only; Prometheus scrapes exactly
the services that serve /metrics (one job per topology) and reads the mounted rules; Grafana gets the
data source and the dashboard from the mounted folders, opens on it, and the dashboard reads as a
dashboard should. (tests/unit/test_compose.py validates the whole file against the compose spec;
tests/e2e/test_monitoring.py runs Prometheus with these files against real servers.)"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
MONITORING = ("prometheus", "grafana")
HTTP_ROLES = ("serve", "api", "proxy")  # the mmserve commands that serve /metrics (engine, worker do not)


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(COMPOSE_FILE.read_text())["services"]


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> the repository file or folder mounted there (bind mounts of ./ only)."""
    mounts = {}
    for entry in service.get("volumes", []):
        source, target = entry.split(":")[:2]
        if source.startswith("./"):
            mounts[target] = ROOT / source
    return mounts


def _in_container(mounts: dict[str, Path], path: str) -> Path:
    """The repository file a container path reads, through the mount that holds it."""
    for target, source in mounts.items():
        if PurePosixPath(path).is_relative_to(target):
            return source / PurePosixPath(path).relative_to(target)
    raise AssertionError(f"{path} is on no bind mount of {sorted(mounts)}")


def _flag(argv: list[str], name: str) -> str:
    (value,) = [arg.split("=", 1)[1] for arg in argv if arg.startswith(f"{name}=")]
    return value


def _metrics_port(service: dict[str, Any]) -> str:
    argv = [str(arg) for arg in service["command"]]
    if "--port" in argv:
        return argv[argv.index("--port") + 1]
    return str(service["environment"]["MMSERVE_PORT"])


def test_monitoring_runs_only_under_its_profile(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        assert (name in MONITORING) == ("monitoring" in service.get("profiles", [])), name


@pytest.mark.parametrize("name", MONITORING)
def test_images_are_pinned_and_published_on_loopback_only(
    services: dict[str, dict[str, Any]], name: str
) -> None:
    service = services[name]
    assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", service["image"]), service["image"]
    assert service["ports"] and all(str(port).startswith("127.0.0.1:") for port in service["ports"])


def test_prometheus_scrapes_every_metrics_server_one_job_per_topology(
    services: dict[str, dict[str, Any]],
) -> None:
    """Default services in job ``mmserve``, the epd profile's in ``mmserve-epd`` (rules.yml alerts on the
    latter only while part of it is up)."""
    expected: dict[str, set[str]] = {}
    for name, service in services.items():
        argv = [str(arg) for arg in service.get("command", [])]
        if argv[:1] == ["mmserve"] and argv[1] in HTTP_ROLES:
            profiles = service.get("profiles", [])
            job = "mmserve" + "".join(f"-{profile}" for profile in profiles)
            expected.setdefault(job, set()).add(f"{name}:{_metrics_port(service)}")
    assert expected["mmserve"] == {"api:8000"}
    assert expected["mmserve-epd"] == {"epd-encoder:8001", "epd-lm:8002", "epd-proxy:8010"}

    prometheus = services["prometheus"]
    config_file = _in_container(_mounts(prometheus), _flag(prometheus["command"], "--config.file"))
    config = yaml.safe_load(config_file.read_text())
    scraped = {
        job["job_name"]: {target for group in job["static_configs"] for target in group["targets"]}
        for job in config["scrape_configs"]
    }
    assert scraped == expected
    # the rule files resolve next to the configuration, inside the container too
    for rule_file in config["rule_files"]:
        in_container = PurePosixPath(_flag(prometheus["command"], "--config.file")).parent / rule_file
        assert _in_container(_mounts(prometheus), str(in_container)).is_file(), rule_file


def test_grafana_is_provisioned_from_the_repository(services: dict[str, dict[str, Any]]) -> None:
    grafana = services["grafana"]
    mounts = _mounts(grafana)
    provisioning = _in_container(mounts, "/etc/grafana/provisioning")
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    url = urlsplit(datasource["url"])
    assert url.hostname == "prometheus" and url.hostname in services
    assert f"{url.port}" in {str(port).rsplit(":", 1)[1] for port in services["prometheus"]["ports"]}

    (provider,) = yaml.safe_load((provisioning / "dashboards" / "mmserve.yml").read_text())["providers"]
    dashboards = _in_container(mounts, provider["options"]["path"])
    home = _in_container(mounts, grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home.parent == dashboards and home.is_file()
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"

    # every panel and query asks the provisioned data source
    board = json.loads(home.read_text())
    uids = {ds["uid"] for ds in _datasources(board)}
    assert uids == {datasource["uid"]}


def _datasources(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        found = [node["datasource"]] if isinstance(node.get("datasource"), dict) else []
        return found + [ds for value in node.values() for ds in _datasources(value)]
    if isinstance(node, list):
        return [ds for value in node for ds in _datasources(value)]
    return []


@pytest.fixture(scope="module")
def board(services: dict[str, dict[str, Any]]) -> dict[str, Any]:
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    return json.loads(_in_container(_mounts(services["grafana"]), home).read_text())


def test_every_panel_says_in_one_line_what_it_shows(board: dict[str, Any]) -> None:
    panels = [panel for panel in board["panels"] if panel["type"] != "row"]
    assert len(panels) >= 20
    for panel in panels:
        description = panel.get("description", "")
        assert 20 <= len(description) <= 200 and "\n" not in description, panel["title"]
        assert panel["targets"] and all(target["expr"].strip() for target in panel["targets"]), panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
    titles = [panel["title"] for panel in panels]
    assert len(set(titles)) == len(titles)


def test_panels_tile_the_grid(board: dict[str, Any]) -> None:
    """Unique ids; every panel within 24 columns; no two overlap."""
    ids = [panel["id"] for panel in board["panels"]]
    assert len(set(ids)) == len(ids)
    taken: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_the_dashboard_uses_only_its_own_variables(board: dict[str, Any]) -> None:
    defined = {variable["name"] for variable in board["templating"]["list"]}
    exprs = " ".join(target["expr"] for panel in board["panels"] for target in panel.get("targets", []))
    used = set(re.findall(r"\$(\w+)", exprs)) - {"__rate_interval", "__interval"}
    assert used == defined == {"instance"}
