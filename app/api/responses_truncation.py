"""``truncation: "auto"`` on ``POST /v1/responses`` (docs/api.md, "Responses"): where the conversation
does not fit the context with room for the answer, its oldest items are dropped, as OpenAI's, until it
does. A cut is made only before a message of the user (or the system or developer): never between a call
and its output, nor inside an answer. The fewest items are dropped: the prompt only shrinks as more are,
so the first cut that fits is found by bisection, each try counted as ``usage.input_tokens`` would be
(media through the processor cache, so only the first count processes them). The instructions are never
dropped, and the stored conversation stays whole: a follow-up is cut anew."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from app.api.responses_api_schemas import InputMessage, ResponsesInput

Body = TypeVar("Body", bound=ResponsesInput)
History = list[dict[str, Any]]  # a stored conversation's items, as the store keeps them


async def fitted(
    body: Body, history: History, count: Callable[[Body, History], Awaitable[int]], room: int
) -> tuple[Body, History]:
    """``body`` and ``history`` without their oldest items, the fewest whose prompt (``count``) is at most
    ``room`` tokens; where no cut fits, the last one (its request then fails as too long, as before)."""
    items: list[Any] = [*history, *body.input_items()]
    cuts = [c for c in range(1, len(items)) if _opens_a_turn(items[c])]
    if not cuts:
        return body, history
    low, high = 0, len(cuts) - 1  # the first cut that fits is in cuts[low:high + 1] (or none does)
    while low < high:
        middle = (low + high) // 2
        if await count(*_cut(body, history, cuts[middle])) <= room:
            high = middle
        else:
            low = middle + 1
    return _cut(body, history, cuts[low])


def _opens_a_turn(item: Any) -> bool:
    if isinstance(item, dict):
        return item.get("type", "message") == "message" and item.get("role") != "assistant"
    return isinstance(item, InputMessage) and item.role != "assistant"


def _cut(body: Body, history: History, at: int) -> tuple[Body, History]:
    if at <= len(history):
        return body, history[at:]
    return body.model_copy(update={"input": body.input_items()[at - len(history) :]}), []
