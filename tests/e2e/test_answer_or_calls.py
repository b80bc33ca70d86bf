"""Tools beside a JSON output format (docs/api.md, "Tool calling"): the answer is that JSON alone or
calls alone, so a JSON answer whose strings hold the call tag is content whole, streamed or not; it is
never read as the start of a call (Responses reads its answer with the same streamer:
tests/unit/test_responses_output.py)."""

from __future__ import annotations

import json
from collections.abc import Callable

from openai import OpenAI

from tests.e2e.conftest import Oracle
from tests.e2e.server import Server
from tests.e2e.test_tool_calling import ask, body

TAGGED = {
    "type": "object",
    "properties": {"note": {"const": "<tool_call> is how a call opens"}},
    "required": ["note"],
    "additionalProperties": False,
}
ANSWER = {"note": "<tool_call> is how a call opens"}


def test_an_answer_holding_the_call_tag_is_content_whole(
    family_server: Callable[..., Server], family_oracle: Callable[[str], Oracle]
) -> None:
    server = family_server("qwen2_5_vl")
    tokenizer = family_oracle("qwen2_5_vl").processor.tokenizer
    brace = {str(tokenizer.convert_tokens_to_ids("{")): 100}  # the answer's branch, not a call's
    response_format = {"type": "json_schema", "json_schema": {"name": "note", "schema": TAGGED}}
    payload = body("qwen2_5_vl", "auto", response_format=response_format, logit_bias=brace)
    [choice] = ask(server, payload)["choices"]
    assert json.loads(choice["message"]["content"]) == ANSWER and not choice["message"].get("tool_calls")
    assert choice["finish_reason"] == "stop", choice

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    chunks = list(client.chat.completions.create(**payload, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == choice["message"]["content"]
    assert not any(d.tool_calls for d in deltas)
