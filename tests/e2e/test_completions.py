"""``POST /v1/completions`` through the openai SDK, on real servers: a prompt continued as it is equals
transformers' greedy ``generate`` on the tokenizer's ids (LLaVA and Qwen2.5-VL); ids and text give one
answer; a batch of prompts is each prompt's answer, numbered prompt by prompt; streams reassemble to the
whole answer; echo, logprobs in the legacy form, stop strings and structured outputs; bad input is a 400
naming its field (docs/api.md, "Completions")."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.e2e.conftest import Oracle
from tests.e2e.parity import assert_matches_greedy
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

PROMPT = "A photo of a red bus parked by the river, and"
NUM_TOKENS = 24


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def complete(server: Server, **fields: Any) -> dict[str, Any]:
    resp = httpx.post(
        f"{server.base_url}/v1/completions", json={"model": "tiny-llava", **fields}, timeout=120
    )
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def greedy(**fields: Any) -> dict[str, Any]:
    return {"max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True, **fields}


def hf_greedy(oracle: Oracle, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt_ids])
    return oracle.greedy_inputs({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, max_new_tokens)


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_a_greedy_completion_is_transformers_generate_on_the_prompts_ids(
    family: str, family_server: Callable[..., Server], family_oracle: Callable[[str], Oracle]
) -> None:
    server, oracle = family_server(family), family_oracle(family)
    model = client(server).models.list().data[0].id
    made = client(server).completions.create(
        model=model, prompt=PROMPT, logprobs=1, extra_body={"ignore_eos": True}, **_greedy_sdk()
    )
    prompt_ids = oracle.processor.tokenizer(PROMPT)["input_ids"]  # (BOS where the tokenizer adds one)
    assert made.usage is not None and made.usage.prompt_tokens == len(prompt_ids)
    hf_ids, hf_logprobs = hf_greedy(oracle, prompt_ids, NUM_TOKENS)
    [choice] = made.choices
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    as_chat = {
        "choices": [
            {
                "logprobs": {"content": [{"token": token} for token in choice.logprobs.tokens]},
                "message": {"content": choice.text},
            }
        ],
        "usage": {"completion_tokens": made.usage.completion_tokens},
    }
    assert_matches_greedy(as_chat, oracle.processor.tokenizer, hf_ids, hf_logprobs)
    assert choice.finish_reason == "length" and made.object == "text_completion"
    by_ids = client(server).completions.create(
        model=model,
        prompt=prompt_ids,
        extra_body={"ignore_eos": True, "add_special_tokens": False},
        **_greedy_sdk(),
    )
    assert by_ids.choices[0].text == choice.text  # the same ids, given as ids


def _greedy_sdk() -> dict[str, Any]:
    return {"max_tokens": NUM_TOKENS, "temperature": 0}


def test_legacy_logprobs_spell_the_text(server: Server) -> None:
    made = complete(server, prompt=PROMPT, logprobs=3, **greedy(max_tokens=8))
    logprobs = made["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == made["choices"][0]["text"]
    offsets = [sum(len(token) for token in logprobs["tokens"][:i]) for i in range(len(logprobs["tokens"]))]
    assert logprobs["text_offset"] == offsets
    for token, logprob, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert top[token] == logprob and 3 <= len(top) <= 4  # the sampled token and the top 3
        assert logprob == max(top.values())  # greedy: the top token


def test_a_stream_reassembles_to_the_whole_answer(server: Server) -> None:
    fields = {"prompt": PROMPT, "n": 2, "seed": 7, "temperature": 1.0, "max_tokens": 12, "logprobs": 1}
    whole = complete(server, **fields)
    texts: dict[int, str] = {0: "", 1: ""}
    tokens: dict[int, list[str]] = {0: [], 1: []}
    reasons: dict[int, str | None] = {}
    with client(server).completions.create(
        model="tiny-llava", stream=True, stream_options={"include_usage": True}, **fields
    ) as stream:
        chunks = list(stream)
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        texts[choice.index] += choice.text
        tokens[choice.index] += choice.logprobs.tokens if choice.logprobs and choice.logprobs.tokens else []
        if choice.finish_reason is not None:
            reasons[choice.index] = choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump(exclude_none=True) == whole["usage"]
    for choice in whole["choices"]:
        assert (
            texts[choice["index"]] == choice["text"] and reasons[choice["index"]] == choice["finish_reason"]
        )
        assert tokens[choice["index"]] == choice["logprobs"]["tokens"]
    assert texts[0] != texts[1]  # each choice its own seed


def test_a_batch_of_prompts_is_each_prompts_answer(server: Server) -> None:
    prompts = [PROMPT, "Two cats", "The sky over the harbour"]
    batch = complete(server, prompt=prompts, n=2, **greedy(max_tokens=6))
    assert [choice["index"] for choice in batch["choices"]] == list(range(6))
    total_prompt = 0
    for i, prompt in enumerate(prompts):
        alone = complete(server, prompt=prompt, **greedy(max_tokens=6))
        assert [c["text"] for c in batch["choices"][2 * i : 2 * i + 2]] == [alone["choices"][0]["text"]] * 2
        total_prompt += alone["usage"]["prompt_tokens"]
    assert batch["usage"]["prompt_tokens"] == total_prompt and batch["usage"]["completion_tokens"] == 36


def test_echo_puts_the_prompt_before_the_answer(server: Server) -> None:
    plain = complete(server, prompt=PROMPT, max_tokens=6, temperature=0)["choices"][0]["text"]
    echoed = complete(server, prompt=PROMPT, echo=True, max_tokens=6, temperature=0)["choices"][0]["text"]
    assert echoed == PROMPT + plain
    tokenizer_ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "Two cats"}).json()["tokens"]
    by_ids = complete(server, prompt=tokenizer_ids, echo=True, **greedy(max_tokens=2))["choices"][0]["text"]
    assert by_ids.startswith("Two cats")  # (decoded as the answer is: without the BOS)
    with client(server).completions.create(
        model="tiny-llava", prompt=PROMPT, echo=True, stream=True, max_tokens=6, temperature=0
    ) as stream:
        pieces = [chunk.choices[0].text for chunk in stream]
    assert pieces[0] == PROMPT and "".join(pieces) == echoed


def test_stop_strings_and_structured_outputs_apply(server: Server) -> None:
    plain = complete(server, prompt=PROMPT, **greedy(max_tokens=12))["choices"][0]["text"]
    stop = plain[3:6]
    stopped = complete(server, prompt=PROMPT, stop=[stop], **greedy(max_tokens=12))["choices"][0]
    assert stopped["text"] == plain[: plain.index(stop)] and stopped["finish_reason"] == "stop"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    shaped = complete(server, prompt=PROMPT, response_format=fmt, max_tokens=40, temperature=0)["choices"][0]
    assert shaped["finish_reason"] == "stop" and isinstance(json.loads(shaped["text"])["ok"], bool)
    chosen = complete(server, prompt=PROMPT, structured_outputs={"choice": ["yes", "no"]}, temperature=0)
    assert chosen["choices"][0]["text"] in ("yes", "no")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ["a"] * 65}, "prompt"),
        ({"prompt": [1, 2, 10**9]}, "prompt"),
        ({"prompt": "Look: <image> here"}, "prompt"),
        ({"prompt": ["fine", "a <image>"]}, "prompt[1]"),
        ({"prompt": "x", "max_tokens": 4095}, "prompt"),
        ({"prompt": ["x", "y" * 9000], "max_tokens": 8}, "prompt[1]"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ({"prompt": "x", "tools": []}, "tools"),
        ({"prompt": "x", "prompt_embeds": "AAAA"}, "prompt_embeds"),
        ({"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
        (
            {"prompt": "x", "response_format": {"type": "json_object"}, "allowed_token_ids": [5]},
            "allowed_token_ids",
        ),
    ],
)
def test_bad_input_is_a_400_naming_its_field(server: Server, fields: dict[str, Any], param: str) -> None:
    resp = httpx.post(f"{server.base_url}/v1/completions", json={"model": "tiny-llava", **fields}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    if param.startswith("prompt") and "context length" in error["message"]:
        assert error["code"] == "context_length_exceeded" and "messages" not in error["message"]


def test_another_model_is_a_404(server: Server) -> None:
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="gpt-3.5-turbo-instruct", prompt="x", max_tokens=1)


LEAK_TOKENS = 3000  # a choice left running would take this many steps


def test_no_choice_of_a_batch_runs_on_when_a_prompt_fails_or_the_client_leaves(server: Server) -> None:
    """A prompt refused (too long) while the others are being sent, and a client gone mid-stream: every
    choice of the batch is aborted (a prompt refused after the others answered: the next test)."""
    steps = server.metrics()["mmserve_engine_steps_total"]
    failing = {"prompt": ["x", "z", "y" * 9000], "n": 2, "max_tokens": LEAK_TOKENS, "ignore_eos": True}
    resp = httpx.post(
        f"{server.base_url}/v1/completions", json={"model": "tiny-llava", **failing}, timeout=60
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt[2]"
    body = {
        "model": "tiny-llava",
        "prompt": ["x", "z"],
        "n": 2,
        "max_tokens": LEAK_TOKENS,
        "ignore_eos": True,
    }
    url = f"{server.base_url}/v1/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                break  # the answer runs: leave
    deadline = time.monotonic() + 60
    while (metrics := server.metrics())["mmserve_num_requests_running"] > 0:
        assert time.monotonic() < deadline, "a choice still runs"
        time.sleep(0.1)
    assert metrics["mmserve_engine_steps_total"] - steps < LEAK_TOKENS, "a choice ran on"


def test_a_batch_past_the_waiting_cap_is_a_429_and_its_running_prompts_stop(narrow_server: Server) -> None:
    """One request runs and one waits: of three prompts, one is refused by the engine once the others
    were taken (the first already answering), and the request is a 429 whose sent prompts are aborted."""
    steps = narrow_server.metrics()["mmserve_engine_steps_total"]
    body = {"model": "tiny-llava", "prompt": ["x", "z", "w"], "max_tokens": LEAK_TOKENS, "ignore_eos": True}
    resp = httpx.post(f"{narrow_server.base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 429 and "retry-after" in resp.headers, resp.text
    deadline = time.monotonic() + 60
    while (metrics := narrow_server.metrics())["mmserve_num_requests_running"] > 0:
        assert time.monotonic() < deadline, "a prompt still runs"
        time.sleep(0.1)
    assert metrics["mmserve_engine_steps_total"] - steps < LEAK_TOKENS, "a prompt ran on"
    assert metrics["mmserve_num_requests_waiting"] == 0
