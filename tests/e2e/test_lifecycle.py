"""Process lifecycle: Ctrl-C stops all three processes; the docker-compose topology (one role per
process, ZeroMQ over TCP, configuration from each service's environment) serves requests."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.conftest import greedy_body, make_image, user_message
from tests.e2e.server import (
    HEARD_AT_ONCE_S,
    REPO,
    ServerProcess,
    assert_ctrl_c_stops_all,
    descendants,
    free_port,
    parent_pid,
    process_title,
    seconds_until_health,
    start_serve,
    wait_healthy,
)
from wire.curve import write_key_file

pytestmark = pytest.mark.slow


def test_ctrl_c_stops_every_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = start_serve(tiny_model_dir, tmp_path)
    assert server.process.proc is not None
    try:
        children = descendants(server.process.proc.pid)
        assert len(children) >= 2, "engine and worker run as processes of their own"
        deadline = time.monotonic() + 10  # the line follows the first healthy /health answer
        while "serving model 'tiny-llava'" not in server.process.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (
            f"serving model 'tiny-llava' ({tiny_model_dir}) at {server.base_url}/v1" in server.process.log()
        )
        # each role's process title names it, as ps shows it
        pids = [server.process.proc.pid, *children]
        titles = {process_title(pid) for pid in pids}
        roles = {"mmserve: api", "mmserve: engine", "mmserve: worker", "mmserve: fork server"}
        assert roles <= titles, titles
        # the worker is a fork of the fork server, which imported its modules; the engine is spawned
        # by serve (app/child_processes.py). (A fork is titled as the fork server until it names itself.)
        (worker,) = [pid for pid in pids if process_title(pid) == "mmserve: worker"]
        (engine,) = [pid for pid in pids if process_title(pid) == "mmserve: engine"]
        assert process_title(parent_pid(worker)) == "mmserve: fork server"
        assert parent_pid(engine) == server.process.proc.pid
    except BaseException:
        server.process.kill()
        raise
    assert_ctrl_c_stops_all(server, children)


def compose_services() -> dict[str, dict]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]


def test_compose_topology_as_processes(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Each compose service's command, with its environment, as a local process; container host names
    become loopback and the model volume becomes the tiny model folder. Then the engine dies and
    comes back, as the restart policy would bring it back."""
    services = compose_services()
    engine_port, worker_port, http_port = free_port(), free_port(), free_port()
    key_file = tmp_path / "curve.key"
    write_key_file(key_file)
    rewrite = {
        "tcp://0.0.0.0:5555": f"tcp://127.0.0.1:{engine_port}",
        "tcp://engine:5555": f"tcp://127.0.0.1:{engine_port}",
        "tcp://0.0.0.0:5556": f"tcp://127.0.0.1:{worker_port}",
        "tcp://engine:5556": f"tcp://127.0.0.1:{worker_port}",
        "/models/tiny-llava": str(tiny_model_dir),
        "0.0.0.0": "127.0.0.1",
        "8000": str(http_port),
        "/run/secrets/mmserve_curve": str(key_file),  # the compose secret: the roles talk CURVE
    }
    processes: dict[str, ServerProcess] = {}
    try:
        for role in ("engine", "worker", "api"):
            service = services[role]
            assert service["command"] == ["mmserve", role]
            env = {k: rewrite.get(str(v), str(v)) for k, v in service["environment"].items()}
            processes[role] = ServerProcess([role], tmp_path / f"{role}.log", env=env).start()
        base_url = f"http://127.0.0.1:{http_port}"
        wait_healthy(base_url, processes["api"])
        image = make_image(300)
        body = greedy_body([user_message("Over TCP?", image)], max_tokens=8)
        answers = []
        for _ in range(2):
            resp = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
            assert resp.status_code == 200, resp.text
            answers.append(resp.json()["choices"][0]["message"]["content"])
        assert answers[0] == answers[1]
        metrics = httpx.get(f"{base_url}/metrics").text
        assert "mmserve_mm_ipc_cache_hits_total 1.0" in metrics
        assert "mmserve_encoder_runs_total 1.0" in metrics  # the second: the image in its prefix-cache hit
        # each request's wait in the engine's queue and its prefill, observed once each
        assert "mmserve_request_queue_time_seconds_count 2.0" in metrics
        assert "mmserve_request_prefill_time_seconds_count 2.0" in metrics

        # The engine container dies: its worker exits for a restart (status 3), the api reports
        # unhealthy at once; the restart policy starts both again, and the api (never restarted)
        # answers as before, its IPC mirror emptied for the new engine.
        engine_proc, worker_proc = processes["engine"].proc, processes["worker"].proc
        assert engine_proc is not None and worker_proc is not None
        engine_proc.kill()
        unhealthy_after = seconds_until_health(base_url, 503, timeout_s=30)
        assert unhealthy_after < HEARD_AT_ONCE_S, f"/health said 503 only after {unhealthy_after:.2f}s"
        assert worker_proc.wait(30) == 3, processes["worker"].log()[-2000:]
        for role in ("engine", "worker"):
            processes[role] = ServerProcess(
                [role], tmp_path / f"{role}-restarted.log", env=processes[role].env
            ).start()
        wait_healthy(base_url, processes["api"])
        resp = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == answers[0]
        assert "mmserve_mm_ipc_cache_resends_total 0.0" in httpx.get(f"{base_url}/metrics").text
    finally:
        for role in ("api", "engine", "worker"):
            if role in processes:
                try:
                    processes[role].interrupt(timeout_s=20)
                except Exception:
                    processes[role].kill()
    for role, process in processes.items():
        assert process.proc is not None and process.proc.poll() is not None, role
