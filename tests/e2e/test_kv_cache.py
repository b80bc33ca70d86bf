"""Paged KV cache, chunked prefill through images, image-aware prefix caching and preemption, end to
end: every answer still equals transformers' ``generate``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Oracle, greedy_body, make_image, user_message
from tests.e2e.metrics import delta
from tests.e2e.parity import (
    NUM_TOKENS,
    assert_matches_oracle,
    concurrent_greedy_requests,
    greedy_request,
    taken_together,
)
from tests.e2e.server import REPO, Server, serving

pytestmark = pytest.mark.slow

BLOCK = 16
CHUNK = 100  # < 576 image tokens: chunk boundaries fall inside image ranges


@pytest.fixture(scope="module")
def chunked_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(
        tiny_model_dir,
        tmp_path_factory.mktemp("chunked"),
        "--max-model-len",
        "2048",
        "--max-num-batched-tokens",
        str(CHUNK),
        "--encoder-compute-budget-tokens",
        "1200",
        "--block-size",
        str(BLOCK),
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def tiny_pool_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A KV pool of 1024 tokens: two one-image requests (~600 prompt tokens each) cannot both fit."""
    with serving(
        tiny_model_dir,
        tmp_path_factory.mktemp("tinypool"),
        "--max-model-len",
        "4096",
        "--kv-cache-tokens",
        "1024",
        "--max-num-batched-tokens",
        "256",
        "--encoder-compute-budget-tokens",
        "1200",
        "--block-size",
        str(BLOCK),
        "--max-num-seqs",
        "32",
    ) as srv:
        yield srv


def cached_tokens(response: dict[str, Any]) -> int:
    return int(response["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_chunked_prefill_through_images_equals_generate(chunked_server: Server, oracle: Oracle) -> None:
    cases = [
        ("Chunk me.", [make_image(700)]),
        ("Two in chunks.", [make_image(701), make_image(702, (300, 500))]),
    ]
    for text, images in cases:
        before = chunked_server.metrics()
        assert_matches_oracle(greedy_request(chunked_server, text, images), oracle, text, images)
        after = chunked_server.metrics()
        # the prompt (> 576 tokens per image) really ran in chunks of at most CHUNK tokens
        steps = delta(before, after, "mmserve_num_batched_tokens_per_step_count")
        assert steps >= NUM_TOKENS + len(images) * 576 // CHUNK
        assert delta(before, after, 'mmserve_num_batched_tokens_per_step_bucket{le="256.0"}') == steps


def test_prefix_cache_hit_equals_generate_and_skips_the_encoder(
    chunked_server: Server, oracle: Oracle
) -> None:
    text = "Again, please: describe the picture in detail, with its colours, its shapes and the light."
    images = [make_image(703)]
    first = greedy_request(chunked_server, text, images)
    before = chunked_server.metrics()
    second = greedy_request(chunked_server, text, images)
    after = chunked_server.metrics()
    prompt_tokens = second["usage"]["prompt_tokens"]
    assert cached_tokens(first) < BLOCK  # at most the chat template's first tokens, never the image
    assert cached_tokens(second) == prompt_tokens - 1  # every token but the last (its logits are needed)
    assert delta(before, after, "mmserve_prefix_cache_hits_total") == cached_tokens(second)
    assert delta(before, after, "mmserve_encoder_cache_queries_total") == 0  # the image was never needed
    assert delta(before, after, "mmserve_encoder_runs_total") == 0
    assert_matches_oracle(second, oracle, text, images)


def test_same_placeholders_different_image_never_hit(chunked_server: Server, oracle: Oracle) -> None:
    text = "Same words, other picture."
    greedy_request(chunked_server, text, [make_image(704)])
    other = greedy_request(chunked_server, text, [make_image(705)])
    # Only the few text tokens before the image match (a block's first tokens): the image ends the hit.
    assert 0 < cached_tokens(other) < BLOCK
    assert_matches_oracle(other, oracle, text, [make_image(705)])


def test_two_turn_conversation_reuses_kv_and_skips_the_encoder(chunked_server: Server) -> None:
    image = make_image(706)
    turn1 = [user_message("What is this?", image)]
    first = httpx.post(
        f"{chunked_server.base_url}/v1/chat/completions", json=greedy_body(turn1, 12), timeout=120
    )
    answer = first.json()["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And its colour?"}]
    before = chunked_server.metrics()
    second = httpx.post(
        f"{chunked_server.base_url}/v1/chat/completions", json=greedy_body(turn2, 12), timeout=120
    )
    after = chunked_server.metrics()
    assert second.status_code == 200, second.text
    first_prompt = first.json()["usage"]["prompt_tokens"]
    # the whole first prompt: its last block's first tokens too (the answer's differ, re-rendered)
    assert cached_tokens(second.json()) >= first_prompt
    assert delta(before, after, "mmserve_encoder_runs_total") == 0


def test_disabled_chunked_mm_input_equals_generate(uncached_server: Server, oracle: Oracle) -> None:
    """The session's uncached server takes whole images only (WHOLE_IMAGES): two images, 1,152 tokens,
    in steps of 640."""
    text, images = "Whole images only.", [make_image(707), make_image(708)]
    assert_matches_oracle(greedy_request(uncached_server, text, images), oracle, text, images)


def test_incompatible_settings_fail_at_startup(tiny_model_dir: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.launch.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--disable-chunked-mm-input",
            "--max-num-batched-tokens",
            "256",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--disable-chunked-mm-input" in proc.stderr and "576" in proc.stderr


def test_prompt_that_can_never_fit_the_kv_pool_is_rejected(tiny_pool_server: Server) -> None:
    body = greedy_body([user_message("Too long for the pool.", make_image(709))], 600)
    resp = httpx.post(f"{tiny_pool_server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "kv_cache_exceeded"
    # a completion's batch says which prompt, in a prompt's words
    batch = {"model": "tiny-llava", "prompt": [[5] * 10, [5] * 600], "max_tokens": 600}
    resp = httpx.post(f"{tiny_pool_server.base_url}/v1/completions", json=batch, timeout=60)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["code"] == "kv_cache_exceeded" and error["param"] == "prompt[1]"
    assert "in the prompt" in error["message"] and "messages" not in error["message"]


def test_preempted_requests_resume_exactly(tiny_pool_server: Server, oracle: Oracle) -> None:
    cases = [(f"Preempt me {i}.", [make_image(710 + i)]) for i in range(3)]
    before = tiny_pool_server.metrics()
    responses = concurrent_greedy_requests(tiny_pool_server, cases)
    after = tiny_pool_server.metrics()
    assert delta(before, after, "mmserve_num_preemptions_total") > 0
    for response, (text, images) in zip(responses, cases, strict=True):
        assert_matches_oracle(response, oracle, text, images)


def test_32_concurrent_requests_on_a_tiny_pool_all_finish_correctly(tiny_pool_server: Server) -> None:
    def body(i: int) -> dict[str, Any]:
        images = [make_image(720 + i % 4)] if i % 3 else []
        return greedy_body([user_message(f"Request number {i}.", *images)], 16)

    expected = []
    for i in range(32):
        resp = httpx.post(f"{tiny_pool_server.base_url}/v1/chat/completions", json=body(i), timeout=120)
        expected.append(resp.json()["choices"][0]["message"]["content"])

    before = tiny_pool_server.metrics()
    answers = taken_together(tiny_pool_server, [body(i) for i in range(32)])
    assert [answer["choices"][0]["message"]["content"] for answer in answers] == expected
    after = tiny_pool_server.metrics()
    assert delta(before, after, "mmserve_num_preemptions_total") > 0
    assert after["mmserve_num_requests_running"] == 0 and after["mmserve_kv_cache_usage_ratio"] == 0
