"""The Responses API through ``mmserve proxy`` as a real process in front of an encoder instance and two
LM instances (ordinary ``mmserve serve`` on the tiny model, each with its own response store), through the
openai SDK: a response's images go to the encoder once, and its answer is the LM's own; everything that
reads a stored response (follow-ups by ``previous_response_id``, ``GET``, its input items, ``DELETE``,
a background response's polls, stream and cancel) reaches the LM instance that made it, every time,
also through a proxy started after the answer (it asks the LM instances)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY, AUTH, data_url, make_image
from tests.e2e.metrics import delta
from tests.e2e.server import Server, serving, start_proxy

pytestmark = pytest.mark.slow

FLAGS = ("--api-key", API_KEY)
FOLLOW_UPS = 6  # round-robin over two LM instances would send half of them to the wrong one


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("proxy-responses")


@pytest.fixture(scope="module")
def encoder(tiny_model_dir: Path, log_dir: Path) -> Iterator[Server]:
    with serving(tiny_model_dir, log_dir, *FLAGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def second_lm(tiny_model_dir: Path, log_dir: Path) -> Iterator[Server]:
    with serving(tiny_model_dir, log_dir, *FLAGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def lms(guarded_server: Server, second_lm: Server) -> list[Server]:
    return [guarded_server, second_lm]


def proxy_in_front(encoder: Server, lms: list[Server], log_dir: Path) -> Server:
    return start_proxy(log_dir, encoder.base_url, [lm.base_url for lm in lms])


@pytest.fixture(scope="module")
def proxy(encoder: Server, lms: list[Server], log_dir: Path) -> Iterator[Server]:
    srv = proxy_in_front(encoder, lms, log_dir)
    try:
        yield srv
    finally:
        assert srv.process.interrupt() == 0, srv.process.log()[-3000:]
        assert "Traceback" not in srv.process.log()


def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def looking_at(seed: int) -> list[dict[str, Any]]:
    image = {"type": "input_image", "image_url": data_url(make_image(seed))}
    return [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"}, image]}]


def ask(server: Server, **fields: Any) -> Any:
    return sdk(server).responses.create(model="tiny-llava", temperature=0, max_output_tokens=6, **fields)


def maker(lms: list[Server], response_id: str) -> Server:
    """The LM instance whose store holds the response."""
    (holder,) = [
        lm for lm in lms if httpx.get(f"{lm.base_url}/v1/responses/{response_id}", headers=AUTH).is_success
    ]
    return holder


def test_a_response_through_the_proxy_is_encoded_once_and_answered_by_an_lm(
    proxy: Server, encoder: Server, lms: list[Server]
) -> None:
    before, proxy_before = encoder.metrics(), proxy.metrics()
    first = ask(proxy, input=looking_at(9101), store=False)
    assert delta(before, encoder.metrics(), "mmserve_mm_items_total") == 1
    assert delta(proxy_before, proxy.metrics(), "mmserve_proxy_encoder_requests_total") == 1
    direct = ask(lms[0], input=looking_at(9101), store=False)
    assert first.output_text == direct.output_text and first.usage.input_tokens == direct.usage.input_tokens
    with sdk(proxy).responses.stream(
        model="tiny-llava", input=looking_at(9101), temperature=0, max_output_tokens=6, store=False
    ) as stream:
        streamed = [event.type for event in stream]
    assert streamed[0] == "response.created" and streamed[-1] in ("response.completed", "response.incomplete")


def test_what_reads_a_stored_response_reaches_the_lm_that_made_it(
    proxy: Server, encoder: Server, lms: list[Server], log_dir: Path
) -> None:
    client = sdk(proxy)
    first = ask(proxy, input=looking_at(9102))
    holder = maker(lms, first.id)
    previous = first.id
    for turn in range(FOLLOW_UPS):  # each answered where the chain is (round-robin alone: 404s)
        follow_up = ask(proxy, input=f"And {turn}?", previous_response_id=previous)
        assert maker(lms, follow_up.id) is holder
        previous = follow_up.id
    assert client.responses.retrieve(previous).id == previous
    listed = list(client.responses.input_items.list(previous, order="asc"))
    assert len(listed) == 2 * FOLLOW_UPS + 1  # every turn's input and answer but its own answer
    assert client.responses.input_tokens.count(model="tiny-llava", previous_response_id=previous).input_tokens
    # a proxy that has not seen these answers finds them by asking each LM instance
    fresh = proxy_in_front(encoder, lms, log_dir)
    try:
        assert sdk(fresh).responses.retrieve(first.id).id == first.id
        assert ask(fresh, input="Still there?", previous_response_id=first.id).status in (
            "completed",
            "incomplete",
        )
        sdk(fresh).responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
    finally:
        assert fresh.process.interrupt() == 0


def test_a_background_response_is_polled_streamed_and_cancelled_through_the_proxy(
    proxy: Server, lms: list[Server]
) -> None:
    client = sdk(proxy)
    body = {"model": "tiny-llava", "input": "Tell me a story.", "background": True, "stream": True}
    body |= {"temperature": 0, "max_output_tokens": 2000}
    seen: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{proxy.base_url}/v1/responses", json=body, headers=AUTH, timeout=60) as live:
        for line in live.iter_lines():
            if line.startswith("data: "):
                seen.append(json.loads(line[6:]))
            if len(seen) == 5:
                break
    response_id = seen[0]["response"]["id"]
    params = {"stream": "true", "starting_after": str(seen[-1]["sequence_number"])}
    with httpx.stream(
        "GET", f"{proxy.base_url}/v1/responses/{response_id}", params=params, headers=AUTH, timeout=60
    ) as again:
        assert again.status_code == 200
        for line in again.iter_lines():
            if line.startswith("data: "):
                assert json.loads(line[6:])["sequence_number"] == seen[-1]["sequence_number"] + 1
                break
    assert client.responses.cancel(response_id).status == "cancelled"
    assert client.responses.retrieve(response_id).status == "cancelled"
    assert maker(lms, response_id) in lms
