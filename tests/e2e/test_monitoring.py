"""The ``monitoring`` profile checked against a real Prometheus (Debian's ``prometheus``) scraping a real
``mmserve serve`` (with the encoder-cache connector on a folder) and ``mmserve proxy`` in front of it,
with monitoring/prometheus.yml and monitoring/rules.yml: every query of every dashboard panel and every
rule parses, each that the traffic moves shows it, no alert fires on a healthy server, the epd alert
fires only when part of that profile is up, and every metric the dashboard and the rules name is on
``/metrics``. ``promtool`` checks the rules and the configuration."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.monitoring_stack import (
    PROMETHEUS_CONFIG,
    PROMETHEUS_MISSING,
    RULES,
    Prometheus,
    Query,
    dashboard,
    every_kind_of_request,
    panel_queries,
    rule_queries,
    scraped_up,
    start_prometheus,
    steady_traffic,
    wait_until,
)
from tests.e2e.server import Server, free_port, serving, start_proxy

pytestmark = pytest.mark.slow

EPD_DOWN = "MmserveEpdInstanceDown"
QUIET_REASONS = {
    "no request fails with a 5xx on a healthy server": [
        "5xx share / 5xx",
        "instance:mmserve_http_5xx_ratio:rate5m{}",
    ],
    "this server runs the LRU processor cache and IPC mirror, not the shm ring "
    "(tests/e2e/test_shm_serving.py covers the ring's counters)": [
        "IPC mirror and shm ring: bytes API to engine / written into the shm ring",
        "Shared-memory store / fallbacks",
        "Shared-memory store / stale references",
    ],
    "at this load nothing waits for a slot nor runs out of KV blocks": [
        "Requests in the engine / waiting",
        "Requests in the engine / preemptions/s",
    ],
    "nothing restarts here (tests/e2e/test_process_faults.py kills roles)": [
        "Restarts / worker lost {{instance}}",
        "Restarts / engine or worker restarted {{instance}}",
    ],
    "no bad message is sent (tests/e2e/test_bad_messages.py sends them)": [
        "Bad messages / {{process}} from {{source}}",
    ],
    "the worker answers every step and the mirror never misses": [
        "Failed steps and safety nets / failed steps",
        "Failed steps and safety nets / stale replies",
        "Failed steps and safety nets / IPC resends",
    ],
    "the connector's store (a local folder) never fails": [
        "Connector failures / lookup errors",
        "Connector failures / load failures",
        "Connector failures / save failures",
        "Connector failures / fallback encodes",
    ],
    "both instances behind the proxy answer": [
        "Proxy traffic / encoder failures",
        "Proxy traffic / LM errors",
    ],
}
# Queries whose answer may be empty or 0 after this traffic; every other one must show a value above 0.
QUIET = {key: reason for reason, keys in QUIET_REASONS.items() for key in keys}
# the gauges of requests in flight, which only a scrape during traffic sees above 0
ENGINE_GAUGES = ("mmserve_num_requests_running", "mmserve_kv_cache_usage_ratio")


@dataclass
class Stack:
    server: Server
    proxy: Server
    prometheus: Prometheus
    traffic_start: float
    statuses: Counter[int]
    epd_down_before_proxy: list[dict[str, Any]]


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if shutil.which("prometheus") is None:
        pytest.skip(PROMETHEUS_MISSING)
    folder = tmp_path_factory.mktemp("monitoring")
    connector = (
        "--ec-connector",
        "shared-storage",
        "--ec-storage-path",
        str(folder / "ec"),
        "--ec-role",
        "both",
    )
    with serving(tiny_model_dir, folder, *connector) as server:
        proxy_port = free_port()
        targets = {
            "api:8000": f"127.0.0.1:{server.port}",
            "epd-encoder:8001": f"127.0.0.1:{free_port()}",  # not started: nothing listens
            "epd-lm:8002": f"127.0.0.1:{free_port()}",
            "epd-proxy:8010": f"127.0.0.1:{proxy_port}",  # started below
        }
        prometheus = start_prometheus(targets, folder / "prometheus")
        proxy = None
        try:
            wait_until(lambda: scraped_up(prometheus, "api:8000"), 20, "api scraped", prometheus)
            wait_until(lambda: len(prometheus.query('up{job="mmserve-epd"} == 0')) == 3, 20, "epd down")
            # the epd profile is not started: its targets are down, and that is no outage
            epd_down_before_proxy = prometheus.query(_rule(EPD_DOWN).expr)
            proxy = start_proxy(folder, server.base_url, server.base_url, port=proxy_port)
            wait_until(lambda: scraped_up(prometheus, "epd-proxy:8010"), 20, "proxy scraped", prometheus)
            traffic_start = time.time()
            statuses = every_kind_of_request(server.base_url, proxy.base_url)
            statuses += steady_traffic(server.base_url, 3.0)
            # The engine's gauges are sampled by the scrapes: on a loaded machine a short load can fall
            # between two of them. More of it (bounded) until a scrape has seen requests running.
            for _ in range(4):
                if all(prometheus.query(f"max_over_time({gauge}[1m]) > 0") for gauge in ENGINE_GAUGES):
                    break
                statuses += steady_traffic(server.base_url, 3.0)
            traffic_end = time.time()
            # two more scrapes and rule evaluations after the last answer
            wait_until(lambda: _latest_scrape(prometheus) > traffic_end + 2, 20, "scraped after traffic")
            yield Stack(server, proxy, prometheus, traffic_start, statuses, epd_down_before_proxy)
        finally:
            if proxy is not None:
                proxy.process.interrupt()
            prometheus.stop()


def _latest_scrape(prometheus: Prometheus) -> float:
    result = prometheus.query('timestamp(up{instance="api:8000"})')
    return float(result[0]["value"][1]) if result else 0.0


def _holding(prometheus: Prometheus, expr: str) -> list[str]:
    """The instances an alert's expression holds for at each of three evaluations a second apart: one
    scrape that a busy machine slowed past its 1 s timeout is not an outage (the rules want a minute)."""
    now = time.time()
    answers = [prometheus.api("query", query=expr, time=now - ago)["result"] for ago in (0, 1, 2)]
    held = [{sample["metric"].get("instance", "") for sample in answer} for answer in answers]
    return sorted(set.intersection(*held))


def _rule(name: str) -> Query:
    (rule,) = [query for query in rule_queries() if query.key == name]
    return rule


def _values(result: list[dict[str, Any]]) -> list[float]:
    """Every value of a query_range answer (a matrix), NaN and infinities left out."""
    values = [float(value) for series in result for _, value in series["values"]]
    return [value for value in values if math.isfinite(value)]


def test_the_traffic_was_answered(stack: Stack) -> None:
    assert {status for status in stack.statuses if status != 200} == {400, 404}, stack.statuses
    assert stack.statuses[404] == stack.statuses[400] == 1
    assert stack.statuses[200] > 20  # the fixed requests and the steady traffic


def test_quiet_list_names_only_real_queries() -> None:
    keys = {query.key for query in [*panel_queries(), *rule_queries()]}
    assert not set(QUIET) - keys, f"not a query of the dashboard or the rules: {sorted(set(QUIET) - keys)}"


def test_every_panel_query_answers_and_moves_with_traffic(stack: Stack) -> None:
    prometheus, now = stack.prometheus, time.time()
    silent = []
    for query in panel_queries():
        values = _values(prometheus.query_range(query.expr, stack.traffic_start, now))  # raises if it fails
        if query.key not in QUIET and not any(value > 0 for value in values):
            silent.append(f"{query.key}: {query.expr} -> {values[-3:]}")
    assert not silent, "panels the traffic should move show nothing:\n" + "\n".join(silent)


def test_every_rule_answers_and_no_alert_fires_on_a_healthy_server(stack: Stack) -> None:
    prometheus = stack.prometheus
    silent, firing = [], {}
    for rule in rule_queries():
        result = prometheus.query(rule.expr)  # raises if it does not parse or evaluate
        if rule.kind == "record":
            values = [float(sample["value"][1]) for sample in result]
            if rule.key not in QUIET and not any(math.isfinite(v) and v > 0 for v in values):
                silent.append(f"{rule.key}: {values}")
            assert prometheus.query(rule.key), f"{rule.key} was not recorded"  # Prometheus evaluated it
        elif result and (holding := _holding(prometheus, rule.expr)):
            firing[rule.key] = holding
    assert not silent, "recording rules the traffic should move show nothing:\n" + "\n".join(silent)
    # The proxy is up while the epd profile's encoder and LM instances are not: part of the split is down.
    assert firing == {EPD_DOWN: ["epd-encoder:8001", "epd-lm:8002"]}


def test_the_epd_alert_stays_quiet_while_the_profile_is_not_started(stack: Stack) -> None:
    assert stack.epd_down_before_proxy == []


def test_prometheus_loaded_every_rule_and_evaluates_it(stack: Stack) -> None:
    groups = stack.prometheus.api("rules")["groups"]
    loaded = [rule for group in groups for rule in group["rules"]]
    assert len(loaded) == len(rule_queries())
    unhealthy = {rule["name"]: rule.get("lastError") for rule in loaded if rule["health"] != "ok"}
    assert not unhealthy


def test_the_instance_variable_lists_the_server(stack: Stack) -> None:
    """The dashboard's ``label_values(metric, instance)``, as Grafana asks it."""
    (variable,) = dashboard()["templating"]["list"]
    match = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["definition"])
    assert match is not None, variable["definition"]
    metric, label = match.groups()
    values = stack.prometheus.api(f"label/{label}/values", **{"match[]": metric})
    assert values == ["api:8000"]


def _sample_names(text: str) -> set[str]:
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and line[0] != "#"}


def test_every_metric_named_is_on_metrics(stack: Stack) -> None:
    exposed = _sample_names(httpx.get(f"{stack.server.base_url}/metrics").text)
    exposed |= _sample_names(httpx.get(f"{stack.proxy.base_url}/metrics").text)
    recorded = {query.key.split("{")[0] for query in rule_queries() if query.kind == "record"}
    named = set()
    for query in [*panel_queries(), *rule_queries()]:
        for name in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", re.sub(r'"[^"]*"', '""', query.expr)):
            if name.startswith("mmserve_") or ":" in name:
                named.add(name)
    assert {name for name in named if name.startswith("mmserve_")} > {
        "mmserve_time_to_first_token_seconds_bucket"
    }
    assert not named - exposed - recorded, (
        f"not on /metrics nor recorded: {sorted(named - exposed - recorded)}"
    )


@pytest.mark.parametrize(
    "args",
    [("check", "rules", str(RULES)), ("check", "config", str(PROMETHEUS_CONFIG))],
    ids=["rules", "config"],
)
def test_promtool_accepts_the_files(args: tuple[str, ...]) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(PROMETHEUS_MISSING)
    done = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
