"""vLLM's ``bad_words`` on real servers: the greedy answer with words taken from the plain answer banned is
transformers' ``generate`` with ``bad_words_ids`` of the same token sequences (LLaVA's SentencePiece
tokenizer and Qwen2.5-VL's byte-level one, with an image), through chat and completions, streamed or not;
a word of one token never appears, a word of several never completes; bad input is a 400 naming the
field (docs/api.md, "Request fields")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch
from transformers import GenerationConfig

from tests.e2e.conftest import Oracle, make_image, user_message
from tests.e2e.parity import NEAR_TIE
from tests.e2e.server import Server, stream_chunks
from tests.near_tie import accept_near_tie, first_divergence

pytestmark = pytest.mark.slow

TEXT = "Describe this picture: its colours, its shapes and what it could be."
IMAGE = make_image(17, (320, 240))
NUM_TOKENS = 24
GREEDY = {"max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{server.base_url}{path}", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def sequences(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """The token sequences vLLM bans for ``words``: each as text begins, and after a space where that
    gives other tokens of the same count."""
    result: list[list[int]] = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        result.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            result.append(spaced)
    return result


def banned_greedy(
    oracle: Oracle, inputs: Any, bad_words_ids: list[list[int]], num_tokens: int = NUM_TOKENS
) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy answer under ``bad_words_ids``, EOS ignored, and its processed logprobs (on
    the oracle's device: the CUDA tier's too)."""
    inputs = {k: v.to(oracle.model.device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=num_tokens,
        eos_token_id=None,
        pad_token_id=oracle.processor.tokenizer.pad_token_id,
        bad_words_ids=bad_words_ids,
    )
    with torch.inference_mode():
        out = oracle.model.generate(
            **inputs, generation_config=config, output_scores=True, return_dict_in_generate=True
        )
    ids = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return ids, torch.log_softmax(torch.stack(out.scores)[:, 0].float(), dim=-1).cpu()


def words_of(tokenizer: Any, ids: list[int]) -> list[str]:
    """Two words of the answer ``ids``: one that is a single token of it, one that spans two."""
    single = multi = None
    for token_id in ids[1:]:
        text = tokenizer.decode([token_id]).strip()
        if text.isalpha() and len(tokenizer.encode(text, add_special_tokens=False)) == 1 and single is None:
            single = text
    for first, second in zip(ids[2:], ids[3:], strict=False):
        text = tokenizer.decode([first, second]).strip()
        if text.isalpha() and len(tokenizer.encode(text, add_special_tokens=False)) == 2 and multi != single:
            multi = text
            break
    assert single is not None and multi is not None, tokenizer.decode(ids)
    return [single, multi]


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_bad_words_answer_as_transformers_bad_words_ids(
    family: str, family_server: Callable[..., Server], family_oracle: Callable[[str], Oracle]
) -> None:
    server, oracle = family_server(family), family_oracle(family)
    tokenizer = oracle.processor.tokenizer
    body = {"model": f"tiny-{family}", "messages": [user_message(TEXT, IMAGE)], **GREEDY}
    plain = post(server, "/v1/chat/completions", body)["choices"][0]["token_ids"]
    words = words_of(tokenizer, plain)
    banned = sequences(tokenizer, words)
    inputs = oracle.inputs(TEXT, [IMAGE])
    prompt_tail = inputs["input_ids"][0].tolist()[-3:]
    assert not any(prompt_tail[-(len(ids) - 1) :] == ids[:-1] for ids in banned if len(ids) > 1)  # (see doc)
    answer = post(server, "/v1/chat/completions", body | {"bad_words": words})
    served = answer["choices"][0]["token_ids"]
    assert served != plain
    hf_ids, hf_logprobs = banned_greedy(oracle, inputs, banned)
    pos = first_divergence(served, hf_ids)
    if pos is not None:
        accept_near_tie(pos, served[pos], hf_ids[pos], hf_logprobs[pos], NEAR_TIE)
        served = served[:pos]
    for ids in banned:  # no banned sequence anywhere in what was compared
        assert not any(served[i : i + len(ids)] == ids for i in range(len(served))), (words, ids)
    streamed = stream_chunks(server, body | {"bad_words": words, "stream": True})
    assert [t for chunk in streamed[1:] for t in chunk["choices"][0].get("token_ids", [])] == answer[
        "choices"
    ][0]["token_ids"]


@pytest.mark.parametrize("flags", [(), ("--worker-step-overlap", "on")], ids=["", "overlapped steps"])
def test_completions_ban_them_too(
    flags: tuple[str, ...], family_server: Callable[..., Server], oracle: Oracle
) -> None:
    """Also where the worker launches each step before it answered the one before (the sampler then
    reads the outputs that step appended)."""
    server = family_server("llava", *flags)
    tokenizer = oracle.processor.tokenizer
    prompt_ids = tokenizer(TEXT)["input_ids"]
    body = {"model": "tiny-llava", "prompt": prompt_ids, **GREEDY}
    plain = post(server, "/v1/completions", body)["choices"][0]["token_ids"]
    words = words_of(tokenizer, plain)
    served = post(server, "/v1/completions", body | {"bad_words": words})["choices"][0]["token_ids"]
    ids = torch.tensor([prompt_ids])
    hf_ids, hf_logprobs = banned_greedy(
        oracle, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, sequences(tokenizer, words)
    )
    pos = first_divergence(served, hf_ids)
    if pos is not None:
        accept_near_tie(pos, served[pos], hf_ids[pos], hf_logprobs[pos], NEAR_TIE)
    assert served != plain


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (["   "], "not all whitespace"),
        (["x" * 300], "1 to 256"),
        (["a"] * 129, "at most 128"),
        ("word", "list"),
    ],
)
def test_bad_bad_words_are_refused_by_name(server: Server, value: Any, needle: str) -> None:
    body = {"model": "tiny-llava", "messages": [user_message(TEXT)], "max_tokens": 2, "bad_words": value}
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"].startswith("bad_words") and needle in error["message"], error
