"""``serve --api-server-count 2``: two API processes on one port (SO_REUSEPORT), each with its own IPC
mirror and receiver-cache partition. Under concurrent load both serve, no mirror ever claims an item its
partition lacks, and ``/metrics`` shows the same totals whichever process answers; a killed API process is
restarted alone; SIGTERM drains both; Ctrl-C stops everything."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import data_url, greedy_body, make_image, user_message
from tests.e2e.metrics import Metrics, delta, parse_metrics
from tests.e2e.server import (
    Server,
    alive,
    api_process,
    assert_ctrl_c_stops_all,
    descendants,
    role_pid,
    role_pids,
    serving,
    start_serve,
    wait_api_processes,
)
from tests.paused import paused

pytestmark = pytest.mark.slow

SCALE_OUT = ("--api-server-count", "2", "--mm-preprocess-processes", "0")
IMAGES = [make_image(90 + k) for k in range(4)]
NUM_REQUESTS = 24
CONCURRENCY = 8
MAX_TOKENS = 6


def body(key: int, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """Prompt ``key``: the same image and text every time, so mirrors hit and answers repeat."""
    return greedy_body([user_message(f"What is in picture {key}?", IMAGES[key])], max_tokens=max_tokens)


def post(server: Server, payload: dict[str, Any]) -> httpx.Response:
    """On a new connection (httpx.post opens one per call): the kernel picks the process anew."""
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=120)


def served(values: dict[str, float]) -> float:
    return sum(v for name, v in values.items() if name.startswith("mmserve_request_success_total"))


def metrics_by_process(server: Server, min_reads: int = 6, max_reads: int = 60) -> dict[int, list[Metrics]]:
    """``/metrics`` read on new connections until each process answered at least once."""
    readings: dict[int, list[Metrics]] = defaultdict(list)
    for read in range(max_reads):
        resp = httpx.get(f"{server.base_url}/metrics", timeout=10)
        assert resp.status_code == 200
        readings[api_process(resp)].append(parse_metrics(resp.text))
        if read + 1 >= min_reads and len(readings) == 2:
            break
    assert set(readings) == {0, 1}, f"only process(es) {set(readings)} answered /metrics"
    return readings


def settled(server: Server, name: str, timeout_s: float = 10.0) -> Metrics:
    """Process 0's metrics once every process reports the same engine figure ``name``: the engine's
    figures reach each API process with its own stream of messages, so one may lag the other."""
    deadline = time.monotonic() + timeout_s
    while True:
        readings = metrics_by_process(server)
        if len({m.get(name, 0.0) for ms in readings.values() for m in ms}) == 1:
            return readings[0][-1]
        assert time.monotonic() < deadline, f"the processes never agreed on {name}"
        time.sleep(0.1)


def total(server: Server, name: str) -> float:
    """A figure all processes agree on (checked), read from whichever answers."""
    values = {
        served(v) if name == "served" else v.get(name, 0.0)
        for vs in metrics_by_process(server, min_reads=2).values()
        for v in vs
    }
    assert len(values) == 1, f"{name} differs between processes: {values}"
    return values.pop()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tiny_model_dir, tmp_path_factory.mktemp("scale-out"), *SCALE_OUT) as started:
        wait_api_processes(started, 2)
        yield started


def test_two_processes_share_the_load_and_the_totals(server: Server) -> None:
    before = metrics_by_process(server)[0][0]
    keys = [i % len(IMAGES) for i in range(NUM_REQUESTS)]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        responses = list(pool.map(lambda key: post(server, body(key)), keys))

    answers: dict[int, set[str]] = defaultdict(set)
    processes: dict[int, set[int]] = defaultdict(set)
    for key, resp in zip(keys, responses, strict=True):
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert resp.json()["usage"]["completion_tokens"] == MAX_TOKENS
        answers[key].add(choice["message"]["content"])
        processes[key].add(api_process(resp))
    assert set().union(*processes.values()) == {0, 1}, "the kernel spread the connections"
    assert all(len(a) == 1 for a in answers.values()), f"one greedy answer per prompt: {answers}"
    assert any(len(p) == 2 for p in processes.values()), "some prompt was answered by both processes"

    # each process's mirror missed an image at least the first time that process saw it; requests
    # prepared while that first one was still in flight may miss too, so under concurrency only the bounds
    num_first_sightings = sum(len(p) for p in processes.values())
    for index, readings in metrics_by_process(server).items():
        for after in readings:
            grew = {name: delta(before, after, name) for name in after}
            assert served(after) - served(before) == NUM_REQUESTS, f"process {index}"
            assert grew["mmserve_mm_items_total"] == NUM_REQUESTS, f"process {index}"
            assert grew["mmserve_mm_ipc_cache_queries_total"] == NUM_REQUESTS, f"process {index}"
            misses = NUM_REQUESTS - grew["mmserve_mm_ipc_cache_hits_total"]
            assert num_first_sightings <= misses < NUM_REQUESTS, f"process {index}"
            assert after["mmserve_mm_ipc_cache_resends_total"] == 0.0, f"process {index}"

    # one at a time, exactly: a process that already sent an image hits, one that never saw it misses once
    before = metrics_by_process(server)[0][0]
    new_sightings = 0
    for key in keys[: 2 * len(IMAGES)]:
        resp = post(server, body(key))
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] in answers[key]
        if api_process(resp) not in processes[key]:
            new_sightings += 1
            processes[key].add(api_process(resp))
    after = metrics_by_process(server)[0][0]
    hits = delta(before, after, "mmserve_mm_ipc_cache_hits_total")
    assert 2 * len(IMAGES) - hits == new_sightings
    assert after["mmserve_mm_ipc_cache_resends_total"] == 0.0


def test_a_media_id_bound_through_one_process_is_served_through_the_other(server: Server) -> None:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": data_url(make_image(95))}, "uuid": "p"}
    payload = greedy_body([{"role": "user", "content": [part, {"type": "text", "text": "?"}]}], MAX_TOKENS)
    bound = post(server, payload)
    assert bound.status_code == 200, bound.text
    expected = bound.json()["choices"][0]["message"]["content"]
    part["image_url"] = None
    before = settled(server, "mmserve_encoder_runs_total")
    answered_by: set[int] = set()
    for _ in range(60):  # new connections until both processes answered (the kernel picks one each)
        resp = post(server, payload)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == expected
        answered_by.add(api_process(resp))
        if answered_by == {0, 1}:
            break
    assert answered_by == {0, 1}
    after = settled(server, "mmserve_encoder_runs_total")
    assert delta(before, after, "mmserve_mm_processor_seconds_count") == 0  # nothing processed again
    assert delta(before, after, "mmserve_encoder_runs_total") == 0
    assert delta(before, after, 'mmserve_mm_uuid_lookups_total{result="hit"}') >= 2
    assert after["mmserve_mm_ipc_cache_resends_total"] == 0.0


def test_constrained_requests_through_both_processes_share_the_engines_grammars(server: Server) -> None:
    """The compiled-grammar cache lives in the engine: a schema compiled for one API process's request
    serves the other's; both answer the same and within the schema."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
    }
    payload = {
        **body(0, max_tokens=40),
        "ignore_eos": False,
        "structured_outputs": {"json": schema, "disable_any_whitespace": True},
    }
    before = metrics_by_process(server)[0][0]
    answers: set[str] = set()
    answered_by: set[int] = set()
    for _ in range(60):  # new connections until both processes answered
        resp = post(server, payload)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["finish_reason"] == "stop"
        answers.add(resp.json()["choices"][0]["message"]["content"])
        answered_by.add(api_process(resp))
        if answered_by == {0, 1}:
            break
    assert answered_by == {0, 1} and len(answers) == 1
    assert isinstance(json.loads(answers.pop())["n"], int)
    after = metrics_by_process(server)[0][0]
    assert delta(before, after, "mmserve_structured_output_compile_seconds_count") == 1
    assert delta(before, after, "mmserve_structured_output_cache_hits_total") >= 1


def test_a_killed_api_process_is_restarted_alone(server: Server) -> None:
    assert server.process.proc is not None
    root = server.process.proc.pid
    [child] = role_pids(root, "api")
    engine, worker = role_pid(root, "engine"), role_pid(root, "worker")
    expected = post(server, body(0)).json()["choices"][0]["message"]["content"]
    served_before = total(server, "served")

    os.kill(child, signal.SIGKILL)
    # reaped by the supervisor, which happens once its last thread exited and so its socket closed (a
    # zombie leader's other threads may still hold it, and connections queued there are reset)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    for _ in range(4):  # the port stays served, by the main process alone
        resp = post(server, body(0))
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == expected

    wait_api_processes(server, 2)
    [restarted] = role_pids(root, "api")
    assert restarted != child
    assert (role_pid(root, "engine"), role_pid(root, "worker")) == (engine, worker), "restarted alone"
    assert "restarting api-1" in server.process.log()
    # the kernel hashes each new connection to one of the two sockets: at least 10 requests, and more
    # (at most 60) until both processes answered, so that a run of one process (1 in 512 for 10) is
    # not a failure
    seen: set[int] = set()
    num_sent = 0
    while num_sent < 10 or (seen != {0, 1} and num_sent < 60):
        resp = post(server, body(0))
        num_sent += 1
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == expected
        seen.add(api_process(resp))
    # what the killed process served still counts (its metric files stay), and no mirror went wrong
    assert total(server, "served") == served_before + 4 + num_sent
    assert total(server, "mmserve_mm_ipc_cache_resends_total") == 0.0
    assert seen == {0, 1}, seen


def stream_in_thread(server: Server, payload: dict[str, Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """A streamed request on a new connection, returned once its first tokens arrived; ``record`` holds
    the answering process and the events ("[DONE]" as a string, "cut off" if the connection closed)."""
    record: dict[str, Any] = {"process": None, "events": []}

    def run() -> None:
        url = f"{server.base_url}/v1/chat/completions"
        try:
            with (
                httpx.Client(timeout=120) as client,
                client.stream("POST", url, json={**payload, "stream": True}) as r,
            ):
                record["process"] = api_process(r)
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line.removeprefix("data: ")
                        record["events"].append(data if data == "[DONE]" else json.loads(data))
        except httpx.HTTPError:
            record["events"].append("cut off")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while len(record["events"]) < 3 and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(record["events"]) >= 3, record
    return thread, record


def paused_with_a_stream_in_each(
    server: Server, pause: contextlib.ExitStack
) -> list[tuple[threading.Thread, dict[str, Any]]]:
    """Streams started until each API process has one under way, then the worker paused (in ``pause``)."""
    assert server.process.proc is not None
    worker = role_pid(server.process.proc.pid, "worker")
    streams: list[tuple[threading.Thread, dict[str, Any]]] = []

    def under_way() -> set[int]:
        return {r["process"] for t, r in streams if t.is_alive() and "[DONE]" not in r["events"]}

    while True:
        if under_way() == {0, 1}:
            pause.enter_context(paused(worker))
            if under_way() == {0, 1}:
                return streams
            pause.close()  # one ended just before the pause: go on
        assert len(streams) < 12, "the kernel never gave a stream to both processes"
        streams.append(stream_in_thread(server, body(len(streams) % len(IMAGES), max_tokens=1400)))


def test_sigterm_drains_both_api_processes(tiny_model_dir: Path, tmp_path: Path) -> None:
    drained = start_serve(tiny_model_dir, tmp_path, *SCALE_OUT, "--shutdown-timeout", "60")
    assert drained.process.proc is not None
    proc = drained.process.proc
    try:
        wait_api_processes(drained, 2)
        children = descendants(proc.pid)
        # the worker paused with a stream under way in each process: none can end while the drain is
        # checked, however slow the machine
        with contextlib.ExitStack() as pause:
            streams = paused_with_a_stream_in_each(drained, pause)
            proc.send_signal(signal.SIGTERM)  # to the main process only: it forwards it to the other
            draining: set[int] = set()  # /health first: a request taken before a drain would wait
            deadline = time.monotonic() + 30
            while draining != {0, 1}:
                assert time.monotonic() < deadline, f"only {draining} began draining"
                health = httpx.get(f"{drained.base_url}/health", timeout=10)
                if health.json() == {"status": "draining"}:
                    draining.add(api_process(health))
            refused_by: set[int] = set()
            while refused_by != {0, 1}:
                assert time.monotonic() < deadline, f"only {refused_by} refused new requests"
                resp = post(drained, body(0))
                assert resp.status_code == 503 and resp.json()["error"]["code"] == "server_shutting_down"
                refused_by.add(api_process(resp))

        for thread, record in streams:
            thread.join(120)
            events = record["events"]
            assert events[-1] == "[DONE]", (record["process"], events[-3:])
            choices = [e["choices"][0] for e in events if isinstance(e, dict) and e["choices"]]
            assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
        assert proc.wait(60) == 0, drained.process.log()[-3000:]
    except BaseException:
        drained.process.kill()
        raise
    assert "Traceback" not in drained.process.log()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)], "no orphan processes"


def test_ctrl_c_stops_every_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = start_serve(tiny_model_dir, tmp_path, *SCALE_OUT)
    assert server.process.proc is not None
    try:
        wait_api_processes(server, 2)
        children = descendants(server.process.proc.pid)
        assert len(role_pids(server.process.proc.pid, "api")) == 1
    except BaseException:
        server.process.kill()
        raise
    # Ctrl-C pressed again and again: every process may get another SIGINT at any point of its exit
    # (serve also passes one on to its other API processes once its own stopped)
    assert_ctrl_c_stops_all(server, children, repeat_to=[server.process.proc.pid, *children])
