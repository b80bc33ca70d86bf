"""A family built with ``--chat-template``'s template and ``--tool-call-parser``'s name, on the tiny
checkpoints: the template renders every prompt (with tools too, where it has them; where it has none, the
model has no tool template, even one whose own has), the parser replaces the family's default, and
neither changes what decides a processed item (``model_id``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.api.tool_schemas import ChatTool, template_tools
from app.errors import InvalidRequestError
from app.inputs.prompts import PromptBuilder
from tests.llava_tool_template import LLAVA_HERMES_TEMPLATE
from workers.families import load_processing
from workers.families.errors import FamilyInputError
from workers.families.processing import TemplateOptions

pytestmark = pytest.mark.slow

PLAIN = "{%- for m in messages -%}[{{ m['role'] }}] {{ m['content'] }}\n{%- endfor -%}"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
IMAGE_TURN: list[dict[str, Any]] = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Weather here?"}]}
]


def test_a_given_template_renders_every_prompt(tiny_model: Callable[[str], Path]) -> None:
    family = load_processing(tiny_model("llava"), chat_template=PLAIN)
    assert family.render_prompt([{"role": "user", "content": "hi"}]) == "[user] hi"
    assert family.tool_chat_template is None and family.tool_call_parser is None
    with pytest.raises(FamilyInputError, match="no tool format"):
        family.render_prompt(IMAGE_TURN, TemplateOptions(tools=json.dumps(TOOLS)))


def test_a_template_with_tools_and_a_parser_give_llava_a_tool_format(
    tiny_model: Callable[[str], Path],
) -> None:
    own = load_processing(tiny_model("llava"))
    family = load_processing(
        tiny_model("llava"), chat_template=LLAVA_HERMES_TEMPLATE, tool_call_parser="hermes"
    )
    assert family.tool_chat_template == LLAVA_HERMES_TEMPLATE and family.tool_call_parser == "hermes"
    assert family.model_id == own.model_id  # the template decides the prompt, not a processed item
    with_tools = family.render_prompt(IMAGE_TURN, TemplateOptions(tools=json.dumps(TOOLS)))
    assert with_tools.startswith("TOOLS: ") and json.dumps(TOOLS[0]) in with_tools
    assert with_tools.endswith("USER: <image>\nWeather here? ASSISTANT:")
    assert family.media_tokens_in(with_tools) == [("image", with_tools.index("<image>"))]
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    history = [
        *IMAGE_TURN,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]
    rendered = family.render_prompt(history, TemplateOptions(tools="[]"))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call></s>' in rendered
    assert rendered.endswith("USER: <tool_response>\nrain\n</tool_response> ASSISTANT:")
    assert template_tools(family, [ChatTool.model_validate(TOOLS[0])], []) is not None


def test_a_tool_template_without_a_parser_is_no_tool_format(tiny_model: Callable[[str], Path]) -> None:
    family = load_processing(tiny_model("llava"), chat_template=LLAVA_HERMES_TEMPLATE)
    assert family.tool_chat_template is not None and family.tool_call_parser is None
    with pytest.raises(InvalidRequestError, match="no tool-call parser reads its calls") as refused:
        template_tools(family, [ChatTool.model_validate(TOOLS[0])], [])
    assert refused.value.param == "tools" and "--tool-call-parser" in str(refused.value)


def test_a_template_without_tools_replaces_the_tool_template_too(tiny_model: Callable[[str], Path]) -> None:
    """Qwen2.5-VL's tokenizer template has tools; a template given without them leaves it none."""
    own = load_processing(tiny_model("qwen2_5_vl"))
    family = load_processing(tiny_model("qwen2_5_vl"), chat_template=PLAIN)
    assert own.tool_chat_template is not None and family.tool_chat_template is None
    assert family.tool_call_parser == own.tool_call_parser == "hermes"  # the family's default
    with pytest.raises(FamilyInputError, match="no tool format"):
        family.render_prompt(IMAGE_TURN, TemplateOptions(tools=json.dumps(TOOLS)))


def test_an_unknown_parser_is_refused(tiny_model: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="valid: hermes"):
        load_processing(tiny_model("llava"), tool_call_parser="pythonic")


def test_a_given_template_that_reads_the_clock_is_rendered_every_time(
    tiny_model: Callable[[str], Path],
) -> None:
    clock = "{{ strftime_now('%H:%M:%S.%f') }}{%- for m in messages -%}{{ m['content'] }}{%- endfor -%}"
    builder = PromptBuilder(load_processing(tiny_model("llava"), chat_template=clock))
    messages = [{"role": "user", "content": "hi"}]
    assert len({builder.render(messages) for _ in range(3)}) > 1
    cached = PromptBuilder(load_processing(tiny_model("llava"), chat_template=PLAIN))
    assert cached.render(messages) is cached.render(messages)


def test_chat_template_kwargs_reach_the_template_by_the_names_it_reads(
    tiny_model: Callable[[str], Path],
) -> None:
    """As vLLM passes them: a variable the template reads is set, one it does not read changes nothing,
    and a name the render sets itself (the messages, the special tokens, …) is a 400 naming it."""
    from app.api.request_fields import template_variables

    styled = "{% if style %}({{ style }}) {% endif %}{{ bos_token }}" + PLAIN
    family = load_processing(tiny_model("llava"), chat_template=styled)
    messages = [{"role": "user", "content": "Hi"}]

    def render(**variables: Any) -> str:
        return family.render_prompt(
            messages, TemplateOptions(variables=template_variables(family, variables))
        )

    plain = render()
    assert render(style="terse") == "(terse) " + plain and render(enable_thinking=False) == plain
    assert family.template_variables.read(styled) >= {"style", "bos_token", "messages"}
    for name in ("messages", "add_generation_prompt", "bos_token", "tools", "_private", "not-a-name"):
        with pytest.raises(InvalidRequestError) as refused:
            render(**{name: "x"})
        assert refused.value.param == f"chat_template_kwargs.{name}"
    # the rendered prompt is cached by its template options too: a variable gives a prompt of its own
    builder = PromptBuilder(family)
    options = TemplateOptions(variables=template_variables(family, {"style": "a"}))
    assert builder.render(messages, options) != builder.render(messages, TemplateOptions())
