"""Serves ``POST /v1/responses``: the body is translated at the edge into the chat request every endpoint
shares (app/api/responses_chat.py, which also names its errors' fields back), goes through the same input
path (``submit``) and output path (``ChoiceOutputs``), and the answer is formatted as OpenAI's
``response`` object, or as its typed stream of events (``response.created`` …
``response.output_text.delta`` … ``response.completed``, numbered by ``sequence_number``).

A response asked to be stored (``store``, true by default) is kept with its conversation in the response
store (app/api/response_store.py) before its object is returned (or its ``response.completed`` event
sent), so a follow-up by ``previous_response_id`` is that conversation plus its own input."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.api.chat_service import ChatService
from app.api.detokenizer import IncrementalDetokenizer
from app.api.disconnect import unless_client_leaves
from app.api.error_handlers import error_detail
from app.api.outputs import ChoiceOutputs, Generation
from app.api.request_guards import request_tenant
from app.api.response_store import ResponseStore
from app.api.responses_api_schemas import ResponsesRequest, dump_items, parse_items
from app.api.responses_chat import chat_request
from app.api.tool_calls import (
    OPEN_TAG,
    ContentDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStreamer,
    parse_tool_calls,
)
from app.errors import MMServeError, NotFoundError, from_family_error
from app.inputs.submission import submit
from workers.families.errors import FamilyInputError


class ResponsesService:
    def __init__(self, chat: ChatService, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create(self, body: ResponsesRequest, raw: Request) -> Response:
        tenant = request_tenant(raw.scope)
        history = await self._history(body, tenant)
        chat_body, params = chat_request(body, parse_items(history))
        self.chat.check_ready(chat_body)
        try:
            spec = self.chat.spec(chat_body, raw)
            arrival = time.time()
            submitted = await unless_client_leaves(raw, submit(self.chat.inputs, self.chat.engine, spec))
        except MMServeError as exc:  # it names the chat request's fields: name the Responses ones
            params.error(exc)
            raise
        except FamilyInputError as exc:  # (a chat template's refusal, say)
            raise params.error(from_family_error(exc)) from exc
        self.chat.metrics.prompt_tokens.inc(submitted.num_prompt_tokens)
        gen = Generation(
            req_id=submitted.choices[0].req_id,
            response_id=f"resp_{uuid.uuid4().hex}",
            index=0,
            model_name=self.chat.model_name,
            arrival=arrival,
            num_prompt_tokens=submitted.num_prompt_tokens,
            num_cached_tokens=submitted.choices[0].first.num_cached_tokens,
            want_logprobs=False,
            detok=IncrementalDetokenizer(self.chat.tokenizer),
            parse_tool_calls=chat_body.parses_tool_calls,
            stop_token_ids=frozenset(self.chat.inputs.family.eos_token_ids),
        )
        turn = _Turn(
            body,
            gen,
            tenant,
            [*history, *dump_items(body.input_items())],
            body.store is not False and self.store.enabled,
        )
        outputs = ChoiceOutputs([gen], submitted, self.chat.engine, self.chat.metrics)
        if body.stream:
            return StreamingResponse(self._stream(turn, outputs), media_type="text/event-stream")
        await outputs.collect_while_connected(raw)
        return JSONResponse(await self._finished(turn, output_items(gen, f"msg_{uuid.uuid4().hex}")))

    async def retrieve(self, response_id: str, raw: Request) -> dict[str, Any]:
        stored = await asyncio.to_thread(self.store.get, request_tenant(raw.scope), response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored.response

    async def delete(self, response_id: str, raw: Request) -> dict[str, Any]:
        if not await asyncio.to_thread(self._delete, request_tenant(raw.scope), response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def _history(self, body: ResponsesRequest, tenant: str) -> list[dict[str, Any]]:
        """The stored conversation ``previous_response_id`` ends, as input items (none without one)."""
        if body.previous_response_id is None:
            return []
        stored = await asyncio.to_thread(self.store.get, tenant, body.previous_response_id)
        if stored is None:
            off = "" if self.store.enabled else " (this server stores no responses)"
            raise NotFoundError(
                f"Previous response with id '{body.previous_response_id}' not found{off}.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return stored.items

    async def _finished(self, turn: _Turn, items: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished ``response`` object, stored first (with its conversation) where asked for, so a
        client that reads it may chain on it at once. A call cut off by the max tokens stays out of the
        conversation: its arguments are no object to render or to answer."""
        response = response_object(turn, items)
        if turn.store:
            kept = [i for i in items if not (i["type"] == "function_call" and i["status"] == "incomplete")]
            conversation = [*turn.items, *kept]
            response["store"] = await asyncio.to_thread(self._put, turn, conversation, response)
        return response

    def _put(self, turn: _Turn, conversation: list[dict[str, Any]], response: dict[str, Any]) -> bool:
        """On a thread: store the response, then count what that did."""
        num_evicted = self.store.put(turn.tenant, turn.gen.response_id, conversation, response)
        self._count(num_evicted or 0)
        return num_evicted is not None

    def _delete(self, tenant: str, response_id: str) -> bool:
        """On a thread: delete the response, then count what that left."""
        deleted = self.store.delete(tenant, response_id)
        self._count(0)
        return deleted

    def _count(self, num_evicted: int) -> None:
        """The store's figures on /metrics; called on the store's thread (``totals`` takes its lock)."""
        metrics = self.chat.metrics
        metrics.responses_evicted.inc(num_evicted)
        num_responses, num_bytes = self.store.totals()
        metrics.responses_stored.set(num_responses)
        metrics.responses_stored_bytes.set(num_bytes)

    async def _stream(self, turn: _Turn, outputs: ChoiceOutputs) -> AsyncIterator[str]:
        message_id = f"msg_{uuid.uuid4().hex}"
        sequence = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            payload = {"type": kind, "sequence_number": next(sequence), **fields}
            return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

        gen = turn.gen
        try:
            started = response_object(turn, [], status="in_progress", with_output=False)
            yield event("response.created", response=started)
            yield event("response.in_progress", response=started)
            stream = _OutputStream(message_id, event, ToolCallStreamer() if gen.parse_tool_calls else None)
            async for delta in outputs.deltas():
                for text in stream.push(delta.text, last=delta.finish_reason is not None):
                    yield text
            closing, items = stream.finish(gen)
            for text in closing:
                yield text
            finished = await self._finished(turn, items)
            kind = "response.completed" if finished["status"] == "completed" else "response.incomplete"
            yield event(kind, response=finished)
        except MMServeError as exc:
            _, detail = error_detail(exc)
            yield event("error", code=detail.code, message=detail.message, param=detail.param)
        finally:
            outputs.release()


def _message(message_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    """The output item of a response's text: the assistant's message."""
    return {"id": message_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _function_call(call: ToolCall, status: str = "completed", arguments: str | None = None) -> dict[str, Any]:
    """The output item of one call: its ``call_id`` is what a ``function_call_output`` answers."""
    return {
        "id": f"fc_{call.id.removeprefix('call_')}",
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if arguments is None else arguments,
    }


def output_items(gen: Generation, message_id: str) -> list[dict[str, Any]]:
    """A finished answer's output items: its text as a message (unless a call-parsing answer has none)
    and its calls (one cut off by the max tokens ``incomplete``), in the order the answer began them, as
    the stream adds them."""
    if not gen.parse_tool_calls:
        return [_message(message_id, _status(gen), [_text_part(gen.text)])]
    parsed = parse_tool_calls(gen.text)
    items = [
        _function_call(call, "completed" if call.complete else "incomplete") for call in parsed.tool_calls
    ]
    if parsed.content is not None or not items:
        text_first = not items or bool(gen.text[: gen.text.find(OPEN_TAG)].strip())
        message = _message(message_id, _status(gen), [_text_part(parsed.content or "")])
        items.insert(0 if text_first else len(items), message)
    return items


def _status(gen: Generation) -> str:
    return "incomplete" if gen.finish_reason == "length" else "completed"


Event = Callable[..., str]


class _OutputStream:
    """A streamed answer's output-item events, built as its text arrives: the message opened with its
    first text (at once for an answer that parses no calls) and each call once it closed (app/api/
    tool_calls.py), in output order; ``finish`` closes what is open and returns the items, with the
    ids the events used, for the final ``response`` object."""

    def __init__(self, message_id: str, event: Event, calls: ToolCallStreamer | None) -> None:
        self.message_id, self.event, self.calls = message_id, event, calls
        self.items: list[dict[str, Any]] = []
        self.text: str | None = None  # the message's text, once opened
        self.where: dict[str, Any] = {}
        self.opened: list[str] = [] if calls is not None else self._open()

    def _open(self) -> list[str]:
        self.text = ""
        self.where = {"item_id": self.message_id, "output_index": len(self.items), "content_index": 0}
        self.items.append(_message(self.message_id, "in_progress", []))
        return [
            self.event("response.output_item.added", output_index=len(self.items) - 1, item=self.items[-1]),
            self.event("response.content_part.added", part=_text_part(""), **self.where),
        ]

    def push(self, text: str, last: bool) -> list[str]:
        events, self.opened = self.opened, []
        pieces: list[ContentDelta | ToolCallDelta]
        if self.calls is None:
            pieces = [ContentDelta(text)] if text else []
        else:
            pieces = self.calls.push(text) + (self.calls.finish() if last else [])
        for piece in pieces:
            if isinstance(piece, ContentDelta):
                if self.text is None:
                    events += self._open()
                self.text = (self.text or "") + piece.content
                events.append(
                    self.event("response.output_text.delta", delta=piece.content, logprobs=[], **self.where)
                )
            elif piece.id is not None:  # a call's first delta: its id and name
                call = ToolCall(piece.id, piece.name or "", "")
                self.items.append(_function_call(call, "in_progress", ""))
                events.append(
                    self.event(
                        "response.output_item.added", output_index=len(self.items) - 1, item=self.items[-1]
                    )
                )
            else:
                index, item = len(self.items) - 1, self.items[-1]
                item.update(arguments=piece.arguments, status="completed" if piece.complete else "incomplete")
                where = {"item_id": item["id"], "output_index": index}
                events.append(
                    self.event("response.function_call_arguments.delta", delta=piece.arguments, **where)
                )
                events.append(
                    self.event("response.function_call_arguments.done", arguments=piece.arguments, **where)
                )
                events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def finish(self, gen: Generation) -> tuple[list[str], list[dict[str, Any]]]:
        events = self.opened
        if self.text is None and not self.items:  # nothing at all: an empty message, as without calls
            events += self._open()
        if self.text is not None:
            index = self.where["output_index"]
            self.items[index] = _message(self.message_id, _status(gen), [_text_part(self.text)])
            events += [
                self.event("response.output_text.done", text=self.text, logprobs=[], **self.where),
                self.event("response.content_part.done", part=_text_part(self.text), **self.where),
                self.event("response.output_item.done", output_index=index, item=self.items[index]),
            ]
        return events, self.items


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass(frozen=True)
class _Turn:
    """One response being made: its request, its answer, and what storing it takes."""

    body: ResponsesRequest
    gen: Generation
    tenant: str
    items: list[dict[str, Any]]  # the conversation up to this turn's input, as input items
    store: bool  # asked for, and the store is on


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"No response found with id '{response_id}'.", param="response_id")


def response_object(
    turn: _Turn, items: list[dict[str, Any]], status: str | None = None, with_output: bool = True
) -> dict[str, Any]:
    """OpenAI's ``response`` object for the turn's answer with its output ``items``: ``completed``, or
    ``incomplete`` when the answer reached ``max_output_tokens`` (or the context length)."""
    body, gen = turn.body, turn.gen
    if status is None:
        status = _status(gen)
    text_format = (
        body.text.format.model_dump(by_alias=True, exclude_none=True)
        if body.text and body.text.format
        else {"type": "text"}
    )
    if text_format["type"] == "json_schema":
        text_format.setdefault("name", "response")  # the name applied where left out (OpenAI requires one)
    num_output = len(gen.token_ids)
    return {
        "id": gen.response_id,
        "object": "response",
        "created_at": gen.created,
        "status": status,
        "model": gen.model_name,
        "output": items if with_output else [],
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": _tool_choice(body),
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "text": {"format": text_format},
        "truncation": "disabled",
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


def _tool_choice(body: ResponsesRequest) -> Any:
    if body.tool_choice is None:
        return "auto"
    return body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.model_dump()
