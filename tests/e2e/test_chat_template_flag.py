"""``--chat-template`` and ``--tool-call-parser`` on a real server: the tiny LLaVA, whose own template has no
tools (tests/e2e/test_tool_calling.py checks its 400), serves tool calls once given a Hermes-style template
with tools and the hermes parser. Its tokenizer has no ``<tool_call>`` token: the structural tag holds the
tags as plain text, so ``required`` still makes the answer one well-formed call that the parser reads. The
template reads a variable of its own, which ``chat_template_kwargs`` sets, on chat and ``/tokenize``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.e2e.conftest import data_url, make_image
from tests.e2e.server import Server, serving
from tests.e2e.test_tool_calling import TOOLS, WEATHER
from tests.llava_tool_template import LLAVA_HERMES_TEMPLATE

pytestmark = pytest.mark.slow

TOOL = TOOLS[0]  # get_weather
STYLED = "{% if style %}Answer in a {{ style }} style. {% endif %}"  # a variable for chat_template_kwargs


@pytest.fixture(scope="module")
def tool_template_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("chat-template")
    template = folder / "llava_tools.jinja"
    template.write_text(STYLED + LLAVA_HERMES_TEMPLATE)
    flags = ("--chat-template", str(template), "--tool-call-parser", "hermes")
    with serving(tiny_model_dir, folder, *flags) as server:
        yield server


def test_llava_with_a_tool_template_and_parser_calls_a_function(tool_template_server: Server) -> None:
    client = OpenAI(base_url=f"{tool_template_server.base_url}/v1", api_key="unused", max_retries=0)
    content = [
        {"type": "image_url", "image_url": {"url": data_url(make_image(7))}},
        {"type": "text", "text": "What is the weather where this picture was taken?"},
    ]
    completion = client.chat.completions.create(
        model="tiny-llava",
        messages=[{"role": "user", "content": content}],
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=160,  # a call of this schema is about 70 of the tiny tokenizer's tokens
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
    assert choice.message.content is None


def test_chat_template_kwargs_set_the_templates_variables(tool_template_server: Server) -> None:
    base = tool_template_server.base_url
    messages = [{"role": "user", "content": "Hello"}]

    def count(**variables: Any) -> int:
        body = {"messages": messages, **({"chat_template_kwargs": variables} if variables else {})}
        resp = httpx.post(f"{base}/tokenize", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return int(resp.json()["count"])

    plain, styled = count(), count(style="terse")
    assert styled > plain == count(enable_thinking=False)  # a variable the template does not read: nothing
    body = {"model": "tiny-llava", "messages": messages, "max_tokens": 2, "temperature": 0}
    answer = httpx.post(
        f"{base}/v1/chat/completions", json={**body, "chat_template_kwargs": {"style": "terse"}}
    )
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == styled, answer.text
    refused = httpx.post(
        f"{base}/v1/chat/completions", json={**body, "chat_template_kwargs": {"messages": []}}
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs.messages"
