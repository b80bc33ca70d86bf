"""Tool calls cut off by the max tokens, on the tiny Qwen2.5-VL: a call cut after its name is an
incomplete call with the arguments written so far; one cut before, down to the first characters of
``<tool_call>``, is left out. Never markup in ``content``, on chat and Responses, streamed or not."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest
from openai import OpenAI

from tests.e2e.server import Server
from tests.e2e.test_tool_calling import NAMED, ask, body, responses_body

pytestmark = pytest.mark.slow


def test_a_call_cut_off_by_the_max_tokens_is_an_incomplete_call_never_markup(
    family_server: Callable[..., Server],
) -> None:
    """Chat: ``tool_calls`` with the arguments written so far and ``finish_reason`` ``length``, streamed
    as not; Responses: a ``function_call`` item ``incomplete``, streamed as not. No ``<tool_call>`` text."""
    server = family_server("qwen2_5_vl")
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    whole = ask(server, body("qwen2_5_vl", NAMED, parallel_tool_calls=False))
    arguments = whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    # cut a few tokens after the arguments began
    tokens = [entry["token"] for entry in whole["choices"][0]["logprobs"]["content"]]
    begun = next(n for n in range(len(tokens)) if '"city"' in "".join(tokens[:n]))
    max_tokens = begun + 2
    cut = ask(server, body("qwen2_5_vl", NAMED, max_tokens=max_tokens))["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] is None, cut
    [call] = cut["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    written = call["function"]["arguments"]  # the raw text so far, not yet a whole object
    assert written.startswith("{") and "city" in written and written != arguments, written
    with pytest.raises(ValueError):
        json.loads(written)
    # (the SDK's stream helper refuses to build a completion cut by the length: the chunks themselves)
    cut_chat = body("qwen2_5_vl", NAMED, max_tokens=max_tokens)
    chunks = list(client.chat.completions.create(**cut_chat, stream=True))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]
    assert not "".join(d.delta.content or "" for d in deltas)
    pieces = [call for d in deltas for call in d.delta.tool_calls or []]
    assert pieces[0].function.name == "get_weather" and {p.index for p in pieces} == {0}
    assert "".join(p.function.arguments or "" for p in pieces) == written

    named = {"type": "function", "name": "get_weather"}
    cut_body = responses_body("qwen2_5_vl", named, max_output_tokens=max_tokens)
    response = client.responses.create(**cut_body)
    assert response.status == "incomplete" and response.incomplete_details is not None
    [item] = response.output
    assert item.type == "function_call" and item.status == "incomplete" and item.arguments == written
    with client.responses.stream(**cut_body) as stream:
        events = list(stream)
    final = events[-1]
    assert final.type == "response.incomplete"
    [streamed_item] = final.response.output
    assert (streamed_item.type, streamed_item.status, streamed_item.arguments) == (
        "function_call",
        "incomplete",
        written,
    )
    # a follow-up is answered: the stored conversation leaves the cut call out
    follow_up = client.responses.create(
        **responses_body("qwen2_5_vl", "none", input="Go on.", previous_response_id=response.id)
    )
    assert follow_up.status in ("completed", "incomplete")
    assert follow_up.usage is not None and follow_up.usage.input_tokens > response.usage.input_tokens


def test_an_answer_cut_as_it_opens_a_call_is_no_call_and_no_content(
    family_server: Callable[..., Server],
) -> None:
    """The max tokens end the answer before the call's name, or within ``<tool_call>`` itself (spelt in
    pieces where its token is biased away): chat has neither content nor calls (streamed: no content
    delta), ``finish_reason`` ``length``; Responses has no output item, streamed or not."""
    server = family_server("qwen2_5_vl")
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    open_tag = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "<tool_call>"}, timeout=30)
    spelt = {"logit_bias": {str(token): -100 for token in open_tag.json()["tokens"]}}
    assert len(open_tag.json()["tokens"]) == 1, open_tag.text  # (its own token, as on a real checkpoint)
    unnamed: dict[bool, int] = {}  # the most tokens without the name, by bias
    for bias in ({}, spelt):
        whole = ask(server, body("qwen2_5_vl", NAMED, **bias))
        tokens = [entry["token"] for entry in whole["choices"][0]["logprobs"]["content"]]
        tag = next(n for n in range(1, len(tokens)) if "<tool_call>" in "".join(tokens[:n]))
        named = next(n for n in range(tag, len(tokens)) if '"get_weather"' in "".join(tokens[:n]))
        assert (tag > 2) == bool(bias), tokens  # biased away, the tag is spelt: a cut can end inside it
        unnamed[bool(bias)] = named - 1
        for max_tokens in sorted({1, tag // 2, tag - 1, tag, named - 1} - {0}):
            cut_chat = body("qwen2_5_vl", NAMED, max_tokens=max_tokens, **bias)
            cut = ask(server, cut_chat)["choices"][0]
            assert cut["finish_reason"] == "length", cut
            assert cut["message"]["content"] is None and not cut["message"].get("tool_calls"), cut
            deltas = [
                c.choices[0] for c in client.chat.completions.create(**cut_chat, stream=True) if c.choices
            ]
            assert not any(d.delta.content or d.delta.tool_calls for d in deltas), (max_tokens, deltas)
            assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]
    for max_tokens in (1, unnamed[False]):  # (Responses takes no logit_bias: the tag is one token)
        named_function = {"type": "function", "name": "get_weather"}
        cut_body = responses_body("qwen2_5_vl", named_function, max_output_tokens=max_tokens)
        response = client.responses.create(**cut_body)
        assert response.status == "incomplete" and response.output == [], (max_tokens, response.output)
        with client.responses.stream(**cut_body) as stream:
            events = list(stream)
        assert events[-1].type == "response.incomplete" and events[-1].response.output == []
        assert not [e for e in events if e.type == "response.output_item.added"], max_tokens
