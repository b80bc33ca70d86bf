"""Encoder / LM disaggregation through ``mmserve proxy``: an encoder-only instance encodes each image
and saves it; the LM instance loads it by mm_hash instead of encoding. The answer equals a single
server's, token for token, for one and two images, on LLaVA and on Qwen3-VL (whose outputs carry
deepstack levels); the LM instance's encoder never runs for what the encoder instance produced.
An LM-only instance (no vision tower) answers an image nobody encoded with a clear 503; a salted
request is encoded under its salt."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import greedy_body, make_image, user_message
from tests.e2e.metrics import delta
from tests.e2e.server import Server, start_all, start_proxy, stop_all
from tests.video_clips import make_clip

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


@dataclass
class Split:
    single: Server  # an ordinary server with the defaults: the reference answer
    encoder: Server
    lm: Server
    lm_only: Server  # --language-model-only: no vision tower at all
    proxy: Server
    proxy_lm_only: Server
    model_name: str


@pytest.fixture(scope="module", params=["llava", "qwen3_vl"])
def split(
    request: pytest.FixtureRequest,
    tiny_model: Callable[[str], Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Split]:
    """The module's own servers, no session server: so the module runs whole in whichever pytest-xdist
    worker is free, beside the one that holds the session's servers (tests/conftest.py)."""
    family = request.param
    model_dir = tiny_model(family)
    store = tmp_path_factory.mktemp(f"ec-{family}")
    logs = tmp_path_factory.mktemp(f"epd-{family}")
    ec = ("--ec-connector", "shared-storage", "--ec-storage-path", str(store))
    servers = start_all(
        model_dir,
        logs,
        (*ec, "--ec-role", "producer", "--encoder-only"),
        (*ec, "--ec-role", "consumer"),
        (*ec, "--ec-role", "consumer", "--language-model-only"),
        (),
    )
    proxies: list[Server] = []
    try:
        encoder, lm, lm_only, single = servers
        proxies.append(start_proxy(logs, encoder.base_url, lm.base_url))
        proxies.append(start_proxy(logs, encoder.base_url, lm_only.base_url))
        yield Split(single, encoder, lm, lm_only, proxies[0], proxies[1], model_dir.name)
    finally:
        for proxy in proxies:
            proxy.process.interrupt()
        stop_all(servers)


def body(split: Split, text: str, *seeds: int, **extra: Any) -> dict[str, Any]:
    images = [make_image(seed) for seed in seeds]
    return {**greedy_body([user_message(text, *images)], MAX_TOKENS, **extra), "model": split.model_name}


def answer(server: Server, payload: dict[str, Any]) -> str:
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=180)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("seeds", [(800,), (801, 802)], ids=["one-image", "two-images"])
def test_through_the_proxy_the_answer_is_a_single_servers(split: Split, seeds: tuple[int, ...]) -> None:
    payload = body(split, "What is shown?", *seeds)
    lm_before, enc_before = split.lm.metrics(), split.encoder.metrics()
    assert answer(split.proxy, payload) == answer(split.single, payload)
    lm_after, enc_after = split.lm.metrics(), split.encoder.metrics()
    assert delta(enc_before, enc_after, "mmserve_encoder_runs_total") == len(seeds)
    assert delta(enc_before, enc_after, "mmserve_ec_saves_total") == len(seeds)
    assert delta(lm_before, lm_after, "mmserve_encoder_runs_total") == 0, "the LM instance encoded"
    assert delta(lm_before, lm_after, "mmserve_ec_loads_total") == len(seeds)
    assert delta(lm_before, lm_after, "mmserve_ec_load_failures_total") == 0


def test_a_constrained_answer_through_the_proxy_is_a_single_servers(split: Split) -> None:
    """The LM instance gets the constraint with the request (the encoder instance only the image)."""
    record = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
    }
    structured = {"json": record, "disable_any_whitespace": True}
    payload = {
        **body(split, "As a record?", 809, ignore_eos=False, structured_outputs=structured),
        "max_tokens": 48,
    }
    through_proxy = answer(split.proxy, payload)
    assert through_proxy == answer(split.single, payload)
    assert isinstance(json.loads(through_proxy)["n"], int)
    assert streamed_text(split.proxy, {**payload, "stream": True}) == through_proxy  # forced tokens too


def test_a_salted_request_is_encoded_under_its_salt(split: Split) -> None:
    """The encoder instance encodes under the request's ``cache_salt``, so the LM-only instance (no
    vision tower) finds that salt's output; the same image under another salt is encoded again."""
    for salt in ("tenant-a", "tenant-b"):
        payload = body(split, "Salted?", 807, cache_salt=salt)
        enc_before = split.encoder.metrics()
        assert answer(split.proxy_lm_only, payload) == answer(split.single, payload)
        assert delta(enc_before, split.encoder.metrics(), "mmserve_encoder_runs_total") == 1


def test_a_video_through_the_proxy_is_encoded_by_the_encoder_instance(split: Split) -> None:
    """The proxy sends a video to an encoder as it sends an image, so the LM-only instance finds its
    output (without it every video through the proxy was that instance's 503)."""
    if split.model_name == "tiny-llava":
        pytest.skip("LLaVA-1.5 takes no video")
    clip = base64.b64encode(make_clip(num_frames=8, fps=4, seed=812)).decode()
    video = {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{clip}"}}
    content = [video, {"type": "text", "text": "What happens?"}]
    payload = {**greedy_body([{"role": "user", "content": content}], MAX_TOKENS), "model": split.model_name}
    enc_before = split.encoder.metrics()
    assert answer(split.proxy_lm_only, payload) == answer(split.single, payload)
    assert delta(enc_before, split.encoder.metrics(), "mmserve_encoder_runs_total") == 1


def streamed_text(server: Server, payload: dict[str, Any]) -> str:
    """The content deltas of a streamed answer, joined."""
    text = ""
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=payload, timeout=180) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    return text


def test_streamed_through_the_proxy(split: Split) -> None:
    payload = body(split, "Stream it.", 803, stream=True)
    assert streamed_text(split.proxy, payload) == answer(split.single, {**payload, "stream": False})


def test_an_encoded_image_needs_no_encoder_again(split: Split) -> None:
    """The encoder instance answers a repeated image from its encoder cache (or the store)."""
    payload = body(split, "Again?", 804)
    answer(split.proxy, payload)
    enc_before = split.encoder.metrics()
    assert answer(split.proxy, body(split, "Something else about it?", 804)) == answer(
        split.single, body(split, "Something else about it?", 804)
    )
    assert delta(enc_before, split.encoder.metrics(), "mmserve_encoder_runs_total") == 0


def test_lm_only_serves_what_the_encoder_saved_and_503s_the_rest(split: Split) -> None:
    payload = body(split, "Without a vision tower?", 805)
    assert answer(split.proxy_lm_only, payload) == answer(split.single, payload)
    # sent to the LM-only instance directly, an image nobody encoded cannot be served
    resp = httpx.post(
        f"{split.lm_only.base_url}/v1/chat/completions", json=body(split, "Unknown?", 806), timeout=60
    )
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "encoder_output_unavailable"
    # and it keeps serving
    assert answer(split.proxy_lm_only, body(split, "Still fine?", 805)) == answer(
        split.single, body(split, "Still fine?", 805)
    )
