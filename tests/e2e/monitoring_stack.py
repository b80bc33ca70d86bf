"""docker compose's ``monitoring`` profile as local processes, for tests/e2e/test_monitoring.py and
monitoring/draw_dashboard.py (no Docker engine here):

- the queries of the Grafana dashboard (monitoring/grafana/dashboards/mmserve.json) with its variables
  replaced as Grafana replaces them, and the expressions of monitoring/rules.yml;
- Debian's ``prometheus`` with monitoring/prometheus.yml: each compose target (``api:8000``) rewritten to
  a loopback address and kept as its ``instance`` label, a short scrape interval, its own storage folder;
- traffic that moves the panels: text, an image sent again, new images, refused requests, a reset that
  sends a repeated image to the encoder-cache connector, a request through ``mmserve proxy``.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.e2e.conftest import data_url, greedy_body, make_image
from tests.e2e.server import REPO, free_port

MONITORING = REPO / "monitoring"
PROMETHEUS_CONFIG = MONITORING / "prometheus.yml"
RULES = MONITORING / "rules.yml"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "mmserve.json"
PROMETHEUS_MISSING = "Debian's prometheus is not installed (make setup: apt-get install -y prometheus)"


# --- the queries --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """One expression Prometheus is asked: a dashboard target or a rule."""

    key: str  # "<panel title> / <legend>", or the rule's name (a recording rule's with its labels)
    expr: str
    kind: str  # "panel", "record" or "alert"


def substitute(expr: str, rate_interval: str) -> str:
    """The expression as Grafana sends it: ``$__rate_interval`` (and ``$__interval``) a duration, the
    ``instance`` variable at "All" (its allValue ``.*``)."""
    for variable, value in (
        ("$__rate_interval", rate_interval),
        ("$__interval", rate_interval),
        ("$instance", ".*"),
    ):
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a variable is left in {expr!r}"
    return expr


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict[str, Any]]:
    """Every panel but rows, in order (a collapsed row holds its panels)."""
    panels: list[dict[str, Any]] = []
    for panel in dashboard()["panels"]:
        nested = panel.get("panels", []) if panel["type"] == "row" else [panel]
        panels.extend(nested)
    return panels


def panel_queries(rate_interval: str = "1m") -> list[Query]:
    return [
        Query(
            f"{panel['title']} / {target.get('legendFormat') or target['refId']}",
            substitute(target["expr"], rate_interval),
            "panel",
        )
        for panel in dashboard_panels()
        for target in panel["targets"]
    ]


def rule_queries() -> list[Query]:
    queries = []
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(rule.get("labels", {}).items()))
                queries.append(Query(f"{rule['record']}{{{labels}}}", rule["expr"], "record"))
            else:
                queries.append(Query(rule["alert"], rule["expr"], "alert"))
    return queries


# --- Prometheus ---------------------------------------------------------------------------------


class PromQLError(Exception):
    """Prometheus answered a query with an error (it did not parse, or could not be evaluated)."""


@dataclass
class Prometheus:
    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def api(self, path: str, **params: Any) -> Any:
        """``GET /api/v1/<path>``: the answer's ``data``; a PromQLError unless its status is success."""
        body = httpx.get(f"{self.base_url}/api/v1/{path}", params=params, timeout=30).json()
        if body.get("status") != "success":
            raise PromQLError(f"{params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def query_range(self, expr: str, start: float, end: float, step_s: float = 1.0) -> list[dict[str, Any]]:
        return list(self.api("query_range", query=expr, start=start, end=end, step=step_s)["result"])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def prometheus_config(targets: dict[str, str], interval: str) -> dict[str, Any]:
    """monitoring/prometheus.yml with every target replaced by ``targets[target]`` (each must be given)
    and labelled with its compose name as ``instance``; the rule files by their paths in the repository."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"] |= {
        "scrape_interval": interval,
        "scrape_timeout": interval,
        "evaluation_interval": interval,
    }
    config["rule_files"] = [str(MONITORING / path) for path in config["rule_files"]]
    for job in config["scrape_configs"]:
        job["static_configs"] = [
            {"targets": [targets[target]], "labels": {**group.get("labels", {}), "instance": target}}
            for group in job["static_configs"]
            for target in group["targets"]
        ]
    return config


def start_prometheus(targets: dict[str, str], folder: Path, interval: str = "1s") -> Prometheus:
    """Debian's ``prometheus`` on a free loopback port, scraping ``targets`` (compose name -> address)."""
    binary = shutil.which("prometheus")
    assert binary is not None, PROMETHEUS_MISSING
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(prometheus_config(targets, interval)))
    port = free_port()
    log_path = folder / "prometheus.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    prometheus = Prometheus(process, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_until(lambda: _ready(prometheus), 30, "prometheus ready", prometheus)
    except BaseException:
        prometheus.stop()
        raise
    return prometheus


def _ready(prometheus: Prometheus) -> bool:
    try:
        return httpx.get(f"{prometheus.base_url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(
    predicate: Callable[[], bool], timeout_s: float, what: str, prometheus: Prometheus | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if prometheus is not None and prometheus.process.poll() is not None:
            raise RuntimeError(f"prometheus exited:\n{prometheus.log_path.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            log = prometheus.log_path.read_text()[-3000:] if prometheus is not None else ""
            raise TimeoutError(f"{what}: not within {timeout_s} s\n{log}")
        time.sleep(0.2)


def scraped_up(prometheus: Prometheus, instance: str) -> bool:
    """Prometheus's latest scrape of ``instance`` (a compose name) succeeded."""
    return any(float(s["value"][1]) == 1.0 for s in prometheus.query(f'up{{instance="{instance}"}}'))


# --- traffic ------------------------------------------------------------------------------------

MODEL_NAME = "tiny-llava"


@cache
def image_url(seed: int) -> str:
    """A data URL of ``make_image(seed)``: the same bytes (the same mm_hash) every time."""
    return data_url(make_image(seed, size=(160, 120)))


def chat(
    client: httpx.Client,
    base_url: str,
    seed: int | None,
    *,
    stream: bool = False,
    model: str = MODEL_NAME,
    named: bool = False,
    media: bool = True,
) -> int:
    """One greedy chat completion of 16 tokens (with the image of ``seed`` when given; ``named``: with
    its media id, the media left out unless ``media``); its status."""
    content: Any = "Say something."
    if seed is not None:
        part: dict[str, Any] = {"type": "image_url", "image_url": {"url": image_url(seed)} if media else None}
        if named:
            part["uuid"] = f"image-{seed}"
        content = [part, {"type": "text", "text": "What?"}]
    body = greedy_body([{"role": "user", "content": content}], 16, model=model, stream=stream)
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as resp:
        for _ in resp.iter_bytes():
            pass
        return resp.status_code


def every_kind_of_request(server_url: str, proxy_url: str | None) -> Counter[int]:
    """One of each request a panel needs, in an order that makes every cache miss and then hit: the
    answers' statuses (9 of 200 with a proxy, else 8, the reset's included; one 404 and one 400)."""
    statuses: Counter[int] = Counter()
    with httpx.Client(timeout=120) as client:
        statuses[chat(client, server_url, None)] += 1  # text only
        statuses[chat(client, server_url, 1)] += 1  # a new image: every cache misses
        statuses[chat(client, server_url, 1, stream=True)] += 1  # again: every cache hits
        statuses[chat(client, server_url, 2, named=True)] += 1  # binds its media id
        statuses[chat(client, server_url, 2, named=True, media=False)] += 1  # the media id alone
        statuses[chat(client, server_url, None, model="no-such-model")] += 1  # 404
        bad = {"model": MODEL_NAME, "messages": [{"role": "user", "content": [_BAD_IMAGE]}]}
        statuses[client.post(f"{server_url}/v1/chat/completions", json=bad).status_code] += 1  # 400
        statuses[client.post(f"{server_url}/reset_mm_cache").status_code] += 1
        # the caches were emptied: with a connector the encoder output comes from its store
        statuses[chat(client, server_url, 1)] += 1
        if proxy_url is not None:
            statuses[chat(client, proxy_url, 3)] += 1
        statuses[chat(client, server_url, 4, stream=True)] += 1
    return statuses


_BAD_IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not-base64@@"}}


@dataclass(frozen=True)
class Mix:
    """Shares of steady traffic: text only, images from a small pool (sent again and again), new images."""

    text: float = 1.0
    repeated: float = 2.0
    new: float = 1.0
    pool: tuple[int, ...] = (1, 2, 4)


_new_seeds = itertools.count(10_000)


def steady_traffic(base_url: str, seconds: float, *, concurrency: int = 3, mix: Mix = Mix()) -> Counter[int]:
    """``concurrency`` clients sending ``mix`` back to back for ``seconds`` (half of them streamed);
    the answers' statuses. A media id sent alone after ``/reset_mm_cache`` is a 400 until its media is
    sent again (the dashboard's unknown media ids)."""
    statuses: Counter[int] = Counter()
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client_loop(index: int) -> None:
        rng = random.Random(index)
        named: set[int] = set()  # pool images this client sent with their media id
        with httpx.Client(timeout=120) as client:
            while time.monotonic() < deadline:
                kind = rng.choices(("text", "repeated", "new"), (mix.text, mix.repeated, mix.new))[0]
                seed = {"text": None, "repeated": rng.choice(mix.pool), "new": next(_new_seeds)}[kind]
                # a pool image goes with its media id; once sent so, half the time by its id alone
                media = seed not in named or rng.random() < 0.5
                if kind == "repeated" and seed is not None:
                    named.add(seed)
                stream = rng.random() < 0.5
                status = chat(client, base_url, seed, stream=stream, named=kind == "repeated", media=media)
                with lock:
                    statuses[status] += 1

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses
