"""A response store's byte bound on a real server (``--responses-store-mb 1``): a response whose input
alone is over it says ``store`` false from its first streamed event to its last, and is not stored; one
within it is stored."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.e2e.server import Server, serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_store(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tiny_model_dir, tmp_path_factory.mktemp("store-1mb"), "--responses-store-mb", "1") as srv:
        yield srv


def looking_at(url: str) -> list[dict[str, Any]]:
    image = {"type": "input_image", "image_url": url}
    return [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"}, image]}]


def streamed_events(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    fields = {"model": "tiny-llava", "max_output_tokens": 3, "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json=fields, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        return [json.loads(line[5:]) for line in resp.iter_lines() if line.startswith("data:")]


def test_a_response_over_the_bound_says_so_from_its_first_event(small_store: Server) -> None:
    noise = io.BytesIO()
    Image.effect_noise((700, 700), 100).convert("RGB").save(noise, "PNG")  # ~1.4 MB: over 1 MiB
    big = "data:image/png;base64," + base64.b64encode(noise.getvalue()).decode()
    events = streamed_events(small_store, {"input": looking_at(big)})
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.incomplete"
    assert [e["response"]["store"] for e in (events[0], events[-1])] == [False, False]
    response_id = events[0]["response"]["id"]
    assert httpx.get(f"{small_store.base_url}/v1/responses/{response_id}", timeout=30).status_code == 404
    small = streamed_events(small_store, {"input": "Hello"})
    assert [e["response"]["store"] for e in (small[0], small[-1])] == [True, True]
    stored = httpx.get(f"{small_store.base_url}/v1/responses/{small[0]['response']['id']}", timeout=30)
    assert stored.status_code == 200 and stored.json()["store"] is True
