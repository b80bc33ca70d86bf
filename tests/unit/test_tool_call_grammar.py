"""The grammar of a ``tool_choice`` ``required`` answer (engine/structured/backend.py) on the tiny Qwen2.5-VL
tokenizer: calls only, one or more with parallel calls (a newline between two), then the end; never
text after them, which xgrammar's own tag for it allows."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

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
