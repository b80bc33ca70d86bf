"""vLLM's ``truncate_prompt_tokens`` and ``truncation_side`` on real servers: a completion's prompt cut to
its last (or first) tokens is answered as transformers' greedy ``generate`` answers those tokens, and
echoed as they decode; a chat prompt with an image cut through its text keeps the image whole, and its
answer is transformers' on the cut inputs; a cut that would reach an image, a size past the context, or
0 is a 400 naming the field; -1 keeps what leaves room for the max tokens (docs/api.md, "Request
fields")."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from tests.e2e.conftest import Oracle, make_image, user_message
from tests.e2e.parity import NEAR_TIE
from tests.e2e.server import Server
from tests.near_tie import accept_near_tie, first_divergence

pytestmark = pytest.mark.slow

TEXT = "A long preamble that the client is happy to lose: " + " ".join(f"item{i}" for i in range(60))
IMAGE = make_image(23, (320, 240))
NUM_TOKENS = 12
MAX_MODEL_LEN = 4096  # the shared server's


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=300)


def ok(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = post(server, path, body)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def assert_greedy(oracle: Oracle, inputs: dict[str, Any], served: list[int]) -> None:
    hf_ids, hf_logprobs = oracle.greedy_inputs(inputs, NUM_TOKENS)
    pos = first_divergence(served, hf_ids)
    if pos is not None:
        accept_near_tie(pos, served[pos], hf_ids[pos], hf_logprobs[pos], NEAR_TIE)


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_cut_completion_prompt_is_answered_as_its_kept_tokens(
    server: Server, oracle: Oracle, side: str
) -> None:
    ids = oracle.processor.tokenizer(TEXT)["input_ids"]
    keep = 40
    assert len(ids) > keep
    body = {
        "model": "tiny-llava",
        "prompt": TEXT,
        "max_tokens": NUM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "truncate_prompt_tokens": keep,
        "truncation_side": side,
        "return_token_ids": True,
        "echo": True,
        "logprobs": 1,
    }
    [choice] = (made := ok(server, "/v1/completions", body))["choices"]
    kept = ids[-keep:] if side == "left" else ids[:keep]
    assert choice["prompt_token_ids"] == kept and made["usage"]["prompt_tokens"] == keep
    shown = oracle.processor.tokenizer.decode(kept, skip_special_tokens=True)
    assert choice["text"].startswith(shown) and choice["text"] != TEXT
    assert (
        len(choice["logprobs"]["tokens"]) == keep + NUM_TOKENS
        and choice["logprobs"]["token_logprobs"][0] is None
    )
    tensor = torch.tensor([kept])
    assert_greedy(
        oracle, {"input_ids": tensor, "attention_mask": torch.ones_like(tensor)}, choice["token_ids"]
    )
    untouched = ok(server, "/v1/completions", body | {"truncate_prompt_tokens": len(ids) + 5})
    assert untouched["choices"][0]["prompt_token_ids"] == ids and untouched["choices"][0]["text"].startswith(
        TEXT
    )


def test_a_chat_prompt_cut_through_its_text_keeps_its_image(server: Server, oracle: Oracle) -> None:
    """The image comes after the long text: cutting the text's start keeps it whole; a cut into it, or a
    right-side cut past it, is a 400 that says so."""
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": TEXT}, *user_message("What is it?", IMAGE)["content"]],
        }
    ]
    body = {
        "model": "tiny-llava",
        "messages": messages,
        "max_tokens": NUM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    whole = ok(server, "/v1/chat/completions", body)["prompt_token_ids"]
    image_token = oracle.model.config.image_token_id
    first_image = whole.index(image_token)
    keep = len(whole) - first_image + 5  # five text tokens before the image stay
    made = ok(server, "/v1/chat/completions", body | {"truncate_prompt_tokens": keep})
    kept = made["prompt_token_ids"]
    assert kept == whole[-keep:] and made["usage"]["prompt_tokens"] == keep
    assert kept.count(image_token) == whole.count(image_token)
    pixels = oracle.processor(text=["x <image>"], images=[IMAGE], return_tensors="pt")["pixel_values"]
    tensor = torch.tensor([kept])
    inputs = {"input_ids": tensor, "attention_mask": torch.ones_like(tensor), "pixel_values": pixels}
    assert_greedy(oracle, inputs, made["choices"][0]["token_ids"])
    for cut in (
        {"truncate_prompt_tokens": keep - 10},
        {"truncate_prompt_tokens": first_image + 3, "truncation_side": "right"},
    ):
        resp = post(server, "/v1/chat/completions", body | cut)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "truncate_prompt_tokens" and "media" in error["message"]


def test_minus_one_keeps_what_leaves_room_for_the_answer(server: Server) -> None:
    prompt = [1] + [100 + i % 500 for i in range(MAX_MODEL_LEN - 6)]
    body = {"model": "tiny-llava", "prompt": prompt, "max_tokens": 16, "ignore_eos": True}
    refused = post(server, "/v1/completions", body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    made = ok(server, "/v1/completions", body | {"truncate_prompt_tokens": -1})
    assert made["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 16 and made["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (0, "at least 1"),
        (MAX_MODEL_LEN + 1, "greater than max_model_len"),
        (-2, "greater than or equal"),
        ("8", "integer"),
    ],
)
def test_bad_truncations_are_refused_by_name(server: Server, value: Any, needle: str) -> None:
    body = {
        "model": "tiny-llava",
        "messages": [user_message("hi")],
        "max_tokens": 2,
        "truncate_prompt_tokens": value,
    }
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "truncate_prompt_tokens" and needle in error["message"], error
