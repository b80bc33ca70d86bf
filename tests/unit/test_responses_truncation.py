"""``truncation: "auto"`` (app/api/responses_truncation.py) without a server: the fewest oldest items are
dropped, a cut only before a user's (system's, developer's) message, never between a call and its
output; where nothing fits, the most that may be dropped is."""

from __future__ import annotations

import asyncio
from typing import Any

from app.api.responses_api_schemas import ResponsesRequest, dump_items
from app.api.responses_truncation import fitted

USER = {"type": "message", "role": "user", "content": "u"}
ANSWER = {"type": "message", "role": "assistant", "content": "a"}
CALL = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "c", "output": "o"}
# turns of 1, 3 and 2 items, then the request's own input (a user message)
HISTORY = [USER, USER, CALL, OUTPUT, USER, ANSWER]


def kept(room: int, history: list[dict[str, Any]] = HISTORY, new: Any = "now") -> list[str]:
    """What remains (item types, the input's last) when each item counts one token."""
    body = ResponsesRequest.model_validate({"model": "m", "input": new})
    counted: list[int] = []

    async def count(body: ResponsesRequest, history: list[dict[str, Any]]) -> int:
        counted.append(len(history) + len(body.input_items()))
        return counted[-1]

    cut_body, cut_history = asyncio.run(fitted(body, history, count, room))
    assert len(counted) <= 3  # bisection over the four cuts
    items = [*cut_history, *dump_items(cut_body.input_items())]
    return [str(item.get("role") or item["type"]) for item in items]


def test_the_fewest_oldest_items_are_dropped_at_a_turn_boundary() -> None:
    """Called once the whole conversation (7 items) did not fit: cuts leave 6, 3 or 1 item."""
    assert kept(6) == ["user", "function_call", "function_call_output", "user", "assistant", "user"]
    assert kept(5) == ["user", "assistant", "user"]  # not cut between a call and its output
    assert kept(3) == ["user", "assistant", "user"]
    assert kept(2) == kept(1) == ["user"]  # the request's own input alone
    assert kept(0) == ["user"]  # nothing fits: the most dropped (the request then fails as too long)


def test_a_cut_may_fall_inside_the_input_too() -> None:
    new = [USER, ANSWER, USER, ANSWER, USER]
    assert kept(3, history=[], new=new) == ["user", "assistant", "user"]
    assert kept(2, history=[], new=new) == ["user"]
