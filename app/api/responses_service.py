"""Serves ``POST /v1/responses``: the body is translated at the edge into the chat request every endpoint
shares (app/api/responses_chat.py, which also names its errors' fields back), goes through the same input
path (``submit``) and output path (``ChoiceOutputs``), and the answer is formatted as OpenAI's
``response`` object, or as its typed stream of events (``response.created`` …
``response.output_text.delta`` … ``response.completed``, numbered by ``sequence_number``).

A response asked to be stored (``store``, true by default) is kept with its conversation in the response
store (app/api/response_store.py) before its object is returned (or its ``response.completed`` event
sent), so a follow-up by ``previous_response_id`` is that conversation plus its own input. A background
one (``background``) is stored ``queued`` and returned at once; a task makes it through the same output
path and stores it in its place (app/api/responses_background.py; docs/architecture.md, "Background
responses")."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.api.chat_service import ChatService
from app.api.detokenizer import IncrementalDetokenizer
from app.api.disconnect import unless_client_leaves
from app.api.error_handlers import error_detail
from app.api.json_out import JSONOut
from app.api.outputs import ChoiceOutputs, Generation
from app.api.request_guards import request_tenant
from app.api.response_items import (
    check_unique_ids,
    conversation_outputs,
    with_ids,
)
from app.api.response_store import RUNNING, Event, ResponseStore
from app.api.responses_api_schemas import (
    ItemReference,
    ResponsesInput,
    ResponsesRequest,
    dump_items,
    parse_items,
)
from app.api.responses_background import RESUBMIT_MAX_DELAY_S, BackgroundResponses, process_identity
from app.api.responses_chat import ResponsesParams, chat_request
from app.api.responses_object import Events, Turn, closing_event, ending, response_object
from app.api.responses_output import OutputStream, output_items
from app.api.responses_stored import StoredResponses
from app.api.responses_truncation import fitted
from app.api.schemas import ChatCompletionRequest
from app.api.tool_schemas import answers_or_calls
from app.errors import (
    ContextLengthError,
    InvalidRequestError,
    MMServeError,
    ModelNotFoundError,
    NotFoundError,
    TooManyRequestsError,
    from_family_error,
)
from app.inputs.submission import Submitted, prompt_token_ids, submit
from workers.families.errors import FamilyInputError

RequestBody = TypeVar("RequestBody", bound=ResponsesInput)


@dataclasses.dataclass(frozen=True)
class _Submission:
    """A response's answer running in the engine, and the request it was made as."""

    chat_body: ChatCompletionRequest
    submitted: Submitted
    answer_or_calls: bool  # (Generation's)


class ResponsesService:
    def __init__(self, chat: ChatService, store: ResponseStore, background: BackgroundResponses) -> None:
        self.chat = chat
        self.store = store
        self.background = background
        self.stored = StoredResponses(store, background, chat.metrics)
        background.on_end = lambda: self.stored.count(0)

    async def create(self, body: ResponsesRequest, raw: Request) -> Response:
        tenant = request_tenant(raw.scope)
        self._check_background(body)
        body = await self._resolved(body, tenant)
        history = await self._history(body, tenant)
        check_unique_ids(history, body.input_items())
        arrival, response_id = time.time(), f"resp_{uuid.uuid4().hex}"
        if body.background:
            await self._check_input(body, history, raw)
            turn = await self._turn(body, history, tenant, self._generation(response_id, arrival))
            return await self._start_background(turn, history, raw)
        submission = await self._submit(body, history, raw)
        gen = self._generation(response_id, arrival, submission)
        turn = await self._turn(body, history, tenant, gen)
        outputs = ChoiceOutputs([gen], submission.submitted.choices, self.chat.engine, self.chat.metrics)
        if body.stream:
            return StreamingResponse(self._stream(turn, outputs), media_type="text/event-stream")
        await outputs.collect_while_connected(raw)
        return JSONOut(await self._finished(turn, output_items(gen)))

    def _generation(
        self, response_id: str, arrival: float, submission: _Submission | None = None
    ) -> Generation:
        """The answer's state; before it is submitted (a background response's queued object), empty."""
        submitted = submission.submitted if submission is not None else None
        if submitted is not None:
            self.chat.metrics.prompt_tokens.inc(submitted.num_prompt_tokens)
        return Generation(
            req_id=submitted.choices[0].req_id if submitted is not None else "",
            response_id=response_id,
            index=0,
            model_name=self.chat.model_name,
            arrival=arrival,
            num_prompt_tokens=submitted.num_prompt_tokens if submitted is not None else 0,
            num_cached_tokens=submitted.choices[0].first.num_cached_tokens if submitted is not None else 0,
            want_logprobs=submission is not None and submission.chat_body.logprobs,
            detok=IncrementalDetokenizer(self.chat.tokenizer),
            parse_tool_calls=submission is not None and submission.chat_body.parses_tool_calls,
            answer_or_calls=submission is not None and submission.answer_or_calls,
            stop_token_ids=frozenset(self.chat.inputs.family.eos_token_ids),
        )

    async def _turn(
        self, body: ResponsesRequest, history: list[dict[str, Any]], tenant: str, gen: Generation
    ) -> Turn:
        """A stored response's input already over the store's byte bound says ``store`` false from its
        first event on."""
        defaults = self.chat.defaults
        items = [*history, *with_ids(dump_items(body.input_items()), gen.response_id)]
        store = body.store is not False and await asyncio.to_thread(self.store.holds, items)
        return Turn(
            body,
            gen,
            tenant,
            items,
            store,
            defaults.temperature if body.temperature is None else body.temperature,
            defaults.top_p if body.top_p is None else body.top_p,
            background=body.background is True,
        )

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
        self, body: ResponsesRequest, history: list[dict[str, Any]], raw: Request, watched: bool = True
    ) -> _Submission:
        """The request made from ``body`` after ``history``, sent to the engine (with ``truncation``
        auto, its oldest turns dropped to fit); an error names the Responses fields. ``watched``: the
        work stops if the client leaves (not for a background response, whose client left at once)."""
        try:
            return await self._submit_as_is(body, history, raw, watched)
        except ContextLengthError:
            if body.truncation != "auto":
                raise
            room = self.chat.max_model_len - (body.max_output_tokens or 1)
            cut = await fitted(body, history, self._counter(raw, watched), room)
            return await self._submit_as_is(*cut, raw, watched)

    async def _submit_as_is(
        self, body: ResponsesRequest, history: list[dict[str, Any]], raw: Request, watched: bool
    ) -> _Submission:
        chat_body, params = chat_request(body, parse_items(history))
        self.chat.check_ready(chat_body)
        with _named_by(params):
            spec = self.chat.spec(chat_body, raw)
            submitting = submit(self.chat.inputs, self.chat.engine, spec)
            submitted = await (unless_client_leaves(raw, submitting) if watched else submitting)
        return _Submission(chat_body, submitted, answers_or_calls(spec.constraint))

    async def _check_input(self, body: ResponsesRequest, history: list[dict[str, Any]], raw: Request) -> None:
        """What submitting would refuse before the engine (the template, the media, the sampling, a
        prompt too long even cut with ``truncation`` auto) as the 400 it is: a background response is
        submitted by its task, after its object was returned."""
        try:
            await self._check_as_is(body, history, raw)
        except ContextLengthError:
            if body.truncation != "auto":
                raise
            room = self.chat.max_model_len - (body.max_output_tokens or 1)
            await self._check_as_is(*await fitted(body, history, self._counter(raw), room), raw)

    async def _check_as_is(self, body: ResponsesRequest, history: list[dict[str, Any]], raw: Request) -> None:
        await self._count(body, history, raw, watched=True, checked=True)

    def _counter(
        self, raw: Request, watched: bool = True
    ) -> Callable[[ResponsesRequest, list[dict[str, Any]]], Awaitable[int]]:
        """Counts the prompt tokens of ``body`` after ``history``, as ``usage.input_tokens`` would."""
        return lambda body, history: self._count(body, history, raw, watched)

    async def _count(
        self,
        body: ResponsesRequest,
        history: list[dict[str, Any]],
        raw: Request,
        watched: bool,
        checked: bool = False,
    ) -> int:
        """The prompt tokens of ``body`` after ``history`` (its media processed through the processor
        cache); ``checked``: also what submitting it would refuse before the engine (the model, the
        sampling, the context)."""
        chat_body, params = chat_request(body, parse_items(history))
        if checked:
            self.chat.check_ready(chat_body)
        with _named_by(params):
            spec = self.chat.spec(chat_body, raw)
            counting = prompt_token_ids(
                self.chat.inputs, spec.messages, spec.mm_processor_kwargs, spec.scope, spec.template
            )
            num_tokens = len(await (unless_client_leaves(raw, counting) if watched else counting))
            if checked:
                spec.sampling(num_tokens, 0)
        return num_tokens

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
        status = stored.response["status"]
        if status in (*RUNNING, "cancelled", "failed"):
            wait = ": wait until it ends" if status in RUNNING else ", with no answer to follow"
            raise InvalidRequestError(
                f"Previous response with id '{body.previous_response_id}' is {status}{wait}.",
                param="previous_response_id",
            )
        return stored.items

    def _check_background(self, body: ResponsesRequest) -> None:
        """A background response is kept in the store, where its client finds it."""
        if body.background:
            if body.store is False:
                raise InvalidRequestError(
                    "A background response is stored: store must be true.", param="store"
                )
            if not self.store.enabled:
                raise InvalidRequestError(
                    "A background response is stored, and this server stores no responses.",
                    param="background",
                )
        elif body.background_options and body.background_options.completion_window not in (None, "soonest"):
            raise InvalidRequestError(
                "A completion window of 2h or 8h is for background responses.",
                param="background_options.completion_window",
            )

    async def _start_background(self, turn: Turn, history: list[dict[str, Any]], raw: Request) -> Response:
        """Stores the response ``queued`` (a streamed one with its log's first events), starts its task,
        and answers with the stored object, or with its log's events as they are written."""
        key = (turn.tenant, turn.gen.response_id)
        queued = response_object(turn, [], status="queued", with_output=False)
        events = Events(0)
        first = [events.make(kind, response=queued) for kind in ("response.created", "response.queued")]
        log = first if turn.body.stream else None
        if not await asyncio.to_thread(
            self._put, turn, turn.items, queued, log, process_identity(os.getpid())
        ):
            raise InvalidRequestError(
                "The request is larger than the response store holds, so it cannot run in the background.",
                param="background",
            )
        self.background.run(key, self._make_background(turn, history, raw, events))
        if turn.body.stream:
            return StreamingResponse(self.background.events(key, -1), media_type="text/event-stream")
        return JSONResponse(queued)

    async def _make_background(
        self, turn: Turn, history: list[dict[str, Any]], raw: Request, events: Events
    ) -> None:
        """A background response's task: submitted (again while the engine is too busy to take it: it
        stays queued), answered (a streamed one's events into its log as they come) and stored in place
        of the running one; an error (the engine's) ends it failed."""
        key = (turn.tenant, turn.gen.response_id)
        outputs = None
        try:
            delay = 0.05
            while True:  # (a cancel or the process's end cancels the wait)
                try:
                    submission = await self._submit(turn.body, history, raw, watched=False)
                    break
                except TooManyRequestsError:
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, RESUBMIT_MAX_DELAY_S)
            gen = self._generation(turn.gen.response_id, turn.gen.arrival, submission)
            turn = dataclasses.replace(turn, gen=gen)
            outputs = ChoiceOutputs([gen], submission.submitted.choices, self.chat.engine, self.chat.metrics)
            await asyncio.to_thread(self.store.set_status, *key, "in_progress")
            if turn.body.stream:
                async with contextlib.aclosing(self._events(turn, outputs, events)) as stream:
                    async for event in stream:
                        if not await asyncio.to_thread(self.store.append_events, *key, [event]):
                            return  # cancelled or deleted (its task is being cancelled too)
                        self.background.notify(key)
            else:
                await outputs.collect()
                await self._finished(turn, output_items(gen))
        except MMServeError as exc:
            await asyncio.to_thread(self.store.set_status, *key, "failed", failure(exc), closing_event)
        finally:
            if outputs is not None:
                outputs.release()  # (aborted in the engine if it did not end)
            await asyncio.to_thread(self.stored.count, 0)

    async def _finished(self, turn: Turn, items: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished ``response`` object, stored first (with its conversation) where asked for, so a
        client that reads it may chain on it at once; a background response's replaces its running one
        (with its log's last event). A call cut off by the max tokens stays out of the conversation: its
        arguments are no object to render or to answer."""
        response = response_object(turn, items)
        if turn.store:
            conversation = [*turn.items, *conversation_outputs(items)]
            response["store"] = await asyncio.to_thread(self._put, turn, conversation, response)
        return response

    def _put(
        self,
        turn: Turn,
        conversation: list[dict[str, Any]],
        response: dict[str, Any],
        events: list[Event] | None = None,
        maker: str | None = None,
    ) -> bool:
        """On a thread: store the response (a running background one: as it starts with its first
        ``events`` and its ``maker``; as it ends, replacing it), then count what that did."""
        key = (turn.tenant, turn.gen.response_id)
        if turn.background and response["status"] not in RUNNING:
            num_evicted = self.store.finish(*key, conversation, response, closing_event)
        else:
            num_evicted = self.store.put(*key, conversation, response, events, maker)
        self.stored.count(num_evicted or 0)
        return num_evicted is not None

    async def _stream(self, turn: Turn, outputs: ChoiceOutputs) -> AsyncIterator[str]:
        async with contextlib.aclosing(self._events(turn, outputs, Events(0))) as events:
            async for _, text in events:
                yield text

    async def _events(self, turn: Turn, outputs: ChoiceOutputs, events: Events) -> AsyncGenerator[Event]:
        """The events of a streamed answer (a background response's from ``response.in_progress`` on: the
        ones before are stored with it). Its last one (``response.completed``, ``incomplete`` or
        ``failed``) is written with a background response's end, not yielded."""
        gen = turn.gen
        try:
            started = response_object(turn, [], status="in_progress", with_output=False)
            if not turn.background:
                events.make("response.created", response=started)
            events.make("response.in_progress", response=started)
            for event in events.taken():
                yield event
            stream = OutputStream(
                gen.response_id, events.text, gen.call_streamer() if gen.parse_tool_calls else None
            )
            async for delta in outputs.deltas():
                stream.push(delta.text, gen, delta.logprobs)
                for event in events.taken():
                    yield event
            _, items = stream.finish(gen)
            for event in events.taken():
                yield event
            finished = await self._finished(turn, items)
            if not turn.background:  # (a background response's last event was written with its end)
                yield events.make(ending(finished), response=finished)
                events.taken()
        except MMServeError as exc:
            if turn.background:
                raise  # (its task ends it failed)
            _, detail = error_detail(exc)
            yield events.make("error", code=detail.code, message=detail.message, param=detail.param)
        finally:
            outputs.release()


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


def failure(exc: MMServeError) -> dict[str, Any]:
    """A failed background response's ``error``, in OpenAI's codes: the engine refusing the request
    (``invalid_prompt``), too busy (``rate_limit_exceeded``), or failing (``server_error``); the
    message says which."""
    status, detail = error_detail(exc)
    if detail.code in ("invalid_image", "image_too_large"):  # (codes OpenAI's have too)
        code = detail.code
    elif status == 429:
        code = "rate_limit_exceeded"
    else:
        code = "invalid_prompt" if status < 500 else "server_error"
    return {"code": code, "message": detail.message}


def _dumped(item: Any) -> dict[str, Any]:
    return item if isinstance(item, dict) else dump_items([item])[0]
