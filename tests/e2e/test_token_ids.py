"""vLLM's ``return_token_ids``, ``return_tokens_as_token_ids`` and ``stream_options.continuous_usage_stats``,
on real servers: a chat response's ``prompt_token_ids`` are what transformers' processor feeds the model
(media placeholders expanded) and each choice's ``token_ids`` what its greedy ``generate`` writes (LLaVA
and Qwen2.5-VL, with an image); streamed, the prompt's ids come once and the answer's reassemble to the
whole response's, tool calls and stop strings included, each chunk's usage counting them so far;
logprobs spell tokens ``token_id:<id>`` and are otherwise unchanged; completions return each prompt's
ids with its choices (docs/api.md, "Request fields" and "Completions"). This is what RL frameworks read
to train on exactly the tokens the model saw and wrote."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.e2e.conftest import Oracle, data_url, make_image, user_message
from tests.e2e.parity import NEAR_TIE
from tests.e2e.server import Server, stream_chunks
from tests.near_tie import accept_near_tie, first_divergence

pytestmark = pytest.mark.slow

TEXT = "Describe the picture in a few words, then say what colour dominates it."
IMAGE = make_image(31, (320, 240))
NUM_TOKENS = 12
LOGPROB_ATOL = 1e-5  # one prompt computed whole, or read from the prefix cache
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


def post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{server.base_url}{path}", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def completion_chunks(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``data:`` events of a streamed ``/v1/completions`` request, ``[DONE]`` left out."""
    chunks = []
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def assert_oracles_ids(served: list[int], hf_ids: list[int], hf_logprobs: torch.Tensor) -> None:
    """The served ids are transformers', but for a divergence at a true near-tie (tests/near_tie.py), where
    the comparison stops by design."""
    assert len(served) == len(hf_ids)
    pos = first_divergence(served, hf_ids)
    if pos is not None:
        accept_near_tie(pos, served[pos], hf_ids[pos], hf_logprobs[pos], NEAR_TIE)


def reassembled(chunks: list[dict[str, Any]], index: int) -> tuple[list[int], list[dict[str, Any]]]:
    """Choice ``index``'s token ids as its chunks carry them, and those chunks."""
    own = [chunk for chunk in chunks if chunk["choices"] and chunk["choices"][0]["index"] == index]
    return [t for chunk in own for t in chunk["choices"][0].get("token_ids", [])], own


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_chat_returns_the_ids_transformers_reads_and_writes(
    family: str, family_server: Callable[..., Server], family_oracle: Callable[[str], Oracle]
) -> None:
    server, oracle = family_server(family), family_oracle(family)
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    made = sdk.chat.completions.create(
        model=f"tiny-{family}",
        messages=[user_message(TEXT, IMAGE)],  # type: ignore[list-item]
        max_tokens=NUM_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    inputs = oracle.inputs(TEXT, [IMAGE])
    expected_prompt = inputs["input_ids"][0].tolist()
    assert made.model_extra is not None and made.model_extra["prompt_token_ids"] == expected_prompt
    assert made.usage is not None and made.usage.prompt_tokens == len(expected_prompt)
    [choice] = made.choices
    assert choice.model_extra is not None
    token_ids = choice.model_extra["token_ids"]
    assert len(token_ids) == made.usage.completion_tokens == NUM_TOKENS
    assert oracle.processor.tokenizer.decode(token_ids, skip_special_tokens=True) == choice.message.content
    hf_ids, hf_logprobs = oracle.greedy_inputs(inputs, NUM_TOKENS)
    assert_oracles_ids(token_ids, hf_ids, hf_logprobs)


@pytest.mark.parametrize("cut", ["max_tokens", "stop"])
def test_streamed_ids_and_usage_reassemble_to_the_whole_response(server: Server, cut: str) -> None:
    """Two seeded choices, streamed and not: each role chunk carries the prompt's ids, the choices' chunks
    the answer's ids, which join to the whole response's; with continuous usage each chunk counts them
    so far. A stop string ends the ids at the token that completed it, though text was held back."""
    body: dict[str, Any] = {
        "model": "tiny-llava",
        "messages": [user_message(TEXT, IMAGE)],
        "max_tokens": 24,
        "n": 2,
        "seed": 7,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if cut == "stop":
        plain = post(server, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
        body["stop"] = [plain[len(plain) // 2 : len(plain) // 2 + 3]]
    whole = post(server, "/v1/chat/completions", body)
    stream = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = stream_chunks(server, body | stream)
    num_prompt = whole["usage"]["prompt_tokens"]
    assert len(whole["prompt_token_ids"]) == num_prompt
    for choice in whole["choices"]:
        ids, own = reassembled(chunks, choice["index"])
        assert ids == choice["token_ids"]
        assert own[0]["prompt_token_ids"] == whole["prompt_token_ids"]  # the role chunk
        assert all("prompt_token_ids" not in chunk for chunk in own[1:])
        assert "token_ids" not in own[0]["choices"][0]
        counted = 0
        for chunk in own:
            counted += len(chunk["choices"][0].get("token_ids", []))
            assert chunk["usage"]["completion_tokens"] == counted
            assert chunk["usage"]["prompt_tokens"] == num_prompt
    if cut == "stop":  # (choice 0's: choice 1 samples another answer)
        first = whole["choices"][0]
        assert first["finish_reason"] == "stop" and len(first["token_ids"]) < 24
    assert sum(len(choice["token_ids"]) for choice in whole["choices"]) == whole["usage"]["completion_tokens"]
    assert chunks[-1]["choices"] == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (the stream may hit the prefix cache)
    assert [chunks[-1]["usage"][key] for key in counts] == [whole["usage"][key] for key in counts]


def test_streamed_tool_call_ids_reassemble(family_server: Callable[..., Server]) -> None:
    """A required tool call's ids, streamed as the call's deltas: the same as the whole response's, which
    hold the call's tags and JSON."""
    server = family_server("qwen2_5_vl")
    parts = [{"type": "image_url", "image_url": {"url": data_url(IMAGE)}}, {"type": "text", "text": TEXT}]
    body = {
        "model": "tiny-qwen2_5_vl",
        "messages": [{"role": "user", "content": parts}],
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 96,  # (the call is about 40 tokens, its JSON as the model spaces it)
        "temperature": 0,
        "return_token_ids": True,
    }
    whole = post(server, "/v1/chat/completions", body)
    [choice] = whole["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"]
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"]
    ids, own = reassembled(stream_chunks(server, body | {"stream": True}), 0)
    assert ids == choice["token_ids"]
    assert any(chunk["choices"][0]["delta"].get("tool_calls") for chunk in own)


def with_and_without_ids(
    server: Server, path: str, body: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The first choice of ``body`` with tokens spelt as ids, and without."""
    spelt = post(server, path, body | {"return_tokens_as_token_ids": True})["choices"][0]
    return spelt, post(server, path, body)["choices"][0]


def test_tokens_as_ids_spell_each_token_by_its_id(server: Server) -> None:
    """Chat's and the legacy logprobs: every token and alternative is ``token_id:<id>``, the sampled one the
    answer's own id; logprobs, bytes and offsets are as without."""
    body = {
        "model": "tiny-llava",
        "messages": [user_message(TEXT)],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "return_token_ids": True,
    }
    spelt, plain = with_and_without_ids(server, "/v1/chat/completions", body)
    assert spelt["token_ids"] == plain["token_ids"]
    for token_id, entry, reference in zip(
        spelt["token_ids"], spelt["logprobs"]["content"], plain["logprobs"]["content"], strict=True
    ):
        assert entry["token"] == f"token_id:{token_id}"
        assert entry["bytes"] == reference["bytes"]
        assert entry["logprob"] == pytest.approx(reference["logprob"], abs=LOGPROB_ATOL)
        for alt, alt_reference in zip(entry["top_logprobs"], reference["top_logprobs"], strict=True):
            assert alt["token"].startswith("token_id:") and alt["bytes"] == alt_reference["bytes"]
            assert alt["logprob"] == pytest.approx(alt_reference["logprob"], abs=LOGPROB_ATOL)

    legacy = {
        "model": "tiny-llava",
        "prompt": TEXT,
        "max_tokens": 6,
        "temperature": 0,
        "echo": True,
        "logprobs": 2,
        "return_token_ids": True,
    }
    spelt, plain = with_and_without_ids(server, "/v1/completions", legacy)
    ids = spelt["prompt_token_ids"] + spelt["token_ids"]
    assert spelt["logprobs"]["tokens"] == [f"token_id:{token_id}" for token_id in ids]
    assert spelt["text"] == plain["text"]
    assert spelt["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    assert spelt["logprobs"]["token_logprobs"][1:] == pytest.approx(
        plain["logprobs"]["token_logprobs"][1:], abs=LOGPROB_ATOL
    )
    tops = zip(spelt["logprobs"]["top_logprobs"][1:], plain["logprobs"]["top_logprobs"][1:], strict=True)
    for top, reference in tops:
        assert all(key.startswith("token_id:") for key in top)
        assert sorted(top.values()) == pytest.approx(sorted(reference.values()), abs=LOGPROB_ATOL)


def test_completions_return_each_prompts_ids(server: Server, oracle: Oracle) -> None:
    """A text prompt, and a batch of id prompts, two choices each: each choice carries its prompt's ids
    (the text's as the tokenizer gives them) and its answer's, transformers' greedy continuation;
    streamed, a choice's first chunk carries the prompt's ids and the answer's reassemble."""
    text_ids = oracle.processor.tokenizer(TEXT)["input_ids"]
    batch = [text_ids[:9], text_ids[3:14]]
    body: dict[str, Any] = {
        "model": "tiny-llava",
        "max_tokens": 8,
        "n": 2,
        "temperature": 0,
        "ignore_eos": True,
    }
    body["return_token_ids"] = True
    text = post(server, "/v1/completions", body | {"prompt": TEXT})
    assert [choice["prompt_token_ids"] for choice in text["choices"]] == [text_ids] * 2
    whole = post(server, "/v1/completions", body | {"prompt": batch})
    assert [choice["prompt_token_ids"] for choice in whole["choices"]] == [batch[0]] * 2 + [batch[1]] * 2
    for prompt_ids, choice in zip(
        [text_ids, *batch], text["choices"][:1] + whole["choices"][::2], strict=True
    ):
        ids = torch.tensor([prompt_ids])
        hf_ids, hf_logprobs = oracle.greedy_inputs(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 8
        )
        assert_oracles_ids(choice["token_ids"], hf_ids, hf_logprobs)
    chunks = completion_chunks(server, body | {"prompt": batch, "stream": True})
    for choice in whole["choices"]:
        ids, own = reassembled(chunks, choice["index"])
        assert ids == choice["token_ids"]
        assert own[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert all("prompt_token_ids" not in chunk["choices"][0] for chunk in own[1:])

    echoed = {"model": "tiny-llava", "prompt": TEXT, "max_tokens": 0, "echo": True, "return_token_ids": True}
    stream = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    [only, last] = completion_chunks(server, echoed | stream)
    assert only["choices"][0]["text"] == TEXT and only["choices"][0]["finish_reason"] == "length"
    assert only["choices"][0]["prompt_token_ids"] == text_ids and only["choices"][0]["token_ids"] == []
    assert only["usage"]["completion_tokens"] == 0 and last["usage"]["completion_tokens"] == 0
    [choice] = post(server, "/v1/completions", echoed)["choices"]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (text_ids, [])


def test_without_them_the_response_has_no_ids(server: Server) -> None:
    body = {
        "model": "tiny-llava",
        "messages": [user_message(TEXT)],
        "max_tokens": 3,
        "return_token_ids": None,
    }
    whole = post(server, "/v1/chat/completions", body)
    assert "prompt_token_ids" not in whole and "token_ids" not in whole["choices"][0]
    chunks = stream_chunks(
        server, body | {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    )
    assert all("prompt_token_ids" not in chunk and "usage" not in chunk for chunk in chunks)
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body | {"return_token_ids": "often"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "return_token_ids"
