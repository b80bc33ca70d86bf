"""``--chat-template`` and ``--tool-call-parser`` on a real server: the tiny LLaVA, whose own template has no
tools (tests/e2e/test_tool_calling.py checks its 400), serves tool calls once given a Hermes-style template
with tools and the hermes parser. Its tokenizer has no ``<tool_call>`` token: the structural tag holds the
tags as plain text, so ``required`` still makes the answer one well-formed call that the parser reads. The
template reads a variable of its own, which ``chat_template_kwargs`` sets, on chat and ``/tokenize``, and
renders vLLM's ``documents``, which a template without them refuses."""

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
# vLLM's documents, as a RAG template renders them
DOCUMENTS = "{% for doc in documents or [] %}[{{ doc.title }}] {{ doc.text }}\n{% endfor %}"


@pytest.fixture(scope="module")
def tool_template_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("chat-template")
    template = folder / "llava_tools.jinja"
    template.write_text(STYLED + DOCUMENTS + LLAVA_HERMES_TEMPLATE)
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


def test_documents_reach_a_template_that_renders_them(tool_template_server: Server, server: Server) -> None:
    documents = [{"title": "Invoice 7", "text": "Paid on 3 May."}, {"title": "Invoice 8", "text": "Unpaid."}]
    body = {
        "model": "tiny-llava",
        "messages": [{"role": "user", "content": "Which invoice is unpaid?"}],
        "max_tokens": 2,
        "temperature": 0,
        "return_prompt_text": True,
    }
    made = httpx.post(
        f"{tool_template_server.base_url}/v1/chat/completions", json=body | {"documents": documents}
    )
    assert made.status_code == 200, made.text
    prompt = made.json()["prompt_text"]
    assert prompt.startswith("[Invoice 7] Paid on 3 May.\n[Invoice 8] Unpaid.\n"), prompt
    plain = httpx.post(f"{tool_template_server.base_url}/v1/chat/completions", json=body).json()
    assert prompt.endswith(plain["prompt_text"])
    # the tiny LLaVA's own template has no documents: refused, not silently dropped
    refused = httpx.post(f"{server.base_url}/v1/chat/completions", json=body | {"documents": documents})
    assert refused.status_code == 400, refused.text
    assert (
        refused.json()["error"]["param"] == "documents"
        and "does not read documents" in refused.json()["error"]["message"]
    )
