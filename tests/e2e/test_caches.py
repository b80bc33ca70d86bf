"""The three multimodal caches: answers never change, and a repeated image is served from all three."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import greedy_body, make_image, user_message
from tests.e2e.metrics import delta
from tests.e2e.server import Server

pytestmark = pytest.mark.slow


def chat(server: Server, messages: list[dict], max_tokens: int = 12) -> str:
    body = greedy_body(messages, max_tokens)
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def test_same_answers_with_all_caches_on_and_off(server: Server, uncached_server: Server) -> None:
    a, b, c = make_image(100), make_image(101, (640, 480)), make_image(102, (100, 300))
    sequence = [
        [user_message("First look.", a)],
        [user_message("Both of them.", a, b)],
        [user_message("Again the first.", a)],
        [user_message("Another pair.", c, b)],
        [user_message("Twice the same.", c, c)],
        [
            user_message("A conversation.", b),
            {"role": "assistant", "content": "a picture"},
            user_message("And now?", a),
        ],
        [user_message("Back to the second.", b)],
    ]
    cached = [chat(server, messages) for messages in sequence]
    before = uncached_server.metrics()
    uncached = [chat(uncached_server, messages) for messages in sequence]
    after = uncached_server.metrics()
    assert cached == uncached
    assert len(set(cached)) >= 5  # the requests really differ
    assert delta(before, after, "mmserve_mm_processor_cache_hits_total") == 0
    assert delta(before, after, "mmserve_mm_ipc_cache_hits_total") == 0
    assert delta(before, after, "mmserve_mm_items_total") == 11
    # every item is encoded for its request, but the image sent twice in one request once, and the first
    # image of the three requests that begin as an earlier one does ("USER: " and that image): their
    # prefix-cache hit holds it whole (the prefix cache is on)
    assert delta(before, after, "mmserve_encoder_runs_total") == 10 - 3


def test_repeated_image_hits_every_cache(server: Server) -> None:
    image = make_image(200, (1024, 768))
    first = server.metrics()
    answer = chat(server, [user_message("What is this?", image)])
    middle = server.metrics()
    assert delta(first, middle, "mmserve_encoder_runs_total") == 1
    assert delta(first, middle, "mmserve_mm_ipc_payload_bytes_total") > 1_000_000  # pixel tensors crossed
    again = chat(server, [user_message("What is this?", image)])
    last = server.metrics()
    assert again == answer
    assert delta(middle, last, "mmserve_mm_items_total") == 1
    assert delta(middle, last, "mmserve_mm_processor_cache_hits_total") == 1
    assert delta(middle, last, "mmserve_mm_ipc_cache_hits_total") == 1
    assert delta(middle, last, "mmserve_mm_ipc_payload_bytes_total") < 1024  # only the key crossed
    # the prefix-cache hit holds the image whole: the encoder cache is not even asked
    assert delta(middle, last, "mmserve_encoder_cache_queries_total") == 0
    assert delta(middle, last, "mmserve_encoder_runs_total") == 0
    # behind another prompt only the encoder cache has the image's embeddings
    chat(server, [{"role": "system", "content": "Be brief."}, user_message("What is this?", image)])
    final = server.metrics()
    assert delta(last, final, "mmserve_mm_processor_cache_hits_total") == 1
    assert delta(last, final, "mmserve_encoder_cache_hits_total") == 1
    assert delta(last, final, "mmserve_encoder_runs_total") == 0
    assert final["mmserve_mm_ipc_cache_resends_total"] == 0


def test_same_bytes_by_url_and_data_url_share_a_hash(server: Server, image_http_server: str) -> None:
    image = make_image(201)
    by_data = chat(server, [user_message("Which?", image)])
    before = server.metrics()
    url = image_http_server + "/img201.png"
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Which?"}],
        }
    ]
    assert chat(server, messages) == by_data
    after = server.metrics()
    assert delta(before, after, "mmserve_mm_ipc_cache_hits_total") == 1
    assert delta(before, after, "mmserve_encoder_runs_total") == 0


def test_mm_processor_kwargs_change_the_hash(server: Server) -> None:
    image = make_image(202)
    chat(server, [user_message("Kw.", image)])
    before = server.metrics()
    body = {
        "model": "tiny-llava",
        "messages": [user_message("Kw.", image)],
        "max_tokens": 4,
        "mm_processor_kwargs": {"do_normalize": False},
    }
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    after = server.metrics()
    assert delta(before, after, "mmserve_mm_processor_cache_hits_total") == 0
    assert delta(before, after, "mmserve_encoder_runs_total") == 1


def test_reset_empties_every_cache(server: Server) -> None:
    image = make_image(203)
    answer = chat(server, [user_message("Reset?", image)])
    assert httpx.post(f"{server.base_url}/reset_mm_cache").status_code == 200
    before = server.metrics()
    assert chat(server, [user_message("Reset?", image)]) == answer
    after = server.metrics()
    assert delta(before, after, "mmserve_mm_processor_cache_hits_total") == 0
    assert delta(before, after, "mmserve_mm_ipc_cache_hits_total") == 0
    assert delta(before, after, "mmserve_encoder_runs_total") == 1
    assert after["mmserve_mm_ipc_cache_resends_total"] == 0
    again = server.metrics()
    assert chat(server, [user_message("Reset?", image)]) == answer  # and they fill again
    assert delta(again, server.metrics(), "mmserve_mm_ipc_cache_hits_total") == 1
