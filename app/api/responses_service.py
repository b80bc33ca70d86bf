"""Serves ``POST /v1/responses``: the body is translated at the edge into the chat request every endpoint
shares, goes through the same input path (``submit``) and output path (``ChoiceOutputs``), and the
answer is formatted as OpenAI's ``response`` object, or as its typed stream of events (``response.created``
… ``response.output_text.delta`` … ``response.completed``, numbered by ``sequence_number``)."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from app.api.chat_service import CLIENT_CLOSED_REQUEST, ChatService
from app.api.detokenizer import IncrementalDetokenizer
from app.api.error_handlers import error_detail, validation_error_detail
from app.api.outputs import ChoiceOutputs, Generation
from app.api.responses_api_schemas import ResponsesRequest
from app.api.schemas import ChatCompletionRequest
from app.errors import InvalidRequestError, MMServeError
from app.inputs.submission import submit


class ResponsesService:
    def __init__(self, chat: ChatService) -> None:
        self.chat = chat

    async def create(self, body: ResponsesRequest, raw: Request) -> Response:
        chat_body = self._as_chat(body)
        self.chat.check_ready(chat_body)
        spec = self.chat.spec(chat_body, raw)
        arrival = time.time()
        submitted = await submit(self.chat.inputs, self.chat.engine, spec)
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
        )
        outputs = ChoiceOutputs([gen], submitted, self.chat.engine, self.chat.metrics)
        if body.stream:
            return StreamingResponse(self._stream(body, gen, outputs), media_type="text/event-stream")
        if not await outputs.collect_while_connected(raw):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(response_object(body, gen, message_id=f"msg_{uuid.uuid4().hex}"))

    def _as_chat(self, body: ResponsesRequest) -> ChatCompletionRequest:
        """The chat request with the same meaning; its validation errors name the Responses field."""
        fields = {
            "model": body.model,
            "messages": body.chat_messages(),
            "max_completion_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "response_format": body.response_format(),
            "cache_salt": body.cache_salt,
            "mm_processor_kwargs": body.mm_processor_kwargs,
        }
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            detail = validation_error_detail(exc.errors())
            param = "text.format" if str(detail.param).startswith("response_format") else "input"
            raise InvalidRequestError(detail.message, param=param) from exc

    async def _stream(
        self, body: ResponsesRequest, gen: Generation, outputs: ChoiceOutputs
    ) -> AsyncIterator[str]:
        message_id = f"msg_{uuid.uuid4().hex}"
        sequence = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            payload = {"type": kind, "sequence_number": next(sequence), **fields}
            return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

        where = {"item_id": message_id, "output_index": 0, "content_index": 0}
        try:
            started = response_object(body, gen, message_id, status="in_progress", with_output=False)
            yield event("response.created", response=started)
            yield event("response.in_progress", response=started)
            item = _message(message_id, "in_progress", [])
            yield event("response.output_item.added", output_index=0, item=item)
            yield event("response.content_part.added", part=_text_part(""), **where)
            async for delta in outputs.deltas():
                if delta.text:
                    yield event("response.output_text.delta", delta=delta.text, logprobs=[], **where)
            yield event("response.output_text.done", text=gen.text, logprobs=[], **where)
            yield event("response.content_part.done", part=_text_part(gen.text), **where)
            finished = response_object(body, gen, message_id)
            yield event("response.output_item.done", output_index=0, item=finished["output"][0])
            kind = "response.completed" if finished["status"] == "completed" else "response.incomplete"
            yield event(kind, response=finished)
        except MMServeError as exc:
            _, detail = error_detail(exc)
            yield event("error", code=detail.code, message=detail.message, param=detail.param)
        finally:
            outputs.release()


def _message(message_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    """The one output item of a response: the assistant's message."""
    return {"id": message_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_object(
    body: ResponsesRequest,
    gen: Generation,
    message_id: str,
    status: str | None = None,
    with_output: bool = True,
) -> dict[str, Any]:
    """OpenAI's ``response`` object for ``gen``: ``completed``, or ``incomplete`` when the answer reached
    ``max_output_tokens`` (or the context length)."""
    if status is None:
        status = "incomplete" if gen.finish_reason == "length" else "completed"
    message = _message(message_id, status, [_text_part(gen.text)])
    text_format = (
        body.text.format.model_dump(by_alias=True, exclude_none=True)
        if body.text and body.text.format
        else {"type": "text"}
    )
    num_output = len(gen.token_ids)
    return {
        "id": gen.response_id,
        "object": "response",
        "created_at": gen.created,
        "status": status,
        "model": gen.model_name,
        "output": [message] if with_output else [],
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "metadata": body.metadata or {},
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "text": {"format": text_format},
        "truncation": "disabled",
        "store": False,
        "previous_response_id": None,
        "usage": {
            "input_tokens": gen.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": gen.num_cached_tokens},
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": gen.num_prompt_tokens + num_output,
        }
        if with_output
        else None,
    }
