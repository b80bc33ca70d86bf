"""Penalties and biases end to end: greedy answers under ``repetition_penalty``, ``frequency_penalty``,
``presence_penalty`` and ``logit_bias`` equal transformers' ``generate`` with the same processors in the
sampler's order (tests/e2e/sampling_oracle.py), on LLaVA and Qwen2.5-VL with an image, also in 128-token
steps through the image and after a preemption; a seeded ``min_p`` answer keeps only tokens transformers'
``MinPLogitsWarper`` keeps (teacher-forced), on both; a token of ``stop_token_ids`` ends a greedy answer
there; token ids outside the vocabulary are refused by name."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tests.e2e.conftest import Oracle, greedy_body, make_image, user_message
from tests.e2e.metrics import delta
from tests.e2e.parity import assert_matches_greedy, taken_together
from tests.e2e.sampling_oracle import min_p_survivors, penalised_greedy, teacher_forced_logits
from tests.e2e.server import Server
from tests.e2e.test_bad_input import assert_error
from tests.e2e.test_qwen_requests import POOL_FLAGS
from tests.e2e.test_video_serving import CHUNKED
from tests.near_tie import first_divergence

pytestmark = pytest.mark.slow

FAMILIES = ["llava", "qwen2_5_vl"]
QWEN = "qwen2_5_vl"
NUM_TOKENS = 32
TEXT = "Describe the picture in a few words."
# Each changes the tiny models' greedy answer to TEXT and make_image(1313) (the oracle's differs from
# plain greedy: checked); frequency 0.5 lets a token repeat once at a growing cost, presence -0.5 in the
# mix rewards a first repeat that frequency then outweighs.
PENALTIES: dict[str, dict[str, Any]] = {
    "repetition": {"repetition_penalty": 1.3},
    "frequency": {"frequency_penalty": 0.5},
    "presence": {"presence_penalty": 1.5},
    "all_three": {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": -0.5},
}
# the served logprobs are of the raw logits; two fp32 computations of them agree far closer than this
RAW_LOGPROB_TOLERANCE = 1e-3


def ask(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def penalised_body(family: str, image: Any, params: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    return greedy_body(
        [user_message(TEXT, image)],
        max_tokens,
        model=f"tiny-{family}",
        logprobs=True,
        top_logprobs=2,
        **params,
    )


@pytest.fixture(scope="module")
def plain_greedy(family_oracle: Callable[[str], Oracle]) -> Callable[[str], tuple[list[int], torch.Tensor]]:
    """``plain_greedy(family)``: the oracle's unpenalised greedy ids and logprobs for TEXT and
    make_image(1313), computed once per family."""
    answers: dict[str, tuple[list[int], torch.Tensor]] = {}

    def get(family: str) -> tuple[list[int], torch.Tensor]:
        if family not in answers:
            oracle = family_oracle(family)
            ids, logprobs, _ = penalised_greedy(
                oracle, oracle.inputs(TEXT, [make_image(1313)]), {}, NUM_TOKENS
            )
            answers[family] = ids, logprobs
        return answers[family]

    return get


def bias_params(plain_logprobs: torch.Tensor, rank: int = 5, boost: float = 8) -> dict[str, Any]:
    """-100 on the plain greedy first token and ``boost`` on its ``rank``-th runner-up there (0: the
    best): the first token changes, and the boosted one wins it and some later ones, not all."""
    ranked = plain_logprobs[0].topk(rank + 1).indices.tolist()
    return {"logit_bias": {str(ranked[0]): -100, str(ranked[rank]): boost}}


def counted_params(plain_logprobs: torch.Tensor, field: str = "frequency_penalty") -> dict[str, Any]:
    """+20 on a token makes it win until ``frequency_penalty`` 2 per occurrence outweighs that: the
    answer depends on how often it occurred, where a ``presence_penalty`` (``field``) would not."""
    return bias_params(plain_logprobs, boost=20) | {field: 2.0}


def assert_matches_penalised(
    response: dict[str, Any],
    oracle: Oracle,
    inputs: Any,
    params: dict[str, Any],
    max_tokens: int,
    plain_ids: list[int] | None = None,
) -> None:
    """The served answer is the oracle's under ``params`` but for a near-tie of its processed scores
    (tests/e2e/parity.py); its logprobs are those of the raw logits, up to where the two answers part.
    ``plain_ids``: the oracle's unpenalised answer, which its penalised one must differ from (so a server
    ignoring ``params`` fails)."""
    hf_ids, hf_logprobs, raw_logprobs = penalised_greedy(oracle, inputs, params, max_tokens)
    if plain_ids is not None:
        assert hf_ids != plain_ids, f"{params} does not change the oracle's greedy answer"
    assert response["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1]
    tokenizer = oracle.processor.tokenizer
    assert_matches_greedy(response, tokenizer, hf_ids, hf_logprobs)
    content = response["choices"][0]["logprobs"]["content"]
    served = [entry["token"] for entry in content]
    agreed = first_divergence(served, [str(tokenizer.decode([t])) for t in hf_ids])
    for pos in range(len(hf_ids) if agreed is None else agreed):
        raw = float(raw_logprobs[pos, hf_ids[pos]])
        assert abs(content[pos]["logprob"] - raw) < RAW_LOGPROB_TOLERANCE, (pos, content[pos], raw)


@pytest.mark.parametrize("case", [*PENALTIES, "logit_bias", "logit_bias_and_repetition", "counted_frequency"])
@pytest.mark.parametrize("family", FAMILIES)
def test_penalised_greedy_equals_generate(
    family: str,
    case: str,
    family_server: Callable[..., Server],
    family_oracle: Callable[[str], Oracle],
    plain_greedy: Callable[[str], tuple[list[int], torch.Tensor]],
) -> None:
    """The bias with the repetition penalty pins their order: a biased positive logit is divided after
    the bias is added (the oracle with the two the other way round answers otherwise: checked). A
    counted frequency pins the count: the same penalty once per id answers otherwise (checked)."""
    oracle, image = family_oracle(family), make_image(1313)
    inputs = oracle.inputs(TEXT, [image])
    plain_ids, plain_logprobs = plain_greedy(family)
    if case == "logit_bias":
        params = bias_params(plain_logprobs)
    elif case == "logit_bias_and_repetition":
        params = bias_params(plain_logprobs, rank=3, boost=12) | PENALTIES["repetition"]
        in_order, _, _ = penalised_greedy(oracle, inputs, params, NUM_TOKENS)
        assert in_order != penalised_greedy(oracle, inputs, params, NUM_TOKENS, reverse=True)[0]
    elif case == "counted_frequency":
        params, once = counted_params(plain_logprobs), counted_params(plain_logprobs, "presence_penalty")
        counted, _, _ = penalised_greedy(oracle, inputs, params, NUM_TOKENS)
        assert counted != penalised_greedy(oracle, inputs, once, NUM_TOKENS)[0]
    else:
        params = PENALTIES[case]
    response = ask(family_server(family), penalised_body(family, image, params, NUM_TOKENS))
    assert_matches_penalised(response, oracle, inputs, params, NUM_TOKENS, plain_ids)


def test_penalties_in_128_token_steps_through_the_image_equal_generate(
    family_server: Callable[..., Server],
    family_oracle: Callable[[str], Oracle],
    plain_greedy: Callable[[str], tuple[list[int], torch.Tensor]],
) -> None:
    """Prefill chunks that end inside the image leave the penalties' prompt ids as they are."""
    oracle, image = family_oracle(QWEN), make_image(1301, (640, 544))
    inputs = oracle.inputs(TEXT, [image])
    params = PENALTIES["all_three"] | bias_params(plain_greedy(QWEN)[1])
    server = family_server(QWEN, *CHUNKED)
    before = server.metrics()
    response = ask(server, penalised_body(QWEN, image, params, NUM_TOKENS))
    after = server.metrics()
    usage = response["usage"]
    num_computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    assert num_computed > 3 * 128  # the image alone is more than three steps
    steps = delta(before, after, "mmserve_num_batched_tokens_per_step_count")
    assert steps >= math.ceil(num_computed / 128) + NUM_TOKENS - 1
    assert delta(before, after, "mmserve_num_batched_tokens_per_step_sum") == num_computed + NUM_TOKENS - 1
    assert_matches_penalised(response, oracle, inputs, params, NUM_TOKENS)


def test_preempted_penalised_requests_resume_exactly(
    family_server: Callable[..., Server],
    family_oracle: Callable[[str], Oracle],
    plain_greedy: Callable[[str], tuple[list[int], torch.Tensor]],
) -> None:
    """Three penalised image requests (488 prompt tokens, 437 of them the image's) with 64-token answers
    on a 1,024-token KV pool: no two fit to their ends at once, so one is preempted and recomputed, and
    every answer still equals generate's: the penalties still count the outputs it had (one request's
    answer depends on how often a token occurred)."""
    num_tokens = 64
    oracle, server = family_oracle(QWEN), family_server(QWEN, *POOL_FLAGS)
    images = [make_image(1310 + i, (640, 544)) for i in range(3)]
    cases = [PENALTIES["repetition"], counted_params(plain_greedy(QWEN)[1]), PENALTIES["all_three"]]
    bodies = [
        penalised_body(QWEN, image, params, num_tokens) for image, params in zip(images, cases, strict=True)
    ]
    before = server.metrics()
    responses = taken_together(server, bodies)
    after = server.metrics()
    assert delta(before, after, "mmserve_num_preemptions_total") > 0
    for response, image, params in zip(responses, images, cases, strict=True):
        assert_matches_penalised(response, oracle, oracle.inputs(TEXT, [image]), params, num_tokens)


def token_ids(response: dict[str, Any], tokenizer: Any) -> list[int]:
    """The served token ids, from each logprobs entry's ``bytes`` (unique in a byte-level BPE
    vocabulary; a token's text is not: every lone byte above 0x7f reads as U+FFFD)."""
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}

    def token_bytes(token_id: int) -> tuple[int, ...]:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if token_id in tokenizer.added_tokens_decoder or not all(char in byte_of for char in piece):
            return tuple(tokenizer.decode([token_id]).encode())
        return tuple(byte_of[char] for char in piece)

    ids_by_bytes = {token_bytes(token_id): token_id for token_id in range(len(tokenizer))}
    return [ids_by_bytes[tuple(entry["bytes"])] for entry in response["choices"][0]["logprobs"]["content"]]


@pytest.mark.parametrize("family", FAMILIES)
def test_min_p_keeps_only_what_transformers_keeps(
    family: str, family_server: Callable[..., Server], family_oracle: Callable[[str], Oracle]
) -> None:
    """A seeded answer at temperature 1 with min_p 0.3, fed back through the model: every token survives
    ``MinPLogitsWarper`` at its position, and its served logprob is the raw one there. The same request
    again gives the same answer; without min_p the same seed samples a token min_p drops."""
    min_p, oracle, image, server = 0.3, family_oracle(family), make_image(1320), family_server(family)
    inputs = oracle.inputs(TEXT, [image])
    body = greedy_body(
        [user_message(TEXT, image)],
        NUM_TOKENS,
        model=f"tiny-{family}",
        temperature=1.0,
        seed=1234,
        logprobs=True,
        min_p=min_p,
    )
    response = ask(server, body)
    assert ask(server, body)["choices"][0]["message"] == response["choices"][0]["message"]

    tokenizer = oracle.processor.tokenizer
    served = token_ids(response, tokenizer)
    logits = teacher_forced_logits(oracle, inputs, served)
    logprobs = torch.log_softmax(logits, dim=-1)
    for pos, entry in enumerate(response["choices"][0]["logprobs"]["content"]):
        assert abs(entry["logprob"] - float(logprobs[pos, served[pos]])) < RAW_LOGPROB_TOLERANCE, (pos, entry)
    kept = min_p_survivors(logits, 1.0, min_p)
    below = [
        (pos, float(logprobs[pos, t] - logprobs[pos].max() - math.log(min_p)))
        for pos, t in enumerate(served)
        if not kept[pos, t]
    ]
    assert not below, f"served tokens min_p drops (position, log-margin under the threshold): {below}"

    unfiltered = ask(server, {**body, "min_p": 0.0})
    unfiltered_ids = token_ids(unfiltered, tokenizer)
    unfiltered_kept = min_p_survivors(teacher_forced_logits(oracle, inputs, unfiltered_ids), 1.0, min_p)
    assert not all(unfiltered_kept[pos, t] for pos, t in enumerate(unfiltered_ids)), (
        "the seed samples nothing min_p would drop: the check above could not fail"
    )


@pytest.fixture(scope="module")
def stop_case(
    server: Server, family_oracle: Callable[[str], Oracle]
) -> tuple[dict[str, Any], list[int], int]:
    """A greedy LLaVA request (EOS ignored), its answer's token ids, and a position k >= 4 whose token
    occurs there first: that token in ``stop_token_ids`` must end the answer at k."""
    body = greedy_body([user_message(TEXT, make_image(1330))], 16, logprobs=True)
    plain_ids = token_ids(ask(server, body), family_oracle("llava").processor.tokenizer)
    first_at = next(pos for pos in range(4, len(plain_ids)) if plain_ids[pos] not in plain_ids[:pos])
    return body, plain_ids, first_at


def test_a_stop_token_id_ends_the_answer_at_that_token(
    server: Server,
    family_oracle: Callable[[str], Oracle],
    stop_case: tuple[dict[str, Any], list[int], int],
) -> None:
    """With the plain answer's k-th token in ``stop_token_ids`` the answer is its first k + 1 tokens,
    ``finish_reason`` "stop", whether EOS is ignored or not: the stop token is generated, counted in
    ``completion_tokens`` and has its logprobs entry (as vLLM counts it); with
    ``include_stop_str_in_output`` its text ends the content."""
    body, plain_ids, k = stop_case
    tokenizer = family_oracle("llava").processor.tokenizer
    stop = {"stop_token_ids": [plain_ids[k]]}
    for extra in ({}, {"ignore_eos": False}, {"include_stop_str_in_output": True}):
        response = ask(server, {**body, **stop, **extra})
        choice = response["choices"][0]
        assert choice["finish_reason"] == "stop", (extra, choice)
        assert response["usage"]["completion_tokens"] == k + 1, extra
        assert token_ids(response, tokenizer) == plain_ids[: k + 1], extra
        assert choice["message"]["content"].startswith(str(tokenizer.decode(plain_ids[:k]))), extra
    assert choice["message"]["content"] == tokenizer.decode(plain_ids[: k + 1])


def test_a_stop_tokens_text_is_left_out_of_the_content(
    server: Server,
    family_oracle: Callable[[str], Oracle],
    stop_case: tuple[dict[str, Any], list[int], int],
) -> None:
    """As vLLM (the stop token ends the answer "as EOS does", and EOS is never text): the content is
    the text of the tokens before the stop token, which ``include_stop_str_in_output`` (default false)
    would keep."""
    body, plain_ids, k = stop_case
    response = ask(server, {**body, "stop_token_ids": [plain_ids[k]]})
    tokenizer = family_oracle("llava").processor.tokenizer
    assert response["choices"][0]["message"]["content"] == tokenizer.decode(plain_ids[:k])


# each field naming one token id, as a request spells it
TOKEN_ID_FIELDS: dict[str, Callable[[int], Any]] = {
    "logit_bias": lambda token_id: {str(token_id): 1.0},
    "allowed_token_ids": lambda token_id: [0, token_id],
    "stop_token_ids": lambda token_id: [token_id],
}


@pytest.mark.parametrize("field", list(TOKEN_ID_FIELDS))
def test_a_token_id_past_the_vocabulary_is_refused_by_name(
    field: str, server: Server, family_oracle: Callable[[str], Oracle]
) -> None:
    """The first id past the end is a 400 whose ``param`` is the field; the last one is served."""
    vocab_size = family_oracle("llava").model.get_output_embeddings().weight.shape[0]
    body = greedy_body([user_message("Hi.")], 1)
    url = f"{server.base_url}/v1/chat/completions"
    error = assert_error(
        httpx.post(url, json={**body, field: TOKEN_ID_FIELDS[field](vocab_size)}, timeout=60),
        400,
        code="invalid_value",  # as a negative id is
        param=field,
    )
    assert str(vocab_size) in error["message"]
    last = httpx.post(url, json={**body, field: TOKEN_ID_FIELDS[field](vocab_size - 1)}, timeout=60)
    assert last.status_code == 200, last.text
