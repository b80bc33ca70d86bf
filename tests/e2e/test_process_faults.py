"""Process faults on a real ``mmserve serve``: the engine or the worker SIGKILLed mid-request, and
SIGTERM's graceful drain. The API process survives the first two and serves the same answers again."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import greedy_body, make_image, png_bytes, user_message
from tests.e2e.held_image import held_image
from tests.e2e.server import (
    HEARD_AT_ONCE_S,
    Server,
    alive,
    descendants,
    named_semaphores,
    owned_shm_entries,
    role_pid,
    seconds_until_health,
    serving,
    start_serve,
)
from tests.paused import paused

pytestmark = pytest.mark.slow


def answer(server: Server, body: dict[str, Any]) -> str:
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def stream_events(server: Server, body: dict[str, Any], events: list[dict[str, Any] | str]) -> None:
    """Collects a streamed answer's events ("[DONE]" as a string, "cut off" when the connection
    closed early); run in a thread."""
    url = f"{server.base_url}/v1/chat/completions"
    try:
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", url, json={**body, "stream": True}) as r,
        ):
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    events.append(data if data == "[DONE]" else json.loads(data))
    except httpx.HTTPError:
        events.append("cut off")


def stream_response(server: Server, events: list[Any]) -> None:
    """A long streamed ``/v1/responses`` answer's events (``{"type": "cut off"}`` when the connection
    closed early); run in a thread."""
    # the tiny model says no EOS within these tokens for this input (greedy)
    body = {"model": "tiny-llava", "input": "Never stop.", "max_output_tokens": 1400, "temperature": 0}
    body["stream"] = True
    try:
        with httpx.stream("POST", f"{server.base_url}/v1/responses", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: ")))
    except httpx.HTTPError:
        events.append({"type": "cut off"})


def started_stream(server: Server, body: dict[str, Any]) -> tuple[threading.Thread, list[Any]]:
    """A streamed request running in a thread, returned once its first tokens arrived."""
    events: list[Any] = []
    thread = threading.Thread(target=stream_events, args=(server, body, events), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while len(events) < 3 and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(events) >= 3, events
    return thread, events


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tiny_model_dir, tmp_path_factory.mktemp("faults")) as started:
        yield started


SHORT = greedy_body([user_message("Describe it.", make_image(71))], max_tokens=12)
LONG = greedy_body([user_message("Go on and on.", make_image(72))], max_tokens=1400)


@pytest.mark.parametrize("role", ["worker", "engine"])
def test_sigkill_fails_in_flight_then_the_server_recovers(server: Server, role: str) -> None:
    assert server.process.proc is not None
    api_pid = server.process.proc.pid
    seconds_until_health(server.base_url, 200, timeout_s=120)  # a restart an earlier case caused is over
    before = answer(server, SHORT)
    thread, events = started_stream(server, LONG)

    os.kill(role_pid(api_pid, role), signal.SIGKILL)
    unhealthy_after = seconds_until_health(server.base_url, 503, timeout_s=30)
    thread.join(10)
    assert not thread.is_alive(), "the in-flight stream ended"
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] in ("engine_unavailable", "worker_unavailable")
    assert "[DONE]" not in events
    assert unhealthy_after < HEARD_AT_ONCE_S, f"/health said 503 only after {unhealthy_after:.2f}s"

    # while the dead part restarts, a request gets a clear 503 (or, if the restart was quick, an answer)
    during = httpx.post(f"{server.base_url}/v1/chat/completions", json=SHORT, timeout=120)
    assert during.status_code in (200, 503), during.text
    if during.status_code == 503:
        assert during.json()["error"]["code"] in ("engine_unavailable", "worker_unavailable")

    seconds_until_health(server.base_url, 200, timeout_s=120)
    assert server.process.proc.poll() is None and alive(api_pid), "the API process was not restarted"
    role_pid(api_pid, "engine"), role_pid(api_pid, "worker")
    resends = server.metrics()["mmserve_mm_ipc_cache_resends_total"]
    assert answer(server, SHORT) == before, "the restarted part answers as before"
    assert answer(server, SHORT) == before, "a repeat (now from the fresh caches) too"
    after = server.metrics()["mmserve_mm_ipc_cache_resends_total"]
    assert after == resends, "the mirror was emptied for the new epoch: no hit was claimed wrongly"


@pytest.mark.parametrize("to", ["serve", "group"])
def test_sigterm_drains_in_flight_requests(tiny_model_dir: Path, tmp_path: Path, to: str) -> None:
    """SIGTERM to ``serve``, or to its whole process group as systemd stops a service (every process
    gets it at once): the requests in flight finish, and no process is restarted meanwhile."""
    sems_before = named_semaphores()
    flags = ("--shutdown-timeout", "60", "--allow-private-media-urls", "--fetch-timeout-s", "60")
    # a temp folder of its own (short: it holds the IPC sockets' paths), to see that nothing is left in it
    temp = Path(tempfile.mkdtemp(prefix="mmt-"))
    drained = start_serve(tiny_model_dir, tmp_path, *flags, env={"TMPDIR": str(temp)})
    stack = contextlib.ExitStack()
    try:
        assert drained.process.proc is not None
        proc = drained.process.proc
        children = descendants(proc.pid)
        body = greedy_body([user_message("Finish this.", make_image(73))], max_tokens=1400)
        thread, events = started_stream(drained, body)
        # and one still being prepared (its image is held until the drain was seen) when the signal comes:
        # accepted, so answered
        held = held_image(png_bytes(make_image(75)), hold_s=60)
        held_url, asked, release = stack.enter_context(held)
        parts = [{"type": "image_url", "image_url": {"url": held_url}}, {"type": "text", "text": "And this."}]
        preparing = greedy_body([{"role": "user", "content": parts}], 4)
        prepared: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda: prepared.append(
                httpx.post(f"{drained.base_url}/v1/chat/completions", json=preparing, timeout=120)
            )
        )
        sender.start()
        assert asked.wait(60), "the held image was never fetched"

        if to == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        seconds_until_health(drained.base_url, 503, timeout_s=15)
        refused = httpx.post(f"{drained.base_url}/v1/chat/completions", json=SHORT, timeout=30)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "server_shutting_down"
        release.set()

        thread.join(120)
        sender.join(120)
        assert prepared[0].status_code == 200, prepared[0].text
        assert events[-1] == "[DONE]", events[-3:]
        choices = [e["choices"][0] for e in events if isinstance(e, dict) and e["choices"]]
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
        assert proc.wait(30) == 0, drained.process.log()[-3000:]
        log = drained.process.log()
        assert "restarting" not in log and "died; spawning another" not in log and "Traceback" not in log, log
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if alive(pid)], "no orphan processes"
        leaked = owned_shm_entries([proc.pid, *children]) | (named_semaphores() - sems_before)
        assert not leaked, f"leaked shared memory: {leaked}"
        left = sorted(p.name for p in temp.iterdir() if p.name.startswith(("mmserve-", "pymp-")))
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"temp folders left behind: {left}"  # the IPC sockets', multiprocessing's
    finally:  # a failed check must not leave the server running
        stack.close()
        drained.process.kill()
        shutil.rmtree(temp, ignore_errors=True)


def unanswered_post(server: Server, body: dict[str, Any]) -> tuple[threading.Thread, list[httpx.Response]]:
    """A non-streamed request running in a thread; its response lands in the list."""
    answers: list[httpx.Response] = []
    url = f"{server.base_url}/v1/chat/completions"
    thread = threading.Thread(
        target=lambda: answers.append(httpx.post(url, json=body, timeout=60)), daemon=True
    )
    thread.start()
    return thread, answers


def stalled_upload(server: Server) -> socket.socket:
    """A request whose body stops after its first bytes (its headers promise the rest)."""
    body = json.dumps(greedy_body([user_message("Stalled.")], 4)).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(head.encode() + body[:10])
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of the one response on ``sock`` (which the server then closes)."""
    sock.settimeout(20)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def test_sigterm_cuts_off_what_outlives_the_shutdown_timeout(tiny_model_dir: Path, tmp_path: Path) -> None:
    """At the deadline, answers already streaming (chat and Responses) end with their error event; a
    request not yet answered, whether it waits for its first token or its client stalled while uploading
    the body, gets 503 ``server_shutting_down`` in OpenAI's error shape (uvicorn would send a plain-text
    500)."""
    hurried = start_serve(tiny_model_dir, tmp_path, "--shutdown-timeout", "0.3")
    try:
        assert hurried.process.proc is not None
        proc = hurried.process.proc
        children = descendants(proc.pid)
        waiting, answers = unanswered_post(
            hurried, greedy_body([user_message("Never stop.", make_image(75))], 3000)
        )
        stalled = stalled_upload(hurried)
        streams = [
            started_stream(hurried, greedy_body([user_message(f"Never stop {i}.", make_image(74))], 1400))
            for i in range(3)
        ]
        response_events: list[Any] = []
        responding = threading.Thread(target=stream_response, args=(hurried, response_events), daemon=True)
        responding.start()
        deadline = time.monotonic() + 60
        while not any(e.get("type") == "response.output_text.delta" for e in response_events):
            assert responding.is_alive() and time.monotonic() < deadline, response_events[-3:]
            time.sleep(0.02)

        start = time.monotonic()
        # the worker paused: nothing under way can end before the deadline, however slow the machine; it
        # goes on once the deadline has cut them off, so that the server's stop ends it
        with paused(role_pid(proc.pid, "worker")):
            proc.send_signal(signal.SIGTERM)
            status, refusal = read_response(stalled)
        assert (status, refusal["error"]["code"]) == (503, "server_shutting_down"), refusal
        assert "shut down before answering" in refusal["error"]["message"]  # cut off, not refused on arrival
        assert proc.wait(30) == 0, hurried.process.log()[-3000:]
        assert time.monotonic() - start < 20  # with the stops of every process; the default would be 30 s
        assert "request(s) in flight are cut off" in hurried.process.log()
        for thread, _ in streams:
            thread.join(10)
        for _, events in streams:  # ended with the stream's error event, never a dropped connection
            assert "[DONE]" not in events and events[-1] != "cut off", events[-3:]
            assert events[-1]["error"]["code"] == "server_shutting_down", events[-1]
            assert "shut down before finishing this answer" in events[-1]["error"]["message"]
        responding.join(10)
        assert response_events[-1]["type"] == "error", response_events[-3:]
        assert response_events[-1]["code"] == "server_shutting_down"
        assert "Traceback" not in hurried.process.log(), hurried.process.log()[-3000:]
        waiting.join(10)
        assert answers[0].status_code == 503, answers[0].text
        assert answers[0].json()["error"] == {
            "message": "The server shut down before answering this request (--shutdown-timeout 0.3 s).",
            "type": "server_error",
            "param": None,
            "code": "server_shutting_down",
        }
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if alive(pid)], "no orphan processes"
    finally:  # a failed check must not leave the server running
        hurried.process.kill()


def test_a_role_that_cannot_be_started_again_stops_the_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The worker dies and its restart fails (here: the fork server's socket was removed): the server
    stops and says why, rather than answering 503 for ever with no one to restart it."""
    temp = Path(tempfile.mkdtemp(prefix="mmt-"))
    try:
        broken = start_serve(tiny_model_dir, tmp_path, env={"TMPDIR": str(temp)})
        assert broken.process.proc is not None
        for folder in temp.glob("pymp-*"):  # multiprocessing's: the fork server listens there
            shutil.rmtree(folder)
        os.kill(role_pid(broken.process.proc.pid, "worker"), signal.SIGKILL)
        try:
            broken.process.proc.wait(60)
        finally:
            broken.process.kill()
        assert "could not be started again: stopping the server" in broken.process.log()
    finally:
        shutil.rmtree(temp, ignore_errors=True)
