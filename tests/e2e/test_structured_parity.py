"""Constrained greedy answers equal transformers' ``generate`` with xgrammar's HF logits processor on the
same grammar (tests/e2e/structured_oracle.py), on every family with an image (and a video on the Qwen
families): cold, warm from every cache (the compiled grammar included), in 128-token steps that cut
through the image, and after a preemption. Each answer that ends parses and validates."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.e2e.conftest import Oracle, greedy_body, make_image, user_message
from tests.e2e.metrics import delta
from tests.e2e.parity import taken_together
from tests.e2e.server import Server, serving
from tests.e2e.structured_oracle import (
    assert_matches_constrained,
    compile_grammar,
    constrained_greedy,
    served_tokens_are_the_oracles,
)
from tests.e2e.test_qwen_requests import POOL_FLAGS
from tests.e2e.test_video_serving import CHUNKED, CLIP_A, IMAGE
from tests.e2e.video_oracle import Case, Expected, body, expected_answers

pytestmark = pytest.mark.slow

FAMILIES = ["llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
QWEN_FAMILIES = FAMILIES[1:]
MAX_TOKENS = 64
# bounded strings and numbers: the tiny models' answers end well within MAX_TOKENS
RECORD = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 50},
        "ok": {"type": "boolean"},
    },
    "required": ["label", "count", "ok"],
    "additionalProperties": False,
}
COMPACT = {"json": RECORD, "disable_any_whitespace": True}
TEXT = "Describe the picture as a record."


@pytest.fixture(scope="module")
def llava_chunked(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """128-token steps; response_format's JSON with free whitespace (vLLM's default) instead of compact."""
    folder = tmp_path_factory.mktemp("structured-chunked")
    with serving(tiny_model_dir, folder, *CHUNKED, "--response-format-whitespace", "any") as srv:
        yield srv


def constrained_body(
    family: str, media: list[Any], structured: dict[str, Any], max_tokens: int
) -> dict[str, Any]:
    return greedy_body(
        [user_message(TEXT, *media)],
        max_tokens,
        model=f"tiny-{family}",
        ignore_eos=False,
        logprobs=True,
        top_logprobs=2,
        structured_outputs=structured,
    )


def ask(server: Server, payload: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=300)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def validated(response: dict[str, Any], schema: dict[str, Any]) -> Any:
    choice = response["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(choice["message"]["content"])
    jsonschema.validate(value, schema)
    return value


def is_compact(text: str) -> bool:
    """JSON with no whitespace outside strings but the one space of the separators ", " and ": "."""
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    return re.sub(r"([,:]) ", r"\1", outside) == "".join(outside.split()) != ""


@pytest.mark.parametrize("family", FAMILIES)
def test_a_json_schema_answer_equals_generate_cold_warm_and_in_128_token_steps(
    family: str,
    family_server: Callable[..., Server],
    family_oracle: Callable[[str], Oracle],
    request: pytest.FixtureRequest,
) -> None:
    oracle, image = family_oracle(family), make_image(950, (320, 240))
    hf_ids, hf_logprobs = constrained_greedy(
        oracle, oracle.inputs(TEXT, [image]), compile_grammar(oracle, COMPACT), MAX_TOKENS
    )
    server = family_server(family)
    cold = ask(server, constrained_body(family, [image], COMPACT, MAX_TOKENS))
    assert_matches_constrained(cold, oracle, hf_ids, hf_logprobs)
    validated(cold, RECORD)

    # Without logprobs, the tokens the grammar forces (its only allowed one) are appended unsampled and
    # computed with the next step as one span: the same answer (where the sampled one had no near-tie).
    # Asked as OpenAI's response_format, whose JSON is compact by default: the same grammar.
    before = server.metrics()
    unsampled = {
        k: v for k, v in constrained_body(family, [image], COMPACT, MAX_TOKENS).items() if "logprobs" not in k
    }
    del unsampled["structured_outputs"]
    unsampled["response_format"] = {"type": "json_schema", "json_schema": {"name": "r", "schema": RECORD}}
    forced = ask(server, unsampled)
    assert delta(before, server.metrics(), "mmserve_structured_output_forced_tokens_total") > 0
    validated(forced, RECORD)
    assert is_compact(forced["choices"][0]["message"]["content"])
    if served_tokens_are_the_oracles(cold, oracle, hf_ids, hf_logprobs):
        assert forced["choices"][0]["message"] == cold["choices"][0]["message"]
        assert forced["usage"]["completion_tokens"] == cold["usage"]["completion_tokens"]

    before = server.metrics()
    warm = ask(server, constrained_body(family, [image], COMPACT, MAX_TOKENS))
    after = server.metrics()
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    assert delta(before, after, "mmserve_structured_output_cache_hits_total") == 1
    assert delta(before, after, "mmserve_structured_output_cache_misses_total") == 0
    assert delta(before, after, "mmserve_encoder_runs_total") == 0

    # the Qwen families' 128-token servers are the session's; LLaVA's is this module's (torn down with it)
    chunked = (
        request.getfixturevalue("llava_chunked") if family == "llava" else family_server(family, *CHUNKED)
    )
    before = chunked.metrics()
    in_steps = ask(chunked, constrained_body(family, [image], COMPACT, MAX_TOKENS))
    after = chunked.metrics()
    assert_matches_constrained(in_steps, oracle, hf_ids, hf_logprobs)
    assert delta(before, after, 'mmserve_num_batched_tokens_per_step_bucket{le="256.0"}') == delta(
        before, after, "mmserve_num_batched_tokens_per_step_count"
    )  # no step above 128 tokens: the prefill ran in chunks


def test_free_whitespace_is_bounded_as_documented(
    server: Server, oracle: Oracle, llava_chunked: Server
) -> None:
    """structured_outputs' default JSON whitespace (any, at most JSON_MAX_WHITESPACE characters per gap)
    is the one the oracle compiles: the same answer, token for token; and response_format's, on a server
    started with ``--response-format-whitespace any``."""
    structured = {"json": RECORD}
    image = make_image(951)
    hf_ids, hf_logprobs = constrained_greedy(
        oracle, oracle.inputs(TEXT, [image]), compile_grammar(oracle, structured), 192
    )
    response = ask(server, constrained_body("llava", [image], structured, 192))
    assert_matches_constrained(response, oracle, hf_ids, hf_logprobs)
    assert not is_compact(response["choices"][0]["message"]["content"])  # the model takes the freedom

    spaced = constrained_body("llava", [image], structured, 192)
    del spaced["structured_outputs"]
    spaced["response_format"] = {"type": "json_schema", "json_schema": {"name": "r", "schema": RECORD}}
    assert_matches_constrained(ask(llava_chunked, spaced), oracle, hf_ids, hf_logprobs)


VIDEO_CASES = {
    "clip": Case("Describe the clip as a record.", (CLIP_A,), {"fps": 2}),
    "clip_and_image": Case("Describe both as a record.", (IMAGE, CLIP_A), {"fps": 1}),
}


@pytest.fixture(scope="module")
def video_expected(
    tiny_model: Callable[[str], Path], family_oracle: Callable[[str], Oracle]
) -> dict[tuple[str, str], Expected]:
    def generate(oracle: Oracle, inputs: Any, max_new_tokens: int) -> tuple[list[int], Any]:
        return constrained_greedy(oracle, inputs, compile_grammar(oracle, COMPACT), max_new_tokens)

    cases = {(f, name): (f, case) for f in QWEN_FAMILIES for name, case in VIDEO_CASES.items()}
    return expected_answers(cases, tiny_model, family_oracle, MAX_TOKENS, generate=generate)


@pytest.mark.parametrize("name", list(VIDEO_CASES))
@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_a_video_answer_equals_generate(
    family: str,
    name: str,
    video_expected: dict[tuple[str, str], Expected],
    family_server: Callable[..., Server],
    family_oracle: Callable[[str], Oracle],
) -> None:
    want = video_expected[family, name]
    payload = body(VIDEO_CASES[name], family, n=MAX_TOKENS, ignore_eos=False, structured_outputs=COMPACT)
    response = ask(family_server(family), payload)
    assert response["usage"]["prompt_tokens"] == want.num_prompt_tokens
    assert_matches_constrained(response, family_oracle(family), want.ids, want.logprobs)


def test_preempted_constrained_requests_resume_exactly(
    family_server: Callable[..., Server], family_oracle: Callable[[str], Oracle]
) -> None:
    """Three image requests (485 prompt tokens) with answers of 50 tokens or more on a 1,024-token KV
    pool: no two fit to their ends at once, so one is preempted and recomputed; its matcher followed it,
    and every answer equals generate's. Each is sent twice at once, the twin without logprobs: its
    forced tokens (the JSON around the story) go through preemption too, to the same answer."""
    family = "qwen2_5_vl"
    long_text = {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": 200, "maxLength": 200}},
        "required": ["story"],
    }
    structured = {"json": long_text, "disable_any_whitespace": True}
    server, oracle = family_server(family, *POOL_FLAGS), family_oracle(family)
    images = [make_image(960 + i, (640, 544)) for i in range(3)]
    payloads = [constrained_body(family, [image], structured, 200) for image in images]
    twins = [{k: v for k, v in body.items() if "logprobs" not in k} for body in payloads]
    before = server.metrics()
    answered = taken_together(server, [*payloads, *twins])
    after = server.metrics()
    assert delta(before, after, "mmserve_num_preemptions_total") > 0
    assert delta(before, after, "mmserve_structured_output_forced_tokens_total") > 0
    grammar = compile_grammar(oracle, structured)
    for response, twin, image in zip(answered[:3], answered[3:], images, strict=True):
        hf_ids, hf_logprobs = constrained_greedy(oracle, oracle.inputs(TEXT, [image]), grammar, 200)
        assert_matches_constrained(response, oracle, hf_ids, hf_logprobs)
        validated(response, long_text)
        validated(twin, long_text)
        if served_tokens_are_the_oracles(response, oracle, hf_ids, hf_logprobs):
            assert twin["choices"][0]["message"] == response["choices"][0]["message"]
