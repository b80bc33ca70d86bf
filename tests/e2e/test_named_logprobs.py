"""vLLM's ``logprob_token_ids`` on real servers: with logprobs, each generated position lists exactly the
named ids, in their order, each with the logprob transformers' greedy ``generate`` gives it there however
unlikely (a label set scored in one request: "Yes", "No", "Maybe"), on chat with an image and on
completions (the legacy dict), streamed or not; an empty list keeps the top ones; named ids without
logprobs, outside the vocabulary, or on a prompt scored alone are 400s naming the field (docs/api.md,
"Request fields")."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from tests.e2e.conftest import Oracle, make_image, user_message
from tests.e2e.server import Server, stream_chunks

pytestmark = pytest.mark.slow

TEXT = "Is there a red square in this picture? Answer Yes, No or Maybe."
IMAGE = make_image(41, (320, 240))
NUM_TOKENS = 6
ATOL = 1e-4  # fp32 on both sides
# greedy, every answer's ids returned and its tokens spelt as ids
GREEDY = {
    "max_tokens": NUM_TOKENS,
    "temperature": 0,
    "ignore_eos": True,
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
}


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=300)


def label_ids(oracle: Oracle) -> list[int]:
    """One token of each label, and the vocabulary's last id (never a top one)."""
    tokenizer = oracle.processor.tokenizer
    labels = [tokenizer.encode(word, add_special_tokens=False)[0] for word in ("Yes", "No", "Maybe")]
    return [*dict.fromkeys(labels), len(tokenizer) - 1]


def test_chat_lists_the_named_ids_with_transformers_logprobs(server: Server, oracle: Oracle) -> None:
    named = label_ids(oracle)
    body = {
        "model": "tiny-llava",
        "messages": [user_message(TEXT, IMAGE)],
        "logprobs": True,
        "top_logprobs": 2,  # (the named ids take the place of the top ones)
        "logprob_token_ids": named,
        **GREEDY,
    }
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    [choice] = resp.json()["choices"]
    hf_ids, hf_logprobs = oracle.greedy(TEXT, [IMAGE], NUM_TOKENS)
    served = choice["token_ids"]
    for step, entry in enumerate(choice["logprobs"]["content"]):
        if served[: step + 1] != hf_ids[: step + 1]:
            break  # (a near-tie took another path: later steps have other prefixes)
        assert [alt["token"] for alt in entry["top_logprobs"]] == [f"token_id:{t}" for t in named]
        got = [alt["logprob"] for alt in entry["top_logprobs"]]
        assert got == pytest.approx(hf_logprobs[step, named].tolist(), abs=ATOL)
    else:
        step = NUM_TOKENS
    assert step >= 1
    chunks = stream_chunks(server, body | {"stream": True})
    streamed = [e for c in chunks for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert [[a["token"] for a in e["top_logprobs"]] for e in streamed] == [
        [a["token"] for a in e["top_logprobs"]] for e in choice["logprobs"]["content"]
    ]
    natural = post(server, "/v1/chat/completions", body | {"logprob_token_ids": []}).json()["choices"][0]
    assert all(len(e["top_logprobs"]) == 2 for e in natural["logprobs"]["content"])


def test_completions_list_them_in_the_legacy_dict(server: Server, oracle: Oracle) -> None:
    named = label_ids(oracle)
    ids = oracle.processor.tokenizer(TEXT)["input_ids"]
    body = {"model": "tiny-llava", "prompt": ids, "logprobs": 0, "logprob_token_ids": named, **GREEDY}
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    [choice] = resp.json()["choices"]
    tensor = torch.tensor([ids])
    hf_ids, hf_logprobs = oracle.greedy_inputs(
        {"input_ids": tensor, "attention_mask": torch.ones_like(tensor)}, 1
    )
    first = choice["logprobs"]["top_logprobs"][0]
    assert list(first)[0] == f"token_id:{choice['token_ids'][0]}"  # the sampled token, then the named ones
    expected = {f"token_id:{t}": v for t, v in zip(named, hf_logprobs[0, named].tolist(), strict=True)}
    for key, value in expected.items():
        assert first[key] == pytest.approx(value, abs=ATOL)
    assert set(first) == {f"token_id:{choice['token_ids'][0]}", *expected}


@pytest.mark.parametrize(
    ("path", "extra", "needle"),
    [
        ("/v1/chat/completions", {"logprob_token_ids": [5]}, "needs logprobs"),
        (
            "/v1/chat/completions",
            {"logprobs": True, "logprob_token_ids": [10**9]},
            "outside the model's vocabulary",
        ),
        (
            "/v1/completions",
            {"logprobs": 1, "echo": True, "max_tokens": 0, "logprob_token_ids": [5]},
            "max_tokens 0",
        ),
        ("/v1/chat/completions", {"logprobs": True, "logprob_token_ids": [-1]}, "token ids"),
    ],
)
def test_bad_named_ids_are_refused_by_name(
    server: Server, path: str, extra: dict[str, Any], needle: str
) -> None:
    body: dict[str, Any] = {"model": "tiny-llava", "max_tokens": 2}
    body |= {"prompt": "hi"} if path == "/v1/completions" else {"messages": [user_message("hi")]}
    resp = post(server, path, body | extra)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "logprob_token_ids" and needle in error["message"], error
