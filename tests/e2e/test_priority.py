"""vLLM's ``priority`` field under ``--scheduling-policy priority``, on a real server that runs one request
at a time: requests queued behind a running one are taken by priority (lower first), then by arrival,
whichever endpoint sent them (chat, completions, responses); under the default ``fcfs`` a non-zero
priority is a 400 naming the field, never silently ignored (docs/api.md, "Request fields")."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import user_message
from tests.e2e.server import Server, role_pid
from tests.paused import paused

pytestmark = pytest.mark.slow

PROMPT = "Name three rivers and the seas they flow into."
LONG = 256  # tokens of each queued answer


def body(path: str, priority: int, num_tokens: int = 8) -> dict[str, Any]:
    """A request of ``num_tokens`` (the responses one at most: it may end at EOS, it cannot ignore it)."""
    if path == "/v1/responses":
        return {
            "model": "tiny-llava",
            "input": PROMPT,
            "max_output_tokens": num_tokens,
            "store": False,
            "priority": priority,
        }
    common = {"model": "tiny-llava", "max_tokens": num_tokens, "ignore_eos": True, "priority": priority}
    if path == "/v1/completions":
        return {"prompt": PROMPT, **common}
    return {"messages": [user_message(PROMPT)], **common}


def test_queued_requests_are_taken_by_priority_then_arrival(family_server: Callable[..., Server]) -> None:
    """A blocker runs (one request at a time); four more queue behind it, sent one after the other while
    the worker is stopped, so the engine holds all of them before anything finishes. They finish in
    priority order, arrival breaking the tie, not in the order they came: each answer arrives at least
    ``LONG`` steps after the one before it (the next one's tokens), far more than a loaded machine
    delays a thread that reads an answer."""
    server = family_server("llava", "--scheduling-policy", "priority", "--max-num-seqs", "1")
    assert server.process.proc is not None
    worker = role_pid(server.process.proc.pid, "worker")
    finished: list[str] = []
    lock = threading.Lock()

    def send(name: str, path: str, priority: int) -> None:
        resp = httpx.post(f"{server.base_url}{path}", json=body(path, priority, LONG), timeout=300)
        assert resp.status_code == 200, resp.text
        with lock:
            finished.append(name)

    queued = [
        ("blocker", "/v1/chat/completions", 3),
        ("bulk", "/v1/completions", 5),
        ("later", "/v1/chat/completions", 0),
        ("urgent", "/v1/responses", -2),
        ("last", "/v1/completions", 0),
    ]
    with ThreadPoolExecutor(len(queued)) as pool:
        with paused(worker):
            futures = []
            for name, path, priority in queued:
                sent = server.metrics()["mmserve_engine_requests_sent_total"]
                futures.append(pool.submit(send, name, path, priority))
                deadline = time.monotonic() + 60
                while server.metrics()["mmserve_engine_requests_sent_total"] == sent:
                    assert time.monotonic() < deadline, f"{name} was never sent"
                    time.sleep(0.01)
        for future in futures:
            future.result()
    assert finished == ["blocker", "urgent", "later", "last", "bulk"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_under_fcfs_a_priority_is_refused_by_name(server: Server, path: str) -> None:
    resp = httpx.post(f"{server.base_url}{path}", json=body(path, 1), timeout=120)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
    assert httpx.post(f"{server.base_url}{path}", json=body(path, 0), timeout=120).status_code == 200
    resp = httpx.post(f"{server.base_url}{path}", json=body(path, 0) | {"priority": "1"}, timeout=120)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority"
