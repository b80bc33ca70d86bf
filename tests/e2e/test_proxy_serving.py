"""``mmserve proxy`` as a real process in front of two ordinary ``mmserve serve`` instances on the tiny
model, one as its encoder and one as its LM (an ordinary instance answers the encoder request with one
token; what counts here is that it received each image once). Checked: the proxied answer is the LM's
own, token for token, streamed or not; one encoder request per distinct image and none for text; a down
encoder only costs a counted failure, a down LM is a quick 503; the client's key reaches both; a client
that leaves aborts the request on the LM; Ctrl-C and SIGTERM stop the proxy with status 0."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import API_KEY, AUTH, greedy_body, make_image, user_message
from tests.e2e.metrics import delta
from tests.e2e.server import Server, free_port, serving, start_proxy

pytestmark = pytest.mark.slow

SERVE_FLAGS = ("--api-key", API_KEY)  # the LM is the session's guarded_server, with this key
MAX_TOKENS = 8
RUNNING = "mmserve_num_requests_running"


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("proxy")


@pytest.fixture(scope="module")
def encoder(tiny_model_dir: Path, log_dir: Path) -> Iterator[Server]:
    with serving(tiny_model_dir, log_dir, *SERVE_FLAGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def lm(guarded_server: Server) -> Server:
    return guarded_server


@pytest.fixture(scope="module")
def proxy(encoder: Server, lm: Server, log_dir: Path) -> Iterator[Server]:
    srv = start_proxy(log_dir, encoder.base_url, lm.base_url)
    try:
        yield srv
    finally:
        assert srv.process.interrupt() == 0, srv.process.log()[-3000:]
        assert "Traceback" not in srv.process.log()


def post(server: Server, body: dict[str, Any], headers: dict[str, str] = AUTH) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def answer(server: Server, body: dict[str, Any]) -> tuple[str, list[str]]:
    """Text and tokens of a non-streamed answer."""
    resp = post(server, body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-mmserve-api-process"] == "0"  # the instance's, relayed
    choice = resp.json()["choices"][0]
    return choice["message"]["content"], [entry["token"] for entry in choice["logprobs"]["content"]]


def streamed_answer(server: Server, body: dict[str, Any]) -> tuple[str, list[str]]:
    """Text and tokens of a streamed answer, from its SSE events."""
    text, tokens = "", []
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/chat/completions",
        json={**body, "stream": True},
        headers=AUTH,
        timeout=120,
    ) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            text += choice["delta"].get("content", "")
            tokens += [entry["token"] for entry in (choice.get("logprobs") or {}).get("content", [])]
    return text, tokens


def request(text: str, *seeds: int) -> dict[str, Any]:
    images = [make_image(seed) for seed in seeds]
    return greedy_body([user_message(text, *images)], MAX_TOKENS, logprobs=True)


def wait_idle(server: Server) -> dict[str, float]:
    """Metrics once the server's engine runs no request, or after 60 s."""
    deadline = time.monotonic() + 60
    metrics = server.metrics()
    while metrics[RUNNING] != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        metrics = server.metrics()
    return metrics


@pytest.mark.parametrize("seeds", [(7001,), (7002, 7003)], ids=["one-image", "two-images"])
def test_proxied_answer_is_the_lms_own_token_for_token(
    proxy: Server, encoder: Server, lm: Server, seeds: tuple[int, ...]
) -> None:
    body = request("Describe the pictures.", *seeds)
    before = encoder.metrics()
    proxied = answer(proxy, body)
    assert delta(before, encoder.metrics(), "mmserve_mm_items_total") == len(seeds)
    assert len(proxied[1]) == MAX_TOKENS
    assert proxied == answer(lm, body)
    assert streamed_answer(proxy, body) == proxied == streamed_answer(lm, body)


def test_one_encoder_request_per_distinct_image_and_none_for_text(
    proxy: Server, encoder: Server, lm: Server
) -> None:
    x, y = make_image(7010), make_image(7011)
    body = greedy_body([user_message("First.", x, y), user_message("Again.", x)], MAX_TOKENS)
    before, proxy_before, lm_before = encoder.metrics(), proxy.metrics(), lm.metrics()
    assert post(proxy, body).status_code == 200
    assert delta(before, encoder.metrics(), "mmserve_mm_items_total") == 2
    assert delta(proxy_before, proxy.metrics(), "mmserve_proxy_encoder_requests_total") == 2
    assert delta(lm_before, lm.metrics(), "mmserve_mm_items_total") == 3  # the LM gets the request as sent

    before, proxy_before = encoder.metrics(), proxy.metrics()
    assert post(proxy, greedy_body([user_message("Only text.")], MAX_TOKENS)).status_code == 200
    after = encoder.metrics()
    assert delta(before, after, 'mmserve_request_success_total{finish_reason="length"}') == 0
    assert delta(before, after, "mmserve_prompt_tokens_total") == 0
    assert delta(proxy_before, proxy.metrics(), "mmserve_proxy_encoder_requests_total") == 0


def test_a_completion_goes_to_an_lm_alone(proxy: Server, encoder: Server, lm: Server) -> None:
    body = {"model": "tiny-llava", "prompt": "A red bus", "max_tokens": 6, "temperature": 0}
    before = encoder.metrics()
    proxied = httpx.post(f"{proxy.base_url}/v1/completions", json=body, headers=AUTH, timeout=60)
    direct = httpx.post(f"{lm.base_url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert proxied.status_code == direct.status_code == 200, proxied.text
    assert proxied.json()["choices"] == direct.json()["choices"]
    assert delta(before, encoder.metrics(), "mmserve_prompt_tokens_total") == 0
    named = httpx.post(
        f"{proxy.base_url}/v1/completions",
        json=body,
        headers={**AUTH, "X-Request-Id": "via-proxy"},
        timeout=60,
    )
    assert named.json()["id"] == "cmpl-via-proxy"  # the header reaches the LM


def test_the_clients_key_reaches_encoder_and_lm(proxy: Server, encoder: Server) -> None:
    body = request("Who may ask?", 7020)
    before, proxy_before = encoder.metrics(), proxy.metrics()
    refused = post(proxy, body, headers={})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert delta(proxy_before, proxy.metrics(), "mmserve_proxy_encoder_failures_total") == 1  # its own 401
    assert delta(before, encoder.metrics(), "mmserve_mm_items_total") == 0
    assert httpx.get(f"{proxy.base_url}/v1/models").status_code == 401
    proxy_before = proxy.metrics()
    assert post(proxy, body).status_code == 200
    assert delta(before, encoder.metrics(), "mmserve_mm_items_total") == 1
    assert delta(proxy_before, proxy.metrics(), "mmserve_proxy_encoder_failures_total") == 0


def test_models_and_health(proxy: Server, lm: Server) -> None:
    models = httpx.get(f"{proxy.base_url}/v1/models", headers=AUTH)
    assert models.status_code == 200
    assert models.json() == httpx.get(f"{lm.base_url}/v1/models", headers=AUTH).json()
    card = httpx.get(f"{proxy.base_url}/v1/models/tiny-llava", headers=AUTH)
    assert card.status_code == 200 and card.json() == models.json()["data"][0]
    assert httpx.get(f"{proxy.base_url}/v1/models/gpt-4o", headers=AUTH).status_code == 404
    health = httpx.get(f"{proxy.base_url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert httpx.head(f"{proxy.base_url}/health").status_code == 200


def test_a_down_encoder_costs_a_counted_failure_only(lm: Server, log_dir: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = start_proxy(log_dir, dead, lm.base_url)
    try:
        body = request("Nobody encodes this.", 7030)
        assert answer(proxy, body) == answer(lm, body)
        assert proxy.metrics()["mmserve_proxy_encoder_failures_total"] == 1
        health = httpx.get(f"{proxy.base_url}/health")
        assert health.status_code == 503
        assert [(d["role"], d["url"]) for d in health.json()["down"]] == [("encoder", dead)]
    finally:
        assert proxy.process.interrupt() == 0
    assert "Traceback" not in proxy.process.log()


def test_a_down_lm_is_a_quick_503_and_sigterm_stops_the_proxy(encoder: Server, log_dir: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = start_proxy(log_dir, encoder.base_url, dead)
    try:
        start = time.monotonic()
        resp = post(proxy, request("Nobody answers.", 7040))
        assert time.monotonic() - start < 10
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"] == {
            "message": resp.json()["error"]["message"],
            "type": "server_error",
            "param": None,
            "code": "upstream_unavailable",
        }
        assert proxy.metrics()["mmserve_proxy_upstream_errors_total"] == 1
        assert httpx.get(f"{proxy.base_url}/health").json()["down"][0]["url"] == dead
    finally:
        assert proxy.process.proc is not None
        os.killpg(proxy.process.proc.pid, signal.SIGTERM)
        rc = proxy.process.proc.wait(30)
    assert rc == 0 and "Traceback" not in proxy.process.log()


def test_a_client_leaving_mid_stream_aborts_the_request_on_the_lm(proxy: Server, lm: Server) -> None:
    body = greedy_body([user_message("Go on forever.", make_image(7050))], 1400, stream=True)
    before = lm.metrics()
    with (
        httpx.Client(base_url=proxy.base_url, headers=AUTH, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        received = [line for line, _ in zip(resp.iter_lines(), range(4), strict=False)]
        assert any(line.startswith("data: ") for line in received)
    metrics = wait_idle(lm)
    assert delta(before, metrics, 'mmserve_request_success_total{finish_reason="length"}') == 0
    assert metrics[RUNNING] == 0
    steps = metrics["mmserve_engine_steps_total"]
    time.sleep(1.0)
    assert lm.metrics()["mmserve_engine_steps_total"] == steps, "the LM stopped working on it"


async def give_up_once_running(proxy: Server, lm: Server, body: dict[str, Any]) -> None:
    """Posts ``body`` (not streamed) and closes the connection as soon as the LM runs it."""
    async with httpx.AsyncClient(base_url=proxy.base_url, headers=AUTH, timeout=60) as client:
        post = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
        deadline = time.monotonic() + 30
        while lm.metrics()[RUNNING] < 1 and not post.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not post.done(), "answered before the client could give up"
        post.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await post


def test_a_client_giving_up_on_a_whole_answer_aborts_it_on_the_lm(proxy: Server, lm: Server) -> None:
    body = greedy_body([user_message("Take your time.", make_image(7060))], 1400)
    before = lm.metrics()
    asyncio.run(give_up_once_running(proxy, lm, body))
    metrics = wait_idle(lm)
    assert delta(before, metrics, "mmserve_prompt_tokens_total") > 0, "the LM had started on it"
    assert delta(before, metrics, 'mmserve_request_success_total{finish_reason="length"}') == 0
    assert metrics[RUNNING] == 0
    steps = metrics["mmserve_engine_steps_total"]
    time.sleep(1.0)
    assert lm.metrics()["mmserve_engine_steps_total"] == steps, "the LM stopped working on it"
