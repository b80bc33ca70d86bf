"""The grammar of a ``tool_choice`` ``required`` answer (engine/structured/backend.py) on the tiny Qwen2.5-VL
tokenizer: calls only, one or more with parallel calls (a newline between two), then the end; never
text after them, which xgrammar's own tag for it allows."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from app.api.tool_schemas import AllowedToolChoice, ChatTool, tool_constraint
from engine.structured.backend import XGrammarBackend
from tests.e2e.structured_oracle import tool_calls_tag
from wire.protocol import Constraint, ConstraintKind

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("parallel", [True, False])
def test_a_required_answer_is_calls_and_nothing_after(
    tiny_model: Callable[[str], Path], parallel: bool
) -> None:
    import xgrammar as xgr

    backend = XGrammarBackend(str(tiny_model("qwen2_5_vl")), 0)
    spec = {"format": "qwen_3", "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": parallel}
    compiled = backend.compile(Constraint(ConstraintKind.TOOL_CALLS, json.dumps(spec)))

    def accepts(text: str) -> bool:
        return bool(xgr.GrammarMatcher(compiled).accept_string(text))

    def ends_after(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return bool(matcher.accept_string(text) and matcher.is_completed())

    assert not accepts("Sure") and accepts(CALL) and ends_after(CALL)
    assert not accepts(CALL + " and some text") and not accepts(CALL + "\nSure")
    assert accepts(CALL + "\n" + CALL) is parallel


def test_arguments_are_an_object_whatever_the_schema_leaves_out(tiny_model: Callable[[str], Path]) -> None:
    """A schema without ``type`` or ``properties`` (JSON Schema then allows any value) still constrains a
    call's arguments to an object: anything else could not be parsed as a call and would leak into
    content."""
    import xgrammar as xgr

    backend = XGrammarBackend(str(tiny_model("qwen2_5_vl")), 0)
    untyped = {"name": "f", "parameters": {"description": "no type, no properties"}}
    constraint = tool_constraint(
        [ChatTool.model_validate({"type": "function", "function": untyped})], "required", False, "hermes"
    )
    assert constraint is not None
    compiled = backend.compile(constraint)

    def accepts(arguments: str) -> bool:
        call = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
        return bool(xgr.GrammarMatcher(compiled).accept_string(call))

    assert accepts('{"x": 1}') and not accepts("5") and not accepts("[1]")


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_allowed_tools_constrain_calls_to_them_and_equal_xgrammars_own(
    tiny_model: Callable[[str], Path], mode: str
) -> None:
    """``allowed_tools``: its mode over the allowed tools only; the grammar is xgrammar's own for the
    same ``allowed_tools`` choice over all the tools (the same language, checked on calls of each)."""
    import xgrammar as xgr

    backend = XGrammarBackend(str(tiny_model("qwen2_5_vl")), 0)
    tools = [TOOL, {**TOOL, "function": {**TOOL["function"], "name": "g"}}]  # type: ignore[dict-item]
    refs = [{"type": "function", "function": {"name": "g"}}]
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": refs}}
    chat_tools = [ChatTool.model_validate(tool) for tool in tools]
    constraint = tool_constraint(chat_tools, AllowedToolChoice.model_validate(choice), False, "hermes")
    assert constraint is not None
    ours = backend.compile(constraint)
    theirs = backend._compiler.compile_structural_tag(tool_calls_tag(tools, choice, parallel=False))
    call_g = CALL.replace('"f"', '"g"')
    # answer -> (accepted whole under auto, under required)
    answers = {
        "Sure.": (True, False),
        CALL: (False, False),  # f is declared, not allowed
        call_g: (True, True),
        "Sure. " + call_g: (True, False),
        "Sure. " + CALL: (False, False),
    }
    for answer, expected in answers.items():
        verdicts = []
        for compiled in (ours, theirs):
            matcher = xgr.GrammarMatcher(compiled)
            verdicts.append(bool(matcher.accept_string(answer) and matcher.is_completed()))
        assert verdicts == [expected[mode == "required"]] * 2, answer


def test_allowed_tools_must_be_declared() -> None:
    from app.api.tool_schemas import check_tools
    from app.errors import InvalidRequestError

    choice = {
        "type": "allowed_tools",
        "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "h"}}]},
    }
    with pytest.raises(InvalidRequestError) as caught:
        check_tools([ChatTool.model_validate(TOOL)], AllowedToolChoice.model_validate(choice))
    assert caught.value.param == "tool_choice.allowed_tools.tools[0].function.name"


@pytest.mark.parametrize("any_whitespace", [False, True])
def test_an_output_format_beside_tools_is_its_json_alone_or_calls_alone(
    tiny_model: Callable[[str], Path], any_whitespace: bool
) -> None:
    """Under ``auto`` the format's JSON (as its own constraint compiles it: compact, exact patterns) or
    calls; under ``required`` calls only; json_object any object."""
    import xgrammar as xgr

    backend = XGrammarBackend(str(tiny_model("qwen2_5_vl")), 0)
    code = {"type": "string", "pattern": "^[A-Z]{3}( [0-9]+)?$"}
    report = {"type": "object", "properties": {"a": {"type": "integer"}, "c": code}, "required": ["a", "c"]}
    tool = ChatTool.model_validate(
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": code}}},
        }
    )
    texts = [
        '{"a": 1, "c": "ABC"}',
        '{ "a" : 1, "c" : "ABC" }',
        '{"a": 1, "c": "ABC12"}',  # the pattern forbids it
        '{"z": 1}',
        '<tool_call>\n{"name": "f", "arguments": {"x": "ABC 1"}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"x": "ABC1"}}\n</tool_call>',
        '{"a": 1, "c": "ABC"}\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        "Sure.",
    ]
    formats = {
        "schema": Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(report), any_whitespace),
        "object": Constraint(ConstraintKind.JSON_OBJECT, "", any_whitespace),
    }
    spaced = any_whitespace
    expected = {
        ("schema", "auto"): [True, spaced, False, False, True, False, False, False],
        ("object", "auto"): [True, spaced, True, True, True, False, False, False],
        ("schema", "required"): [False, False, False, False, True, False, False, False],
    }
    for (kind, choice), wanted in expected.items():
        constraint = tool_constraint([tool], choice, True, "hermes", formats[kind])
        assert constraint is not None
        compiled = backend.compile(constraint)

        def whole(text: str, compiled: object = compiled) -> bool:
            matcher = xgr.GrammarMatcher(compiled)
            return bool(matcher.accept_string(text) and matcher.is_completed())

        assert [whole(text) for text in texts] == wanted, (kind, choice)
