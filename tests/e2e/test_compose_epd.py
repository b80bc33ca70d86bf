"""docker-compose's ``epd`` profile as local processes (no Docker engine here): each service's command
with its environment, container host names and ports rewritten to free loopback ports, Mooncake's
processes with ``MC_TCP_BIND_ADDRESS=127.0.0.1``. Through the proxy the answer is a single server's and
the LM instance never encodes; then the Mooncake master is killed mid-run: saves and lookups fail
(counted), the LM instance encodes locally, every answer is still the single server's, nothing hangs."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.conftest import greedy_body, make_image, user_message
from tests.e2e.metrics import delta
from tests.e2e.server import REPO, Server, ServerProcess, free_port, stop_all, wait_healthy

pytestmark = pytest.mark.slow

mooncake_processes = pytest.importorskip("wire.ec_store.mooncake_processes")


def rewrite(value: str, mapping: dict[str, str]) -> str:
    for old, new in mapping.items():
        value = value.replace(old, new)
    return value


@pytest.fixture(scope="module")
def epd(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"mooncake cannot be imported here: {exc}")
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    logs = tmp_path_factory.mktemp("compose-epd")
    ports = {name: free_port() for name in ("50051", "50052", "8001", "8002", "8010")}
    mapping = {
        "/models/tiny-llava": str(tiny_model_dir),
        "mooncake-master:50051": f"127.0.0.1:{ports['50051']}",
        "--rpc_port=50051": f"--rpc_port={ports['50051']}",
        "--port=50052": f"--port={ports['50052']}",
        "http://epd-encoder:8001": f"http://127.0.0.1:{ports['8001']}",
        "http://epd-lm:8002": f"http://127.0.0.1:{ports['8002']}",
        "0.0.0.0": "127.0.0.1",
        "mooncake-holder": "127.0.0.1",
        "epd-encoder": "127.0.0.1",
        "epd-lm": "127.0.0.1",
    }
    mooncake: dict[str, subprocess.Popen[bytes]] = {}
    instances: dict[str, Server] = {}
    try:
        for name in ("mooncake-master", "mooncake-holder"):
            argv = [rewrite(str(a), mapping) for a in services[name]["command"]]
            executable = str(mooncake_processes.mooncake_executable(argv[0]))
            log = (logs / f"{name}.log").open("wb")
            mooncake[name] = subprocess.Popen(
                [executable, *argv[1:]],
                env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            port = ports["50051" if name == "mooncake-master" else "50052"]
            wait_port(port, mooncake[name], logs / f"{name}.log")
        for name, port_key in (("epd-encoder", "8001"), ("epd-lm", "8002"), ("epd-proxy", "8010")):
            service = services[name]
            env = {k: rewrite(str(v), mapping) for k, v in service.get("environment", {}).items()}
            if "MMSERVE_PORT" in env:
                env["MMSERVE_PORT"] = str(ports[port_key])
            argv = [rewrite(str(a), mapping) for a in service["command"]]
            assert argv[0] == "mmserve"
            if name == "epd-proxy":
                argv[argv.index("--port") + 1] = str(ports["8010"])
            process = ServerProcess(argv[1:], logs / f"{name}.log", env=env).start()
            instances[name] = Server(process, ports[port_key])
        for server in instances.values():
            wait_healthy(server.base_url, server.process)
        yield {"instances": instances, "mooncake": mooncake, "logs": logs}
    finally:
        stop_all(list(instances.values()))
        for proc in mooncake.values():
            if proc.poll() is None:
                proc.terminate()
            proc.wait(10)


def wait_port(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    import socket

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text(errors="replace")[-2000:]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {port}: {log.read_text(errors='replace')[-2000:]}")


def ask(server: Server, body: dict[str, Any], *, store_down: bool = False) -> str:
    """The answer's text. With the store down, an answer must not take a minute: the store's calls fail
    within seconds (``rpc_timeout_ms``, ``transfer_timeout_s``), so a minute means one waited on it. The
    first answers, with the store up, carry the instances' first use (each one's preprocessing process
    may still be loading: a minute of imports once, on a machine the other xdist worker kept busy),
    so they get no such bound."""
    started = time.monotonic()
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    if store_down:
        assert time.monotonic() - started < 60, "an answer took a minute: something waited on the store"
    return resp.json()["choices"][0]["message"]["content"]


def test_compose_epd_topology_and_a_dead_store(epd: dict[str, Any], server: Server) -> None:
    proxy, lm, encoder = (epd["instances"][n] for n in ("epd-proxy", "epd-lm", "epd-encoder"))
    first = greedy_body([user_message("Through Mooncake?", make_image(900), make_image(901))], max_tokens=8)
    lm_before, enc_before = lm.metrics(), encoder.metrics()
    assert ask(proxy, first) == ask(server, first)
    lm_after, enc_after = lm.metrics(), encoder.metrics()
    assert delta(enc_before, enc_after, "mmserve_ec_saves_total") == 2
    assert delta(lm_before, lm_after, "mmserve_ec_loads_total") == 2
    assert delta(lm_before, lm_after, "mmserve_encoder_runs_total") == 0

    epd["mooncake"]["mooncake-master"].kill()  # the store is gone mid-run
    epd["mooncake"]["mooncake-master"].wait()
    lm_before, enc_before = lm.metrics(), encoder.metrics()
    for seed in (902, 903):
        body = greedy_body([user_message("And without the store?", make_image(seed))], max_tokens=8)
        assert ask(proxy, body, store_down=True) == ask(server, body)
    lm_after, enc_after = lm.metrics(), encoder.metrics()
    assert delta(enc_before, enc_after, "mmserve_ec_save_failures_total") == 2
    failures = delta(lm_before, lm_after, "mmserve_ec_lookup_errors_total") + delta(
        lm_before, lm_after, "mmserve_ec_load_failures_total"
    )
    assert failures == 2, "each image the LM could not get from the store is counted"
    assert delta(lm_before, lm_after, "mmserve_encoder_runs_total") == 2, "encoded locally instead"
    assert delta(lm_before, lm_after, "mmserve_ec_loads_total") == 0
