"""Every chat-completions field of OpenAI's API and of vLLM is implemented, accepted without effect, or
refused by name (app/api/request_fields.py); a field no spec knows is kept aside for the log."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat.completion_create_params import CompletionCreateParamsBase
from pydantic import ValidationError

from app.api.request_fields import (
    MAX_NAMES_LOGGED,
    MAX_WARNED_FIELDS,
    REFUSED,
    WITHOUT_EFFECT,
    UnknownFields,
    unknown_field_names,
)
from app.api.schemas import ChatCompletionRequest
from app.api.tool_schemas import check_tools, tools_json

# vLLM 0.32's ChatCompletionRequest (vllm/entrypoints/openai/chat_completion/protocol.py), beyond OpenAI's
VLLM_FIELDS = [
    "thinking_token_budget",
    "include_reasoning",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "prompt_logprobs",
    "logprob_token_ids",
    "allowed_token_ids",
    "bad_words",
    "echo",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "structured_outputs",
    "priority",
    "request_id",
    "session_id",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "return_prompt_text",
    "mm_payload",
    "return_mm_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "repetition_detection",
]
OPENAI_FIELDS = sorted(CompletionCreateParamsBase.__annotations__)
BASE = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("name", sorted({*OPENAI_FIELDS, *VLLM_FIELDS}))
def test_every_known_field_is_sorted(name: str) -> None:
    """Implemented (a declared field), accepted without effect, or refused unless default: never both,
    never neither. A field the SDK adds in a new release fails here until it is sorted."""
    places = [name in ChatCompletionRequest.model_fields, name in WITHOUT_EFFECT, name in REFUSED]
    assert sum(places) == 1, (name, places)


@pytest.mark.parametrize("name", sorted(WITHOUT_EFFECT))
def test_a_field_without_effect_is_accepted_and_dropped(name: str) -> None:
    req = ChatCompletionRequest.model_validate({**BASE, name: "anything"})
    assert not req.model_extra


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_field_is_a_400_naming_it_unless_default(name: str) -> None:
    defaults, _ = REFUSED[name]
    for default in defaults:
        assert not ChatCompletionRequest.model_validate({**BASE, name: default}).model_extra
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({**BASE, name: {"something": 1}})
    error = info.value.errors()[0]
    assert error["loc"] == (name,) and name in error["msg"], error


@pytest.mark.parametrize(("value", "accepted"), [(False, True), (0, False), (True, False), (None, True)])
def test_a_default_matches_in_type_too(value: Any, accepted: bool) -> None:
    """``use_beam_search: 0`` is not ``false``: a refused field's default must be the very value."""
    body = {**BASE, "use_beam_search": value}
    if accepted:
        ChatCompletionRequest.model_validate(body)
    else:
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(body)


def test_an_unknown_field_is_kept_aside() -> None:
    req = ChatCompletionRequest.model_validate({**BASE, "frobnicate": 3, "user": "u"})
    assert req.model_extra == {"frobnicate": 3}


def test_unknown_field_names_are_logged_once_each_up_to_a_bound(caplog: pytest.LogCaptureFixture) -> None:
    """Made-up names grow neither the memory nor the log without bound: the first 256 are remembered
    and logged, 16 to a line, then one line says that no more are."""
    unknown = UnknownFields()

    def send(names: list[str]) -> list[str]:
        caplog.clear()
        body = ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "hi"}], **dict.fromkeys(names, 1)
        )
        unknown.log(unknown_field_names(body))
        return [record.getMessage() for record in caplog.records]

    with caplog.at_level("WARNING", logger="mmserve.api"):
        (line,) = send([f"x{i:03}" for i in range(200)])
        assert line.count("'x") == MAX_NAMES_LOGGED and "(and 184 more)" in line
        assert send(["x007"]) == []  # seen before
        lines = send([f"y{i:03}" for i in range(100)])  # 56 fit
        assert len(lines) == 2 and "(and 40 more)" in lines[0] and "not" in lines[1]
        assert len(unknown.warned) == MAX_WARNED_FIELDS
        assert send(["z"]) == []


def test_unknown_fields_in_messages_parts_and_tool_calls_are_named() -> None:
    """A misspelt or foreign key inside a message, a part or a tool call sent back is no longer dropped
    without a word: its path (without indices) is logged as a top-level one is."""
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief.", "nmae": "a"},
                {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "index": 0,
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ],
            "tools": [
                {
                    "type": "function",
                    "cache_control": {"type": "ephemeral"},
                    "function": {"name": "f", "parameters": {"type": "object"}, "x-hint": 1},
                }
            ],
            "frobnicate": 1,
        }
    )
    assert sorted(set(unknown_field_names(body))) == [
        "frobnicate",
        "messages[].content[].cache_control",
        "messages[].nmae",
        "messages[].tool_calls[].index",
        "tools[].cache_control",
        "tools[].function.x-hint",
    ]
    # taken as vLLM takes them, and never rendered into the template's tools
    check_tools(body.tools, None)
    assert json.loads(tools_json(body.tools or [])) == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
