"""The ``response`` object of a turn (OpenAI's shape, as ``POST``/``GET /v1/responses`` return it) and
the numbered SSE events of a streamed one."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from app.api.json_out import json_text
from app.api.outputs import Generation
from app.api.response_store import Event
from app.api.responses_api_schemas import ResponsesRequest
from app.api.responses_output import answer_status


@dataclass(frozen=True)
class Turn:
    """One response being made: its request, its answer, and what storing it takes."""

    body: ResponsesRequest
    gen: Generation
    tenant: str
    items: list[dict[str, Any]]  # the conversation up to this turn's input, as input items
    store: bool  # asked for, and the store is on
    temperature: float  # in effect: the request's, or the model's default
    top_p: float
    background: bool = False  # made by a task after the queued object was returned


class Events:
    """Numbers a stream's events from ``first`` (``sequence_number``) and writes them as SSE text."""

    def __init__(self, first: int) -> None:
        self._numbers = itertools.count(first)
        self._made: list[Event] = []

    def make(self, kind: str, **fields: Any) -> Event:
        number = next(self._numbers)
        event = number, sse_event(kind, number, **fields)
        self._made.append(event)
        return event

    def text(self, kind: str, **fields: Any) -> str:
        """``make``'s text alone (as ``OutputStream`` writes its events)."""
        return self.make(kind, **fields)[1]

    def taken(self) -> list[Event]:
        """The events made since the last call, in their order."""
        made, self._made = self._made, []
        return made


def sse_event(kind: str, number: int, **fields: Any) -> str:
    payload = {"type": kind, "sequence_number": number, **fields}
    return f"event: {kind}\ndata: {json_text(payload)}\n\n"


def ending(response: dict[str, Any]) -> str:
    """The kind of the event that ends a stream with ``response`` (``response.completed``, ...)."""
    status = response["status"]
    return "response.completed" if status == "completed" else f"response.{status}"


def closing_event(number: int, response: dict[str, Any]) -> str:
    """The last event of a background response's log, made from its final object (``Closing``)."""
    return sse_event(ending(response), number, response=response)


def response_object(
    turn: Turn, items: list[dict[str, Any]], status: str | None = None, with_output: bool = True
) -> dict[str, Any]:
    """OpenAI's ``response`` object for the turn's answer with its output ``items``: ``completed``, or
    ``incomplete`` when the answer reached ``max_output_tokens`` (or the context length)."""
    body, gen = turn.body, turn.gen
    if status is None:
        status = answer_status(gen)
    text_format = (
        body.text.format.model_dump(by_alias=True, exclude_none=True)
        if body.text and body.text.format
        else {"type": "text"}
    )
    if text_format["type"] == "json_schema":
        text_format.setdefault("name", "response")  # the name applied where left out (OpenAI requires one)
    num_output = len(gen.token_ids)
    verbosity = body.text.verbosity if body.text and body.text.verbosity else "medium"
    return {
        "id": gen.response_id,
        "object": "response",
        "created_at": gen.created,
        "completed_at": _completed_at(gen) if status == "completed" else None,
        "status": status,
        "model": gen.model_name,
        "output": items if with_output else [],
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "background": turn.background,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": turn.temperature,
        "top_p": turn.top_p,
        "metadata": body.metadata or {},
        "user": body.user,
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
        "prompt_cache_retention": body.prompt_cache_retention,
        "max_tool_calls": body.max_tool_calls,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": tool_choice(body),
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "text": {"format": text_format, "verbosity": verbosity},
        "top_logprobs": body.top_logprobs or 0,
        "service_tier": "default",  # (the only tier there is)
        "truncation": body.truncation or "disabled",
        "store": turn.store,
        "previous_response_id": body.previous_response_id,
        "usage": {
            "input_tokens": gen.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": gen.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": gen.num_prompt_tokens + num_output,
        }
        if with_output
        else None,
    }


def _completed_at(gen: Generation) -> int:
    """When the answer ended: its last token's arrival (the same in each object made of it); one that
    ended before any token, at its arrival."""
    return int(gen.last_token_at if gen.last_token_at is not None else gen.arrival)


def tool_choice(body: ResponsesRequest) -> Any:
    if body.tool_choice is None:
        return "auto"
    return body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.model_dump()
