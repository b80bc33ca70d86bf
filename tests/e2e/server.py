"""Starts real mmserve processes on a free loopback port for end-to-end tests, and stops them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.inputs.engine_client import HEARTBEAT_S, HEARTBEAT_TIMEOUT_S
from tests.e2e.metrics import Metrics, parse_metrics

REPO = Path(__file__).resolve().parents[2]
API_PROCESS_HEADER = "x-mmserve-api-process"
# The soonest a missed heartbeat could turn /health 503 after a kill (the last EngineReady came at most
# one heartbeat before it). Sooner means the loss was heard from the connection (the engine's
# disconnect, or the engine's EngineDead for its worker), which is the behaviour under test; the worker's
# other alarm, the step timeout, is minutes. A bound of wall time alone flaked under a busy machine.
HEARD_AT_ONCE_S = HEARTBEAT_TIMEOUT_S - HEARTBEAT_S


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> list[int]:
    """All live descendant pids of ``pid`` (from /proc; one that exits meanwhile is skipped)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                for child in task.read_text().split():
                    found.append(int(child))
                    todo.append(int(child))
    return found


DEV_SHM = Path("/dev/shm")


def owned_shm_entries(pids: list[int]) -> set[str]:
    """The /dev/shm entries named for these processes (``mmserve.<pid>.*``, the product's naming): a
    test counts only its own servers' entries, since another pytest-xdist worker's tests may run beside
    it."""
    return {path.name for pid in pids for path in DEV_SHM.glob(f"mmserve.{pid}.*")}


def named_semaphores() -> set[str]:
    """Every ``sem.*`` in /dev/shm (a named semaphore carries no owner; the product creates none)."""
    return {path.name for path in DEV_SHM.glob("sem.*")}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def cpu_ticks(pid: int) -> int:
    """The CPU time ``pid`` has used, in clock ticks (user + system): it rises once the process works."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def process_title(pid: int) -> str:
    """The command line ``ps`` shows for ``pid`` (a role's process title, e.g. ``mmserve: engine``)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except FileNotFoundError:
        return ""


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def role_pid(root_pid: int, role: str) -> int:
    """The live process under ``root_pid`` titled ``mmserve: <role>``."""
    found = role_pids(root_pid, role)
    assert len(found) == 1, f"expected one {role} process under {root_pid}, found {found}"
    return found[0]


def role_pids(root_pid: int, role: str) -> list[int]:
    """Every live process under ``root_pid`` titled ``mmserve: <role>`` (``serve``'s own process, API 0
    with ``--api-server-count``, is the root and so not among them)."""
    return [pid for pid in descendants(root_pid) if process_title(pid) == f"mmserve: {role}" and alive(pid)]


def api_process(resp: httpx.Response) -> int:
    """Which of ``serve``'s API processes answered (its ``x-mmserve-api-process`` header)."""
    return int(resp.headers[API_PROCESS_HEADER])


@dataclass
class ServerProcess:
    """One process started with ``python -m app.launch.cli ROLE ...``; its output goes to ``log_path``."""

    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.launch.cli", *self.args],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def interrupt(self, timeout_s: float = 30.0) -> int:
        """Ctrl-C: SIGINT to the whole process group, as a terminal does."""
        assert self.proc is not None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class Server:
    """``mmserve serve`` on a free port."""

    process: ServerProcess
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> Metrics:
        return parse_metrics(httpx.get(f"{self.base_url}/metrics").text)


def stream_chunks(
    server: Server,
    body: dict[str, Any],
    timeout_s: float = 300.0,
    on_chunk: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """The ``data:`` events of a streamed ``/v1/chat/completions`` request (``[DONE]`` left out), once it
    answered 200; ``on_chunk`` sees each as it arrives."""
    chunks = []
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=timeout_s) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
                if on_chunk is not None:
                    on_chunk(chunks[-1])
    return chunks


def wait_healthy(base_url: str, process: ServerProcess, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.proc is not None
        if process.proc.poll() is not None:
            raise RuntimeError(f"server exited with {process.proc.returncode}:\n{process.log()[-4000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server not healthy after {timeout_s}s:\n{process.log()[-4000:]}")


def seconds_until_health(base_url: str, status: int, timeout_s: float) -> float:
    """Seconds until ``/health`` answered ``status``; a call that fails or times out is retried."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if httpx.get(f"{base_url}/health", timeout=1.0).status_code == status:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"/health did not answer {status} within {timeout_s}s")


def wait_api_processes(server: Server, count: int, timeout_s: float = 180.0) -> None:
    """Until every one of ``count`` API processes answered ``/health`` 200 (each call on a new connection,
    which the kernel gives to any of them)."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            resp = httpx.get(f"{server.base_url}/health", timeout=2.0)
        except httpx.HTTPError:
            continue
        if resp.status_code == 200:
            seen.add(api_process(resp))
            if len(seen) == count:
                return
        time.sleep(0.05)
    raise TimeoutError(f"only API processes {sorted(seen)} became healthy:\n{server.process.log()[-4000:]}")


# What a test server runs unless its flags say otherwise: one preprocessing process per API process (the
# pool's path, at half the default's start-up cost on two cores; tests of the pool's size set their own).
TEST_DEFAULTS = {"--mm-preprocess-processes": "1"}


def serve_args(model_dir: Path, port: int, flags: tuple[str, ...]) -> list[str]:
    defaults = [item for flag, value in TEST_DEFAULTS.items() if flag not in flags for item in (flag, value)]
    return ["serve", "--model", str(model_dir), "--port", str(port), *defaults, *flags]


def start_serve(model_dir: Path, log_dir: Path, *flags: str, env: dict[str, str] | None = None) -> Server:
    port = free_port()
    log = log_dir / f"serve-{port}.log"
    process = ServerProcess(serve_args(model_dir, port, flags), log, env or {}).start()
    server = Server(process, port)
    try:
        wait_healthy(server.base_url, process)
    except BaseException:
        process.kill()
        raise
    return server


def start_proxy(
    log_dir: Path, encoder_url: str, lm_url: str | Sequence[str], port: int | None = None
) -> Server:
    """``mmserve proxy`` on ``port`` (a free one when None) in front of one LM instance or several,
    returned once it serves (its ``/metrics``: its ``/health`` is 503 on purpose when an upstream is
    down)."""
    port = free_port() if port is None else port
    lm_urls = [lm_url] if isinstance(lm_url, str) else list(lm_url)
    flags = ["--encoder-url", encoder_url, *(f for url in lm_urls for f in ("--lm-url", url))]
    flags += ["--port", str(port), "--timeout", "60"]
    process = ServerProcess(["proxy", *flags], log_dir / f"proxy-{port}.log").start()
    proxy = Server(process, port)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.proc is not None and process.proc.poll() is None, process.log()[-3000:]
        try:
            if httpx.get(f"{proxy.base_url}/metrics", timeout=2).status_code == 200:
                return proxy
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise TimeoutError(f"proxy not serving after 60 s:\n{process.log()[-3000:]}")


def start_all(model_dir: Path, log_dir: Path, *flag_sets: tuple[str, ...]) -> list[Server]:
    """Several ``mmserve serve`` at once (their start-ups overlap), each with its flags; all healthy."""
    servers = []
    try:
        for flags in flag_sets:
            port = free_port()
            args = serve_args(model_dir, port, flags)
            servers.append(Server(ServerProcess(args, log_dir / f"serve-{port}.log").start(), port))
        for server in servers:
            wait_healthy(server.base_url, server.process)
    except BaseException:
        stop_all(servers)
        raise
    return servers


def stop_all(servers: list[Server]) -> None:
    """Ctrl-C to every server first, then waits for each (killed after 30 s)."""
    for server in servers:
        proc = server.process.proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
    for server in servers:
        proc = server.process.proc
        if proc is None:
            continue
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            server.process.kill()


@contextmanager
def serving(model_dir: Path, log_dir: Path, *flags: str) -> Iterator[Server]:
    """``start_serve`` for a ``with`` block (a module fixture's body): Ctrl-C when the block ends."""
    server = start_serve(model_dir, log_dir, *flags)
    try:
        yield server
    finally:
        server.process.interrupt()


def assert_ctrl_c_stops_all(server: Server, children: list[int], *, repeat_to: Sequence[int] = ()) -> None:
    """Ctrl-C: ``serve`` exits 0 without a traceback and, within 10 s, none of ``children`` is left.
    ``repeat_to``: processes that get SIGINT again every 20 ms until ``serve`` exited (a second Ctrl-C,
    or ``serve`` passing one on, may arrive at any point of their shutdown)."""
    proc = server.process.proc
    assert proc is not None
    os.killpg(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        for pid in repeat_to:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
        time.sleep(0.02)
    assert server.process.interrupt() == 0, server.process.log()[-3000:]
    log = server.process.log()
    assert "Traceback" not in log, log[log.index("Traceback") - 500 :][:4000]
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)], server.process.log()[-3000:]
