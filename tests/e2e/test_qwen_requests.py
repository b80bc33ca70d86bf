"""Qwen3-VL end to end, per request: preemption on a tiny KV pool still equals ``generate``; a request's
``mm_processor_kwargs`` resolution reaches the processor and is part of mm_hash (the same image at two
resolutions is two cache entries, never one); options the family does not accept, resolutions it cannot
process and items above an explicit budget get a 400 naming the part, and the server keeps serving."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Oracle, greedy_body, make_image, user_message
from tests.e2e.metrics import delta
from tests.e2e.parity import (
    assert_matches_greedy,
    assert_matches_oracle,
    concurrent_greedy_requests,
    greedy_request,
    taken_together,
)
from tests.e2e.server import Server, serving
from tests.e2e.video_oracle import Case, Expected, body, expected_answers
from tests.video_clips import make_clip

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3_vl"
FACTOR = 32  # Qwen3-VL: patch 16 x spatial merge 2 pixels per placeholder side


@pytest.fixture(scope="module")
def model_dir(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("qwen3_vl")


@pytest.fixture(scope="module")
def qwen_oracle(model_dir: Path) -> Oracle:
    return Oracle.load(model_dir)


# A 1,024-token KV pool, and an explicit encoder budget of 600 (below the largest item).
POOL_FLAGS = (
    "--kv-cache-tokens", "1024", "--block-size", "16", "--max-num-batched-tokens", "256",
    "--encoder-compute-budget-tokens", "600",
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_pool_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(model_dir, tmp_path_factory.mktemp("qwen-pool"), *POOL_FLAGS) as srv:
        yield srv


def post(server: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)


def test_preempted_qwen_requests_resume_exactly(tiny_pool_server: Server, qwen_oracle: Oracle) -> None:
    # a 640x544 image is 340 placeholders: with 32 outputs each two requests fit the pool, three do not
    cases = [(f"Preempt me {i}.", [make_image(830 + i, (640, 544))]) for i in range(3)]

    before = tiny_pool_server.metrics()
    responses = concurrent_greedy_requests(tiny_pool_server, cases, model=MODEL)
    after = tiny_pool_server.metrics()
    assert delta(before, after, "mmserve_num_preemptions_total") > 0
    for response, (text, images) in zip(responses, cases, strict=True):
        assert_matches_oracle(response, qwen_oracle, text, images)


def test_resolution_per_request_is_its_own_cache_entry(tiny_pool_server: Server) -> None:
    image = make_image(840, (640, 480))
    low = {"mm_processor_kwargs": {"max_pixels": 8 * 8 * FACTOR * FACTOR}}  # at most 64 placeholders

    def ask(**extra: Any) -> dict[str, Any]:
        return greedy_request(tiny_pool_server, "Which resolution?", [image], n=2, model=MODEL, **extra)

    before = tiny_pool_server.metrics()
    full, reduced = ask(), ask(**low)
    after = tiny_pool_server.metrics()
    assert full["usage"]["prompt_tokens"] - reduced["usage"]["prompt_tokens"] == 300 - 54  # 15x20 vs 6x9
    assert delta(before, after, "mmserve_mm_processor_cache_hits_total") == 0  # two entries, not one
    assert delta(before, after, "mmserve_encoder_runs_total") == 2
    # asked again, each resolution hits its own entry, also spelled as size (transformers 5's spelling)
    size = {
        "mm_processor_kwargs": {"size": {"shortest_edge": 65536, "longest_edge": 8 * 8 * FACTOR * FACTOR}}
    }
    again = tiny_pool_server.metrics()
    assert ask(**size)["choices"][0]["message"] == reduced["choices"][0]["message"]
    assert ask()["choices"][0]["message"] == full["choices"][0]["message"]
    assert delta(again, tiny_pool_server.metrics(), "mmserve_mm_processor_cache_hits_total") == 2


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"merge_size": 1}, "Unsupported mm_processor_kwargs"),  # must match the weights
        ({"min_pixels": 200_000, "max_pixels": 100_000}, "min_pixels <= max_pixels"),
        ({"max_pixels": 1 << 40}, "max_pixels"),
        ({"max_pixels": "big"}, "mm_processor_kwargs"),
        # pixels of no number: the model would answer NaN (a 500 with logprobs, garbage without)
        ({"image_std": [0.0, 0.0, 0.0]}, "not finite numbers"),
        ({"image_mean": [1e308, 0.0, 0.0]}, "not finite numbers"),
    ],
)
def test_options_the_family_does_not_accept(
    tiny_pool_server: Server, kwargs: dict[str, Any], fragment: str
) -> None:
    body = greedy_body(
        [user_message("Bad options.", make_image(850))], 2, model=MODEL, mm_processor_kwargs=kwargs
    )
    resp = post(tiny_pool_server, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "mm_processor_kwargs" and fragment in error["message"], error
    assert error["code"] == "invalid_mm_processor_kwargs", error


def test_resolution_the_family_cannot_process(tiny_pool_server: Server) -> None:
    sliver = make_image(851, (2000, 8))  # aspect ratio 250 > Qwen's 200
    resp = post(tiny_pool_server, greedy_body([user_message("Thin.", sliver)], 2, model=MODEL))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "messages[0].content[0].image_url.url"


def test_item_above_the_explicit_budget_is_refused_and_nothing_is_disturbed(
    tiny_pool_server: Server, qwen_oracle: Oracle
) -> None:
    text, images = "Small one.", [make_image(852, (224, 224))]
    first = greedy_request(tiny_pool_server, text, images, model=MODEL)
    big = greedy_body(
        [user_message("Too big.", make_image(853, (800, 800)))], 2, model=MODEL
    )  # 625 tokens > 600
    resp = post(tiny_pool_server, big)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["code"] == "mm_item_too_large" and "--encoder-compute-budget-tokens" in error["message"]
    before = tiny_pool_server.metrics()
    again = greedy_request(tiny_pool_server, text, images, model=MODEL)
    after = tiny_pool_server.metrics()
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    assert delta(before, after, "mmserve_encoder_runs_total") == 0  # every cache still holds it
    assert delta(before, after, "mmserve_mm_ipc_cache_hits_total") == 1
    assert_matches_oracle(again, qwen_oracle, text, images)


def test_a_video_above_the_explicit_budget_is_refused_at_once(tiny_pool_server: Server) -> None:
    """16 frames of 320x240: 8 groups of 80 placeholders, 640 > 600; refused before it is queued."""
    clip = make_clip(width=320, height=240, fps=8, num_frames=16, seed=9)
    start = time.monotonic()
    resp = post(tiny_pool_server, body(Case("Too long.", (clip,), {"num_frames": 16}), "qwen3_vl", n=2))
    assert time.monotonic() - start < 10
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "mm_item_too_large"
    assert "A video" in error["message"] and "--encoder-compute-budget-tokens" in error["message"]
    assert "640" in error["message"]
    assert tiny_pool_server.metrics()["mmserve_num_requests_waiting"] == 0


PREEMPTED_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
PREEMPTED_TOKENS = 64


@functools.cache
def preempted_case(family: str, i: int) -> Case:
    height = 320 if family == "qwen3_vl" else 280  # patch 16 / 14: 400 and 440 placeholders
    clip = make_clip(width=320, height=height, fps=8, num_frames=8, seed=20 + i)
    return Case(f"Preempt the clip {i}.", (clip,), {"num_frames": 8})


@pytest.fixture(scope="module")
def preempted_expected(
    tiny_model: Callable[[str], Path], family_oracle: Callable[[str], Oracle]
) -> dict[tuple[str, int], Expected]:
    """Every family's answers to the three clips (two batched reference calls for all of them)."""
    cases = {(f, i): (f, preempted_case(f, i)) for f in PREEMPTED_FAMILIES for i in range(3)}
    return expected_answers(cases, tiny_model, family_oracle, max_new_tokens=PREEMPTED_TOKENS)


@pytest.mark.parametrize("family", PREEMPTED_FAMILIES)
def test_preempted_video_requests_resume_exactly(
    family: str,
    tiny_pool_server: Server,
    family_server: Callable[..., Server],
    preempted_expected: dict[tuple[str, int], Expected],
    family_oracle: Callable[[str], Oracle],
) -> None:
    """Three clips of 4 frame groups (about 460 prompt tokens each, with 64 outputs) on a 1,024-token KV
    pool: no two fit to their end at once, so whichever two run together, one is preempted; each answer
    equals ``generate``'s."""
    server = tiny_pool_server if family == "qwen3_vl" else family_server(family, *POOL_FLAGS)
    cases = [preempted_case(family, i) for i in range(3)]
    before = server.metrics()
    responses = taken_together(server, [body(case, family, n=PREEMPTED_TOKENS) for case in cases])
    after = server.metrics()
    assert delta(before, after, "mmserve_num_preemptions_total") > 0
    tokenizer = family_oracle(family).processor.tokenizer
    for i, response in enumerate(responses):
        want = preempted_expected[family, i]
        assert response["usage"]["prompt_tokens"] == want.num_prompt_tokens
        assert_matches_greedy(response, tokenizer, want.ids, want.logprobs)
