"""Prompt logprobs: ``echo`` with ``logprobs`` on ``POST /v1/completions``, and vLLM's ``prompt_logprobs`` on
completions and chat. Each prompt token's logprob given those before it (the first has none) and its
position's top tokens equal ``log_softmax`` of transformers' logits over the prompt (LLaVA and
Qwen2.5-VL; a prompt longer than a step, computed in chunks; a chat prompt with an image, with each
token's rank); never read from the prefix cache, which stays as it was for everyone else;
``max_tokens`` 0 scores the prompt alone; a log-likelihood request as lm-eval's ``local-completions``
sends it gives transformers' sums and greediness; streamed, the echo chunk carries them; every choice
of ``n`` echoes the same (docs/api.md, "Request fields" and "Completions")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.e2e.conftest import Oracle, make_image, user_message
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

PROMPT = "A photo of a red bus parked by the river, and two cats asleep on the warm stones of the quay"
LOGPROB_ATOL = 1e-4  # the server and transformers, both fp32 on the CPU
NUM_TOP = 3


def complete(server: Server, model: str = "tiny-llava", **fields: Any) -> dict[str, Any]:
    resp = httpx.post(f"{server.base_url}/v1/completions", json={"model": model, **fields}, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def forward_logprobs(oracle: Oracle, prompt_ids: list[int]) -> torch.Tensor:
    """[tokens, vocab]: row t is log_softmax of transformers' logits after prompt tokens 0..t."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        logits = oracle.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_prompt_part(logprobs: dict[str, Any], prompt_ids: list[int], expected: torch.Tensor) -> None:
    """The legacy logprobs' first ``len(prompt_ids)`` entries are the prompt's, as transformers scores it."""
    num = len(prompt_ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for t in range(1, num):
        reference = expected[t - 1]
        assert logprobs["token_logprobs"][t] == pytest.approx(
            float(reference[prompt_ids[t]]), abs=LOGPROB_ATOL
        )
        top = logprobs["top_logprobs"][t]
        assert top[logprobs["tokens"][t]] == logprobs["token_logprobs"][t]
        best = sorted(top.values(), reverse=True)[:NUM_TOP]
        assert best == pytest.approx(reference.topk(NUM_TOP).values.tolist(), abs=LOGPROB_ATOL), f"token {t}"
    offsets = logprobs["text_offset"][:num]
    assert offsets == sorted(offsets) and offsets[0] == 0


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_the_prompts_logprobs_are_transformers_forward(
    family: str, family_server: Callable[..., Server], family_oracle: Callable[[str], Oracle]
) -> None:
    server, oracle = family_server(family), family_oracle(family)
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    model = sdk.models.list().data[0].id
    made = sdk.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=NUM_TOP, max_tokens=0)
    prompt_ids = oracle.processor.tokenizer(PROMPT)["input_ids"]
    [choice] = made.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert made.usage is not None and made.usage.completion_tokens == 0
    assert made.usage.prompt_tokens == len(prompt_ids)
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert len(choice.logprobs.tokens) == len(prompt_ids)
    assert "".join(choice.logprobs.tokens).endswith(PROMPT)  # (after LLaVA's BOS)
    assert_prompt_part(choice.logprobs.model_dump(), prompt_ids, forward_logprobs(oracle, prompt_ids))


def test_the_prefix_cache_is_not_read_for_them_and_stays_for_others(server: Server, oracle: Oracle) -> None:
    plain = complete(server, prompt=PROMPT, max_tokens=1, temperature=0)  # its blocks: now cached
    again = complete(server, prompt=PROMPT, max_tokens=1, temperature=0)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    scored = complete(server, prompt=PROMPT, echo=True, logprobs=NUM_TOP, max_tokens=3, temperature=0)
    assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    prompt_ids = oracle.processor.tokenizer(PROMPT)["input_ids"]
    logprobs = scored["choices"][0]["logprobs"]
    assert_prompt_part(logprobs, prompt_ids, forward_logprobs(oracle, prompt_ids))
    assert len(logprobs["tokens"]) == len(prompt_ids) + 3  # the prompt's, then the answer's
    assert (
        scored["choices"][0]["text"]
        == PROMPT + complete(server, prompt=PROMPT, max_tokens=3, temperature=0)["choices"][0]["text"]
    )
    after = complete(server, prompt=PROMPT, max_tokens=1, temperature=0)
    assert (
        after["usage"]["prompt_tokens_details"]["cached_tokens"]
        == again["usage"]["prompt_tokens_details"]["cached_tokens"]
    )
    assert plain["choices"][0]["text"] == after["choices"][0]["text"]


def test_a_prompt_longer_than_a_step_is_scored_in_chunks(uncached_server: Server, oracle: Oracle) -> None:
    text = " ".join(f"word{i % 37}" for i in range(400))  # over 640 tokens: the server's step (WHOLE_IMAGES)
    prompt_ids = oracle.processor.tokenizer(text)["input_ids"]
    assert 640 < len(prompt_ids) < 2000
    scored = complete(uncached_server, prompt=prompt_ids, echo=True, logprobs=NUM_TOP, max_tokens=0)
    assert_prompt_part(scored["choices"][0]["logprobs"], prompt_ids, forward_logprobs(oracle, prompt_ids))


def test_an_lm_eval_loglikelihood_request_gives_transformers_sums(server: Server, oracle: Oracle) -> None:
    """lm-eval's ``local-completions``: token-id prompts (context + continuation), ``echo``, ``max_tokens``
    1, ``logprobs`` 1; it sums ``token_logprobs[ctxlen:-1]`` and calls the continuation greedy when each
    token's logprob is the top of its ``top_logprobs``."""
    tokenizer = oracle.processor.tokenizer
    pairs = [("The sky over the harbour was", " grey"), ("Two cats slept on", " the warm stones")]
    requests = []
    for context, continuation in pairs:
        context_ids = tokenizer(context)["input_ids"]
        requests.append((context_ids, tokenizer(context + continuation)["input_ids"]))
    body = {
        "prompt": [ids for _, ids in requests],
        "echo": True,
        "max_tokens": 1,
        "logprobs": 1,
        "temperature": 0,
    }
    made = complete(server, **body, seed=1234)
    for choice, (context_ids, ids) in zip(made["choices"], requests, strict=True):
        ctxlen = len(context_ids)
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) + 1  # the prompt, then the one token sampled
        expected = forward_logprobs(oracle, ids)
        reference = [float(expected[t - 1, ids[t]]) for t in range(ctxlen, len(ids))]
        assert sum(logprobs["token_logprobs"][ctxlen:-1]) == pytest.approx(sum(reference), abs=1e-3)
        served_greedy = all(
            lp == max(top.values())
            for lp, top in zip(
                logprobs["token_logprobs"][ctxlen:-1], logprobs["top_logprobs"][ctxlen:-1], strict=True
            )
        )
        assert served_greedy == all(int(expected[t - 1].argmax()) == ids[t] for t in range(ctxlen, len(ids)))


def test_a_stream_and_every_choice_carry_the_prompts_logprobs(server: Server) -> None:
    fields = {
        "prompt": PROMPT,
        "echo": True,
        "logprobs": 2,
        "max_tokens": 4,
        "n": 2,
        "seed": 5,
        "temperature": 1.0,
    }
    whole = complete(server, **fields)
    first, second = whole["choices"]
    num_prompt = whole["usage"]["prompt_tokens"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert first["logprobs"][key][:num_prompt] == second["logprobs"][key][:num_prompt], key
    assert first["text"] != second["text"]  # each choice its own seed after the same prompt
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/completions",
        json={"model": "tiny-llava", "stream": True, **fields},
        timeout=120,
    ) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [httpx.Response(200, content=event).json()["choices"][0] for event in events[:-1]]
    streamed: dict[int, dict[str, list[Any]]] = {0: {}, 1: {}}
    for chunk in chunks:
        for key, values in (chunk["logprobs"] or {}).items():
            streamed[chunk["index"]].setdefault(key, []).extend(values)
    echo_chunks = [chunk for chunk in chunks if chunk["text"] == PROMPT]
    assert [len(chunk["logprobs"]["tokens"]) for chunk in echo_chunks] == [num_prompt, num_prompt]
    for choice in whole["choices"]:  # (values within rounding: the two runs batch their steps apart)
        got, logprobs = streamed[choice["index"]], choice["logprobs"]
        assert got["tokens"] == logprobs["tokens"] and got["text_offset"] == logprobs["text_offset"]
        assert got["token_logprobs"][:num_prompt] == logprobs["token_logprobs"][:num_prompt]
        assert got["token_logprobs"][num_prompt:] == pytest.approx(
            logprobs["token_logprobs"][num_prompt:], abs=1e-4
        )

    only = {**fields, "max_tokens": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json={"model": "tiny-llava", **only}, timeout=120
    ) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    bodies = [httpx.Response(200, content=event).json() for event in events[:-1]]
    assert [body["choices"][0]["finish_reason"] for body in bodies[:-1]] == ["length", "length"]
    assert [body["choices"][0]["logprobs"] for body in bodies[:-1]] == [
        {key: values[:num_prompt] for key, values in first["logprobs"].items()}
    ] * 2
    assert bodies[-1]["usage"]["completion_tokens"] == 0


def test_no_tokens_without_echo_is_a_400(server: Server) -> None:
    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": "tiny-llava", "prompt": "x", "max_tokens": 0},
        timeout=60,
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens", resp.text


@pytest.mark.parametrize("family", ["llava", "qwen3_vl"])  # (Qwen3-VL: deepstack over the image's rows)
def test_vllms_prompt_logprobs_on_chat_with_an_image_are_transformers(
    family: str, family_server: Callable[..., Server], family_oracle: Callable[[str], Oracle]
) -> None:
    server, oracle = family_server(family), family_oracle(family)
    image, text = make_image(4242), "What is in this picture?"
    model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [user_message(text, image)],
        "max_tokens": 2,
        "temperature": 0,
        "n": 2,
    }
    made = complete_chat(server, prompt_logprobs=NUM_TOP, **body)
    inputs = oracle.inputs(text, [image])
    ids = inputs["input_ids"][0].tolist()
    with torch.inference_mode():
        logits = oracle.model(**inputs).logits[0]
    expected = torch.log_softmax(logits.float(), dim=-1)
    positions = made["prompt_logprobs"]
    assert len(positions) == len(ids) == made["usage"]["prompt_tokens"] and positions[0] is None
    assert made["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for t in range(1, len(ids)):
        reference, position = expected[t - 1], positions[t]
        token = position[str(ids[t])]
        assert token["logprob"] == pytest.approx(float(reference[ids[t]]), abs=LOGPROB_ATOL), f"token {t}"
        higher = int((reference > reference[ids[t]] + LOGPROB_ATOL).sum())
        within = int((abs(reference - reference[ids[t]]) <= LOGPROB_ATOL).sum())  # itself, and near-ties
        assert higher + 1 <= token["rank"] <= higher + within, f"token {t}"
        tops = sorted(
            (entry["rank"], entry["logprob"]) for key, entry in position.items() if entry["rank"] <= NUM_TOP
        )
        assert [rank for rank, _ in tops] == list(range(1, NUM_TOP + 1))
        assert [lp for _, lp in tops] == pytest.approx(
            reference.topk(NUM_TOP).values.tolist(), abs=LOGPROB_ATOL
        )
    plain = complete_chat(server, **body)
    assert [c["message"] for c in made["choices"]] == [c["message"] for c in plain["choices"]]
    assert "prompt_logprobs" not in plain


def test_vllms_prompt_logprobs_on_completions_match_the_echoed_ones(server: Server) -> None:
    made = complete(
        server, prompt=PROMPT, max_tokens=2, temperature=0, prompt_logprobs=2, echo=True, logprobs=1
    )
    [choice] = made["choices"]
    legacy = choice["logprobs"]
    num_prompt = made["usage"]["prompt_tokens"]
    assert len(choice["prompt_logprobs"]) == num_prompt and choice["prompt_logprobs"][0] is None
    for t in range(1, num_prompt):
        position = choice["prompt_logprobs"][t]
        assert legacy["token_logprobs"][t] in [entry["logprob"] for entry in position.values()]
        assert len(legacy["top_logprobs"][t]) <= 2 and 2 <= len(position) <= 3  # 1 and 2 alternatives


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/chat/completions", {"prompt_logprobs": 1, "stream": True}),
        ("/v1/completions", {"prompt_logprobs": 1, "stream": True}),
        ("/v1/chat/completions", {"prompt_logprobs": -1}),
        ("/v1/completions", {"prompt_logprobs": 21}),
        ("/v1/chat/completions", {"prompt_logprobs": True}),
    ],
)
def test_bad_prompt_logprobs_are_a_400(server: Server, path: str, fields: dict[str, Any]) -> None:
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    resp = httpx.post(f"{server.base_url}{path}", json={"model": "tiny-llava", **base, **fields}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs", resp.text


def complete_chat(server: Server, **fields: Any) -> dict[str, Any]:
    resp = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={"model": "tiny-llava"} | fields, timeout=120
    )
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def test_edges_keep_every_array_whole(server: Server) -> None:
    """A grammar that allows only the empty answer still scores the prompt (and answers ""); a prompt
    whose text is empty still streams its logprobs; offsets skip the BOS a text prompt never had."""
    empty = {"structured_outputs": {"choice": [""]}, "max_tokens": 3, "temperature": 0}
    made = complete(server, prompt="Hello there", prompt_logprobs=1, echo=True, logprobs=1, **empty)
    [choice] = made["choices"]
    num_prompt = made["usage"]["prompt_tokens"]
    assert choice["text"] == "Hello there" and choice["finish_reason"] == "stop"
    assert made["usage"]["completion_tokens"] == 0 and len(choice["prompt_logprobs"]) == num_prompt
    assert {len(values) for values in choice["logprobs"].values()} == {num_prompt}

    fields = {"prompt": [1, 1], "echo": True, "logprobs": 1, "max_tokens": 2, "temperature": 0}
    whole = complete(server, **fields)["choices"][0]
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json={"model": "tiny-llava", "stream": True, **fields}
    ) as resp:
        events = [
            line[6:] for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"
        ]
    tokens = [
        t for e in events for t in (httpx.Response(200, content=e).json()["choices"][0]["logprobs"]["tokens"])
    ]
    assert tokens == whole["logprobs"]["tokens"] and len(tokens) == 4  # BOS twice, then the answer's two

    text = "Hello there world"
    offsets = complete(server, prompt=text, echo=True, logprobs=0, max_tokens=1, skip_special_tokens=False)
    logprobs = offsets["choices"][0]["logprobs"]
    starts = dict(zip(logprobs["tokens"][1:-1], logprobs["text_offset"][1:-1], strict=True))
    assert all(text[start:].startswith(token) for token, start in starts.items()), starts
    assert logprobs["text_offset"][-1] == len(text)  # the answer's token starts after the echo
