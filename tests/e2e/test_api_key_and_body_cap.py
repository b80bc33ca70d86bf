"""``--api-key`` and ``--max-request-body-mb`` on a real server: guarded routes need the bearer key (curl
shape and the openai SDK), /health and /metrics stay open, and oversized bodies get 413 whether their
size is declared or streamed; the server keeps serving."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY, AUTH, greedy_body, make_image, user_message
from tests.e2e.server import Server

pytestmark = pytest.mark.slow


def test_guarded_routes_need_the_key(guarded_server: Server) -> None:
    url = guarded_server.base_url
    body = greedy_body([user_message("Hello.")], 4)
    for headers in ({}, {"Authorization": "Bearer nope"}):
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 401
        assert httpx.post(f"{url}/reset_mm_cache", headers=headers).status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    ok = httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert ok.status_code == 200, ok.text


def test_openai_sdk_with_and_without_the_key(guarded_server: Server) -> None:
    good = openai.OpenAI(base_url=f"{guarded_server.base_url}/v1", api_key=API_KEY)
    assert [m.id for m in good.models.list()] == ["tiny-llava"]
    bad = openai.OpenAI(base_url=f"{guarded_server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_bodies_over_the_cap_get_413_declared_or_streamed(guarded_server: Server) -> None:
    url = f"{guarded_server.base_url}/v1/chat/completions"
    huge = greedy_body([user_message("x" * (2 << 20))], 4)
    resp = httpx.post(url, json=huge, headers=AUTH, timeout=60)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny-llava", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}]}'

    streamed = httpx.post(
        url, content=chunks(), headers={**AUTH, "Content-Type": "application/json"}, timeout=60
    )
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "request_too_large"
    gzipped = gzip.compress(json.dumps(greedy_body([user_message("Hi.")], 4)).encode())
    headers = {**AUTH, "Content-Type": "application/json", "Content-Encoding": "gzip"}
    compressed = httpx.post(url, content=gzipped, headers=headers, timeout=60)
    assert compressed.status_code == 415
    assert compressed.json()["error"]["code"] == "unsupported_content_encoding"
    image = greedy_body([user_message("Still serving.", make_image(950))], 4)
    assert httpx.post(url, json=image, headers=AUTH, timeout=60).status_code == 200
