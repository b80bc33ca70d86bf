"""The grammar of a ``tool_choice`` ``required`` answer (engine/structured/backend.py) on the tiny Qwen2.5-VL
tokenizer: calls only, one or more with parallel calls (a newline between two), then the end; never
text after them, which xgrammar's own tag for it allows."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from app.api.tool_schemas import ChatTool, tool_constraint
from engine.structured.backend import XGrammarBackend
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
