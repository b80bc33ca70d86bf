"""Encoder budgets derived from the model and the per-prompt image limit, end to end on the tiny LLaVA:
a step budget below one image's tokens still serves images (in chunks, equal to ``generate``); a budget set
explicitly below the largest image is honoured with a start-up warning and a 400 naming the flag; more
images than the limit are refused before anything is fetched; the server keeps serving after each."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Oracle, greedy_body, make_image, png_bytes, user_message
from tests.e2e.held_image import held_image
from tests.e2e.metrics import delta
from tests.e2e.parity import assert_matches_oracle, greedy_request
from tests.e2e.server import Server, serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_step_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(
        tiny_model_dir,
        tmp_path_factory.mktemp("small-step"),
        "--max-num-batched-tokens",
        "128",
        "--limit-mm-per-prompt",
        "image=1",
        "--fetch-timeout-s",
        "8",
        "--allow-private-media-urls",  # a loopback image server sees whether anything was fetched
    ) as srv:
        yield srv


def post(server: Server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)


def test_a_step_budget_below_one_image_still_serves_it_in_chunks(
    small_step_server: Server, oracle: Oracle
) -> None:
    text, images = "Chunks of 128.", [make_image(900)]
    before = small_step_server.metrics()
    response = greedy_request(small_step_server, text, images)
    after = small_step_server.metrics()
    assert_matches_oracle(response, oracle, text, images)
    assert delta(before, after, "mmserve_encoder_runs_total") == 1  # encoded whole, once
    # 590 prompt tokens in steps of at most 128
    assert delta(before, after, "mmserve_num_batched_tokens_per_step_count") >= 590 // 128


def test_too_many_images_are_refused_before_anything_is_fetched(small_step_server: Server) -> None:
    before = small_step_server.metrics()
    with held_image(png_bytes(make_image(900)), hold_s=60) as (url, asked, _):
        held = {"type": "image_url", "image_url": {"url": url}}
        body = greedy_body([{"role": "user", "content": [held, held, {"type": "text", "text": "Two?"}]}], 4)
        resp = post(small_step_server, body)
        assert not asked.is_set(), "an image was fetched"
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["code"] == "mm_limit_exceeded" and "--limit-mm-per-prompt" in error["message"]
    assert delta(before, small_step_server.metrics(), "mmserve_mm_items_total") == 0
    assert (
        post(small_step_server, greedy_body([user_message("One is fine.", make_image(901))], 4)).status_code
        == 200
    )


def test_explicit_budget_below_the_largest_image_is_honoured(narrow_server: Server, oracle: Oracle) -> None:
    log = narrow_server.process.log()
    assert "--encoder-compute-budget-tokens 100 is below this model's largest image (576 tokens)" in log
    resp = post(narrow_server, greedy_body([user_message("Too big.", make_image(902))], 4))
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["code"] == "mm_item_too_large"
    assert "--encoder-compute-budget-tokens" in error["message"] and "576" in error["message"]
    text = "Text still works."
    response = greedy_request(narrow_server, text, [])
    assert_matches_oracle(response, oracle, text, [])
