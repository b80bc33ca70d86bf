"""Backpressure end to end: with one running slot and one waiting place, a burst of requests gets 429s
with ``Retry-After`` in the OpenAI envelope, and every request that was accepted still gets its one
complete answer."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.e2e.conftest import greedy_body, user_message
from tests.e2e.server import Server

pytestmark = pytest.mark.slow


def test_a_burst_gets_429_and_accepted_requests_all_finish(narrow_server: Server) -> None:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=narrow_server.base_url, timeout=120) as client:
            bodies = [greedy_body([user_message(f"Burst {i}.")], 48) for i in range(8)]
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))

    responses = asyncio.run(run())
    accepted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(accepted) + len(refused) == 8 and accepted and refused
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "too_many_requests"
    for r in accepted:
        assert r.json()["usage"]["completion_tokens"] == 48
        assert r.json()["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 5  # the gauges arrive with the engine's next stats
    while time.monotonic() < deadline:
        metrics = narrow_server.metrics()
        if metrics["mmserve_num_requests_running"] == metrics["mmserve_num_requests_waiting"] == 0:
            break
        time.sleep(0.1)
    assert metrics["mmserve_num_requests_running"] == 0 and metrics["mmserve_num_requests_waiting"] == 0
    # and it serves normally afterwards
    after = httpx.post(
        f"{narrow_server.base_url}/v1/chat/completions",
        json=greedy_body([user_message("After.")], 4),
        timeout=60,
    )
    assert after.status_code == 200
