"""Continuous batching under concurrent streaming load, and aborts when clients go away."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import greedy_body, make_image, user_message
from tests.e2e.server import Server, serving

pytestmark = pytest.mark.slow


TOKENS = 64  # each request lives this many steps: long enough that all 16 overlap on a loaded machine


def request_body(i: int, stream: bool) -> dict:
    images = [make_image(400 + i % 5)] if i % 4 else []  # a quarter text-only, images repeat
    if i % 7 == 3:
        images.append(make_image(450 + i))  # some carry a second, unique image
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    return greedy_body([user_message(f"Request {i % 3}.", *images)], TOKENS, stream=stream, **usage)


async def stream_one(client: httpx.AsyncClient, body: dict) -> tuple[str, dict]:
    text, usage = "", {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                text += chunk["choices"][0]["delta"].get("content") or ""
            if chunk.get("usage"):
                usage = chunk["usage"]
    return text, usage


def test_sixteen_concurrent_streams_are_batched(server: Server) -> None:
    expected = []
    for i in range(16):
        resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=request_body(i, False), timeout=120)
        assert resp.status_code == 200, resp.text
        expected.append(resp.json()["choices"][0]["message"]["content"])
    before = server.metrics()

    async def run_all() -> list[tuple[str, dict]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
            return await asyncio.gather(*(stream_one(client, request_body(i, True)) for i in range(16)))

    results = asyncio.run(run_all())
    assert [text for text, _ in results] == expected
    assert all(usage["completion_tokens"] == TOKENS for _, usage in results)
    after = server.metrics()
    steps = after["mmserve_num_requests_per_step_count"] - before["mmserve_num_requests_per_step_count"]
    single = (
        after['mmserve_num_requests_per_step_bucket{le="1.0"}']
        - before['mmserve_num_requests_per_step_bucket{le="1.0"}']
    )
    batched_8_plus = steps - (
        after['mmserve_num_requests_per_step_bucket{le="4.0"}']
        - before['mmserve_num_requests_per_step_bucket{le="4.0"}']
    )
    assert steps > 0 and single < steps
    assert batched_8_plus > 0, "some steps ran more than four requests together"


def varied_body(i: int) -> dict:
    """Requests whose ends the engine learns in every way: by length, on a stop token (a third of the
    vocabulary, after ``min_tokens``), and seeded samples with logprobs, several choices each."""
    body = request_body(i, False)
    if i % 3 == 0:
        body |= {"max_tokens": 40, "min_tokens": 2, "stop_token_ids": list(range(i, 1000, 3))}
    elif i % 3 == 1:
        body |= {"temperature": 0.9, "seed": i, "n": 2, "logprobs": True, "top_logprobs": 2}
    return body


def test_scheduling_ahead_gives_the_answers_of_one_step_at_a_time(
    server: Server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The shared server schedules each step while the worker runs the one before (the default,
    ``--async-scheduling``; docs/architecture.md, "Engine step"); one with ``--no-async-scheduling``
    waits for each answer; one with ``--worker-step-overlap on`` also has its worker launch each step
    before it answers the one before (its tokens read where they were sampled). The same 12 requests
    at once get the same choices from all three: texts, finish reasons, logprobs."""

    def answers(srv: Server) -> tuple[list[list[dict]], float]:
        before = srv.metrics()["mmserve_engine_steps_ahead_total"]

        async def run_all() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=300) as client:
                return await asyncio.gather(
                    *(client.post("/v1/chat/completions", json=varied_body(i)) for i in range(12))
                )

        responses = asyncio.run(run_all())
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        choices = [r.json()["choices"] for r in responses]
        return choices, srv.metrics()["mmserve_engine_steps_ahead_total"] - before

    ahead, num_ahead = answers(server)
    (tmp_path / "sync").mkdir()
    (tmp_path / "overlap").mkdir()
    with serving(
        tiny_model_dir, tmp_path / "sync", "--max-model-len", "4096", "--no-async-scheduling"
    ) as sync:
        one_at_a_time, none_ahead = answers(sync)
    # and the worker launching each step before answering the one before, as on a GPU
    with serving(
        tiny_model_dir, tmp_path / "overlap", "--max-model-len", "4096", "--worker-step-overlap", "on"
    ) as srv:
        overlapped, overlapped_ahead = answers(srv)
    for other in (one_at_a_time, overlapped):
        assert [[tokens(c) for c in cs] for cs in ahead] == [[tokens(c) for c in cs] for cs in other]
        # logprobs to float32 rounding: a step's batch differs (as between two runs one step at a time)
        assert [x for cs in ahead for c in cs for x in logprobs(c)] == pytest.approx(
            [x for cs in other for c in cs for x in logprobs(c)], abs=1e-4
        )
    assert num_ahead > 5 and none_ahead == 0 and overlapped_ahead > 5  # (about 100 on a quiet machine)
    assert {c["finish_reason"] for cs in ahead for c in cs} == {"stop", "length"}


def tokens(choice: dict) -> tuple[str, str, list[str] | None]:
    """A choice's text, finish reason and, with logprobs, its tokens and each one's top tokens."""
    content = (choice.get("logprobs") or {}).get("content")
    listed = [f"{t['token']}|{[top['token'] for top in t['top_logprobs']]}" for t in content or []]
    return choice["message"]["content"], choice["finish_reason"], listed or None


def logprobs(choice: dict) -> list[float]:
    content = (choice.get("logprobs") or {}).get("content") or []
    return [t["logprob"] for t in content] + [top["logprob"] for t in content for top in t["top_logprobs"]]


CLIENT_GONE = 'mmserve_http_requests_total{route="/v1/chat/completions",status="499"}'


def wait_until_idle(server: Server) -> dict[str, float]:
    """Metrics once the engine holds no request (running and waiting gauges at 0), or after 15 s."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if metrics["mmserve_num_requests_running"] == 0 and metrics["mmserve_num_requests_waiting"] == 0:
            break
        time.sleep(0.2)
    return metrics


def test_client_gone_while_waiting_for_a_whole_answer_aborts_it(server: Server) -> None:
    """A non-streamed request whose client gives up mid-generation: the engine drops it and releases
    its KV blocks and encoder references."""
    body = greedy_body([user_message("Take your time.", make_image(498))], max_tokens=1400)
    gone = server.metrics()[CLIENT_GONE]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 30  # until the API noticed and gave up the request, however far it got
    while server.metrics()[CLIENT_GONE] == gone:
        assert time.monotonic() < deadline, "the API never answered the gone client 499"
        time.sleep(0.1)
    metrics = wait_until_idle(server)
    assert metrics["mmserve_num_requests_running"] == 0
    assert metrics["mmserve_kv_cache_usage_ratio"] == 0, "no block is held by a request any more"
    steps = metrics["mmserve_engine_steps_total"]
    time.sleep(1.0)
    assert server.metrics()["mmserve_engine_steps_total"] == steps, "the engine stopped working on it"


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_aborts_the_request(server: Server, n: int) -> None:
    """Every choice of it (``n`` engine requests)."""
    body = {
        "model": "tiny-llava",
        "messages": [user_message("Go on forever.", make_image(499))],
        "max_tokens": 1400,
        "ignore_eos": True,
        "stream": True,
        "n": n,
    }
    with (
        httpx.Client(base_url=server.base_url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        lines = resp.iter_lines()
        received = [line for line, _ in zip(lines, range(4), strict=False)]
        assert any(line.startswith("data: ") for line in received)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if metrics["mmserve_num_requests_running"] == 0:
            break
        time.sleep(0.2)
    assert metrics["mmserve_num_requests_running"] == 0
    steps = metrics["mmserve_engine_steps_total"]
    time.sleep(1.0)
    assert server.metrics()["mmserve_engine_steps_total"] == steps, "the engine stopped working on it"


def test_a_client_gone_while_sending_its_body_is_a_499(server: Server) -> None:
    """It sends a third of its declared body and closes: a 499 (client closed request), not a 400 for a
    body that failed to parse, and nothing reaches the engine."""
    body = json.dumps(greedy_body([user_message("x" * 3_000_000)], max_tokens=4)).encode()
    before = server.metrics()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body[: len(body) // 3])
    bad_body = CLIENT_GONE.replace('"499"', '"400"')
    deadline = time.monotonic() + 30
    while server.metrics()[CLIENT_GONE] == before[CLIENT_GONE]:
        assert time.monotonic() < deadline, "the API never counted the gone client 499"
        time.sleep(0.05)
    after = server.metrics()
    assert after.get(bad_body, 0) == before.get(bad_body, 0)
    assert after["mmserve_prompt_tokens_total"] == before["mmserve_prompt_tokens_total"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_before_its_first_token_is_aborted_at_once(server: Server, stream: bool) -> None:
    """It leaves while its new image is processed or its prompt waits for the first token: the request
    is abandoned there (or aborted in the engine at once), not generated for nobody."""
    # new to the server: processed for longer than the client waits
    image = make_image(496 if stream else 497, size=(1024, 1024))
    body = greedy_body([user_message("Then leave.", image)], max_tokens=1400)
    body |= {"ignore_eos": True, "stream": stream}
    before = server.metrics()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=0.05)
    deadline = time.monotonic() + 30
    while server.metrics()[CLIENT_GONE] == before[CLIENT_GONE]:
        assert time.monotonic() < deadline, "the API never answered the gone client 499"
        time.sleep(0.05)
    after = wait_until_idle(server)
    generated = after["mmserve_generation_tokens_total"] - before["mmserve_generation_tokens_total"]
    assert generated < 50, f"{generated} tokens generated for a client that had left"
    assert after["mmserve_kv_cache_usage_ratio"] == 0
