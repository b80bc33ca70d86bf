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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.api.chat_service import ChatService
from app.api.detokenizer import IncrementalDetokenizer
from app.api.disconnect import unless_client_leaves
from app.api.error_handlers import error_detail
from app.api.outputs import ChoiceOutputs, Generation
from app.api.request_guards import request_tenant
from app.api.response_items import (
    IMAGE_URLS,
    check_unique_ids,
    conversation_outputs,
    input_items,
    page,
    with_ids,
)
from app.api.response_store import ResponseStore, StoredResponse
from app.api.responses_api_schemas import (
    INCLUDABLE,
    ItemReference,
    ResponsesInput,
    ResponsesRequest,
    dump_items,
    parse_items,
)
from app.api.responses_chat import ResponsesParams, chat_request
from app.api.responses_output import OutputStream, answer_status, output_items
from app.api.responses_truncation import fitted
from app.api.schemas import ChatCompletionRequest
from app.api.tool_calls import ToolCallStreamer
from app.errors import (
    ContextLengthError,
    InvalidRequestError,
    MMServeError,
    ModelNotFoundError,
    NotFoundError,
    from_family_error,
)
from app.inputs.submission import Submitted, prompt_token_ids, submit
from workers.families.errors import FamilyInputError

RequestBody = TypeVar("RequestBody", bound=ResponsesInput)


class ResponsesService:
    def __init__(self, chat: ChatService, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create(self, body: ResponsesRequest, raw: Request) -> Response:
        tenant = request_tenant(raw.scope)
        body = await self._resolved(body, tenant)
        history = await self._history(body, tenant)
        check_unique_ids(history, body.input_items())
        arrival = time.time()
        try:
            chat_body, submitted = await self._submit(body, history, raw)
        except ContextLengthError:
            if body.truncation != "auto":
                raise
            room = self.chat.max_model_len - (body.max_output_tokens or 1)
            cut = await fitted(body, history, self._counter(raw), room)
            chat_body, submitted = await self._submit(*cut, raw)
        self.chat.metrics.prompt_tokens.inc(submitted.num_prompt_tokens)
        gen = Generation(
            req_id=submitted.choices[0].req_id,
            response_id=f"resp_{uuid.uuid4().hex}",
            index=0,
            model_name=self.chat.model_name,
            arrival=arrival,
            num_prompt_tokens=submitted.num_prompt_tokens,
            num_cached_tokens=submitted.choices[0].first.num_cached_tokens,
            want_logprobs=chat_body.logprobs,
            detok=IncrementalDetokenizer(self.chat.tokenizer),
            parse_tool_calls=chat_body.parses_tool_calls,
            stop_token_ids=frozenset(self.chat.inputs.family.eos_token_ids),
        )
        defaults = self.chat.defaults
        turn = _Turn(
            body,
            gen,
            tenant,
            [*history, *with_ids(dump_items(body.input_items()), gen.response_id)],
            body.store is not False and self.store.enabled,
            defaults.temperature if body.temperature is None else body.temperature,
            defaults.top_p if body.top_p is None else body.top_p,
        )
        outputs = ChoiceOutputs([gen], submitted, self.chat.engine, self.chat.metrics)
        if body.stream:
            return StreamingResponse(self._stream(turn, outputs), media_type="text/event-stream")
        await outputs.collect_while_connected(raw)
        return JSONResponse(await self._finished(turn, output_items(gen)))

    async def count_input_tokens(self, body: ResponsesInput, raw: Request) -> dict[str, Any]:
        """``POST /v1/responses/input_tokens``: the ``usage.input_tokens`` a response made from ``body``
        would have (its media processed through the processor cache; nothing reaches the engine)."""
        model = self.chat.model_name if body.model is None else body.model
        if model != self.chat.model_name:
            raise ModelNotFoundError(f"The model `{model}` does not exist.")
        tenant = request_tenant(raw.scope)
        body = await self._resolved(body, tenant)
        history = await self._history(body, tenant)
        check_unique_ids(history, body.input_items())
        request = ResponsesRequest.model_construct(**{**dict(body), "model": model})
        count = self._counter(raw)
        num_tokens = await count(request, history)
        if body.truncation == "auto" and num_tokens >= self.chat.max_model_len:  # (room for one token)
            num_tokens = await count(*await fitted(request, history, count, self.chat.max_model_len - 1))
        return {"object": "response.input_tokens", "input_tokens": num_tokens}

    async def _submit(
        self, body: ResponsesRequest, history: list[dict[str, Any]], raw: Request
    ) -> tuple[ChatCompletionRequest, Submitted]:
        """The request made from ``body`` after ``history``, sent to the engine; an error names the
        Responses fields."""
        chat_body, params = chat_request(body, parse_items(history))
        self.chat.check_ready(chat_body)
        with _named_by(params):
            spec = self.chat.spec(chat_body, raw)
            submitted = await unless_client_leaves(raw, submit(self.chat.inputs, self.chat.engine, spec))
        return chat_body, submitted

    def _counter(self, raw: Request) -> Callable[[ResponsesRequest, list[dict[str, Any]]], Awaitable[int]]:
        """Counts the prompt tokens of ``body`` after ``history``, as ``usage.input_tokens`` would."""

        async def count(body: ResponsesRequest, history: list[dict[str, Any]]) -> int:
            chat_body, params = chat_request(body, parse_items(history))
            with _named_by(params):
                spec = self.chat.spec(chat_body, raw)
                counting = prompt_token_ids(
                    self.chat.inputs, spec.messages, spec.mm_processor_kwargs, spec.scope, spec.template
                )
                return len(await unless_client_leaves(raw, counting))

        return count

    async def retrieve(self, response_id: str, raw: Request) -> dict[str, Any]:
        return (await self._stored(response_id, raw)).response

    async def list_input_items(
        self, response_id: str, raw: Request, after: str | None, limit: int, order: Literal["asc", "desc"]
    ) -> dict[str, Any]:
        """``GET /v1/responses/{id}/input_items``: the items the response was made from, a page of them."""
        stored = await self._stored(response_id, raw)
        include = [*raw.query_params.getlist("include"), *raw.query_params.getlist("include[]")]
        for value in include:
            if value not in INCLUDABLE:  # (all but the image URLs name what a stored item never lacks)
                msg = f"include {value!r} is not one of {sorted(INCLUDABLE)}"
                raise InvalidRequestError(msg, param="include")
        return page(input_items(stored.items, stored.response), after, limit, order, IMAGE_URLS in include)

    async def cancel(self, response_id: str, raw: Request) -> dict[str, Any]:
        """``POST /v1/responses/{id}/cancel``: only a background response can be; mmserve runs none, so a
        stored response is one already finished."""
        await self._stored(response_id, raw)
        raise InvalidRequestError(
            "Only a background response can be cancelled, and mmserve runs none: this response finished "
            "before it was returned.",
            param="response_id",
        )

    async def _stored(self, response_id: str, raw: Request) -> StoredResponse:
        stored = await asyncio.to_thread(self.store.get, request_tenant(raw.scope), response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored

    async def delete(self, response_id: str, raw: Request) -> dict[str, Any]:
        if not await asyncio.to_thread(self._delete, request_tenant(raw.scope), response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def _resolved(self, body: RequestBody, tenant: str) -> RequestBody:
        """``body`` with each ``item_reference`` of its input replaced by the stored item it names."""
        items = body.input_items()
        wanted = [item.id for item in items if isinstance(item, ItemReference)]
        if not wanted:
            return body
        found = await asyncio.to_thread(self.store.get_items, tenant, wanted)
        for index, item in enumerate(items):
            if isinstance(item, ItemReference) and item.id not in found:
                off = "" if self.store.enabled else " (this server stores no responses)"
                raise NotFoundError(f"Item with id '{item.id}' not found{off}.", param=f"input[{index}].id")
        resolved = [found[i.id] if isinstance(i, ItemReference) else i for i in items]
        return body.model_copy(update={"input": parse_items([_dumped(i) for i in resolved])})

    async def _history(self, body: ResponsesInput, tenant: str) -> list[dict[str, Any]]:
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
            conversation = [*turn.items, *conversation_outputs(items)]
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
        sequence = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            payload = {"type": kind, "sequence_number": next(sequence), **fields}
            return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

        gen = turn.gen
        try:
            started = response_object(turn, [], status="in_progress", with_output=False)
            yield event("response.created", response=started)
            yield event("response.in_progress", response=started)
            stream = OutputStream(
                gen.response_id, event, ToolCallStreamer() if gen.parse_tool_calls else None
            )
            async for delta in outputs.deltas():
                for text in stream.push(delta.text, delta.finish_reason is not None, delta.logprobs):
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


@dataclass(frozen=True)
class _Turn:
    """One response being made: its request, its answer, and what storing it takes."""

    body: ResponsesRequest
    gen: Generation
    tenant: str
    items: list[dict[str, Any]]  # the conversation up to this turn's input, as input items
    store: bool  # asked for, and the store is on
    temperature: float  # in effect: the request's, or the model's default
    top_p: float


@contextmanager
def _named_by(params: ResponsesParams) -> Iterator[None]:
    """An error of the chat request's checks names the Responses fields (a chat template's refusal too)."""
    try:
        yield
    except MMServeError as exc:
        params.error(exc)
        raise
    except FamilyInputError as exc:
        raise params.error(from_family_error(exc)) from exc


def _dumped(item: Any) -> dict[str, Any]:
    return item if isinstance(item, dict) else dump_items([item])[0]


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"No response found with id '{response_id}'.", param="response_id")


def response_object(
    turn: _Turn, items: list[dict[str, Any]], status: str | None = None, with_output: bool = True
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
        "temperature": turn.temperature,
        "top_p": turn.top_p,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": _tool_choice(body),
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "text": {"format": text_format},
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


def _tool_choice(body: ResponsesRequest) -> Any:
    if body.tool_choice is None:
        return "auto"
    return body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.model_dump()
