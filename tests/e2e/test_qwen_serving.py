"""Serving the dynamic-resolution families end to end (tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL): greedy output
equals transformers' ``generate`` for one image, two images of different sizes in one prompt and text only
— cold, with prefill chunks cut through images (--max-num-batched-tokens 128), and again from every
cache; usage counts the processor's tokens; a second turn reuses the first turn's KV and skips the
encoder; another image behind the same placeholders gets no image-block hits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Oracle, greedy_body, make_image, user_message
from tests.e2e.metrics import delta
from tests.e2e.parity import assert_matches_oracle, greedy_request
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
BLOCK = 16  # the default --block-size
CHUNKED = ("--max-num-batched-tokens", "128")
SMALL, LARGE = (224, 224), (1024, 768)
CASES = {
    "one": ("What is in this picture?", [make_image(800, SMALL)]),
    "two": ("Compare the two pictures.", [make_image(801, SMALL), make_image(802, LARGE)]),
    "text": ("Tell me a story about a red car in the city, please.", []),
}


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request: pytest.FixtureRequest, tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def qwen_oracle(model_dir: Path, family_oracle: Callable[[str], Oracle]) -> Oracle:
    return family_oracle(model_dir.name.removeprefix("tiny-"))


@pytest.fixture(scope="module")
def servers(model_dir: Path, family_server: Callable[..., Server]) -> dict[str, Server]:
    """Every cache on: the defaults (blocks of 16 tokens), and a 128-token step budget so prefill chunks
    cut through images; the session's servers for the family."""
    family = model_dir.name.removeprefix("tiny-")
    return {"default": family_server(family), "chunked": family_server(family, *CHUNKED)}


def name_of(model_dir: Path) -> str:
    return model_dir.name


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["default", "chunked"])
def test_greedy_equals_generate_cold_and_from_every_cache(
    servers: dict[str, Server], qwen_oracle: Oracle, model_dir: Path, case: str, kind: str
) -> None:
    server, (text, images) = servers[kind], CASES[case]
    cold = greedy_request(server, text, images, model=name_of(model_dir))
    assert_matches_oracle(cold, qwen_oracle, text, images)
    expected_prompt_tokens = qwen_oracle.inputs(text, images)["input_ids"].shape[1]
    assert cold["usage"]["prompt_tokens"] == expected_prompt_tokens

    before = server.metrics()
    warm = greedy_request(server, text, images, model=name_of(model_dir))
    after = server.metrics()
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    assert (
        warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        >= (expected_prompt_tokens - 1) // BLOCK * BLOCK
    )
    assert delta(before, after, "mmserve_encoder_runs_total") == 0
    assert delta(before, after, "mmserve_mm_ipc_cache_hits_total") == len(images)
    assert delta(before, after, "mmserve_mm_processor_cache_hits_total") == len(images)


def test_two_images_of_different_sizes_take_their_own_token_counts(
    servers: dict[str, Server], model_dir: Path
) -> None:
    text, images = CASES["two"]
    two = greedy_request(servers["default"], text, images, n=1, model=name_of(model_dir))
    small = greedy_request(servers["default"], text, images[:1], n=1, model=name_of(model_dir))
    large_tokens = two["usage"]["prompt_tokens"] - small["usage"]["prompt_tokens"]
    assert large_tokens > 10 * 64  # a 1024x768 image costs far more placeholders than a thumbnail


def test_second_turn_reuses_the_first_turns_kv_and_skips_the_encoder(
    servers: dict[str, Server], model_dir: Path
) -> None:
    server, model = servers["default"], name_of(model_dir)
    turn1 = [user_message("What is this?", make_image(810, SMALL))]
    first = httpx.post(
        f"{server.base_url}/v1/chat/completions", json=greedy_body(turn1, 12, model=model), timeout=120
    )
    assert first.status_code == 200, first.text
    answer = first.json()["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And its colour?"}]
    before = server.metrics()
    second = httpx.post(
        f"{server.base_url}/v1/chat/completions", json=greedy_body(turn2, 12, model=model), timeout=120
    )
    after = server.metrics()
    assert second.status_code == 200, second.text
    first_prompt = first.json()["usage"]["prompt_tokens"]
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= first_prompt // BLOCK * BLOCK
    assert delta(before, after, "mmserve_encoder_runs_total") == 0


def test_another_image_behind_the_same_placeholders_gets_no_image_block_hits(
    servers: dict[str, Server], model_dir: Path
) -> None:
    server, model = servers["default"], name_of(model_dir)
    first = greedy_request(server, "Same words.", [make_image(820, SMALL)], n=1, model=model)
    second = greedy_request(server, "Same words.", [make_image(821, SMALL)], n=1, model=model)
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"]  # identical token ids
    # only the blocks before the image can hit: the template's few tokens, less than one 64-token image
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] < 64


def test_usage(servers: dict[str, Server], model_dir: Path, qwen_oracle: Oracle) -> None:
    body: dict[str, Any] = greedy_body([user_message("Hi.")], 4, model=name_of(model_dir))
    resp = httpx.post(f"{servers['default'].base_url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200
    assert resp.json()["usage"]["prompt_tokens"] == qwen_oracle.inputs("Hi.", [])["input_ids"].shape[1]
