"""``--chat-template`` and ``--tool-call-parser`` on a real server: the tiny LLaVA, whose own template has no
tools (tests/e2e/test_tool_calling.py checks its 400), serves tool calls once given a Hermes-style template
with tools and the hermes parser. Its tokenizer has no ``<tool_call>`` token: the structural tag holds the
tags as plain text, so ``required`` still makes the answer one well-formed call that the parser reads."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from openai import OpenAI

from tests.e2e.conftest import data_url, make_image
from tests.e2e.server import Server, serving
from tests.e2e.test_tool_calling import TOOLS, WEATHER
from tests.llava_tool_template import LLAVA_HERMES_TEMPLATE

pytestmark = pytest.mark.slow

TOOL = TOOLS[0]  # get_weather


@pytest.fixture(scope="module")
def tool_template_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("chat-template")
    template = folder / "llava_tools.jinja"
    template.write_text(LLAVA_HERMES_TEMPLATE)
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
