"""Serves one chat completion: prepare inputs, hand the request to the engine, turn engine outputs into
an OpenAI ``chat.completion`` or an SSE stream of ``chat.completion.chunk``s. A client that goes away
aborts its request in the engine; a stop string found by the detokenizer does too."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.detokenizer import IncrementalDetokenizer
from app.engine_client import EngineClient, EngineGone
from app.error_handlers import sse_error_event
from app.errors import (
    ContextLengthError,
    EngineUnavailableError,
    InternalError,
    InvalidRequestError,
    MMServeError,
    ModelNotFoundError,
)
from app.input_processor import InputProcessor, PreparedRequest
from app.metrics import ApiMetrics
from app.schemas import ChatCompletionRequest
from engine.protocol import ErrorInfo, RequestOutput, SamplingParams

MAX_RESENDS = 2
DISCONNECT_POLL_S = 0.5


def error_from_engine(info: ErrorInfo) -> MMServeError:
    if info.code == "context_length_exceeded":
        return ContextLengthError(info.message)
    if info.http_status >= 500:
        return InternalError(info.message, code=info.code)
    return InvalidRequestError(info.message, code=info.code)


@dataclass
class Generation:
    """Accumulated output of one request."""

    req_id: str
    num_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None


class ChatService:
    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        inputs: InputProcessor,
        engine: EngineClient,
        metrics: ApiMetrics,
    ) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.inputs = inputs
        self.engine = engine
        self.metrics = metrics
        self.tokenizer = inputs.mm_processor.tokenizer

    async def create(self, body: ChatCompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        if body.model != self.model_name:
            raise ModelNotFoundError(f"The model `{body.model}` does not exist.")
        if not self.engine.is_ready:
            raise EngineUnavailableError("The engine is not ready.")
        arrival = time.time()
        req_id = f"chatcmpl-{uuid.uuid4().hex}"
        prepared = await self.inputs.prepare(body.messages, body.mm_processor_kwargs or {})
        queue, first = await self._submit(body, prepared, req_id, arrival)
        self.metrics.prompt_tokens.inc(len(prepared.prompt_token_ids))
        detok = IncrementalDetokenizer(self.tokenizer, stop=body.stop)
        gen = Generation(req_id, len(prepared.prompt_token_ids))
        outputs = _chain(first, queue)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = self._stream(body, gen, detok, outputs, arrival, include_usage)
            return StreamingResponse(stream, media_type="text/event-stream")
        collect = asyncio.create_task(self._collect(body, gen, detok, outputs, arrival))
        try:
            while not collect.done():
                await asyncio.wait({collect}, timeout=DISCONNECT_POLL_S)
                if not collect.done() and await raw.is_disconnected():
                    collect.cancel()
            await collect
        finally:
            self.engine.release(req_id, abort=gen.finish_reason is None)
        return JSONResponse(self._completion(gen, arrival))

    # ------------------------------------------------------------------ submission

    def _sampling(self, body: ChatCompletionRequest, prompt_len: int) -> SamplingParams:
        max_tokens = body.effective_max_tokens()
        if max_tokens is None:
            max_tokens = self.max_model_len - prompt_len
        if prompt_len >= self.max_model_len or prompt_len + max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
                f"{max_tokens} in the completion)."
            )
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k,  # the schema maps -1/0 (off) to None
            seed=body.seed,
            min_tokens=body.min_tokens or 0,
            ignore_eos=bool(body.ignore_eos),
            eos_token_ids=tuple(self.inputs.mm_processor.eos_token_ids),
            num_top_logprobs=body.num_top_logprobs(),
        )

    async def _submit(
        self, body: ChatCompletionRequest, prepared: PreparedRequest, req_id: str, arrival: float
    ) -> tuple[asyncio.Queue[RequestOutput | EngineGone], RequestOutput]:
        """Resolves, sends and waits for the first output; re-sends with payloads if the engine lacked an
        item the mirror claimed (the safety net, counted, normally never taken)."""
        for _attempt in range(MAX_RESENDS + 1):
            queue = None
            try:
                while queue is None:
                    await self.inputs.resolve(prepared)
                    sampling = self._sampling(body, len(prepared.prompt_token_ids))
                    queue = self.inputs.submit(prepared, req_id, sampling, arrival)
            finally:
                self.inputs.release_pins(prepared)
            try:
                first = await queue.get()
            except asyncio.CancelledError:
                self.engine.release(req_id, abort=True)
                raise
            if isinstance(first, EngineGone):
                self.engine.release(req_id, abort=False)
                raise EngineUnavailableError(first.reason)
            if first.error is None:
                return queue, first
            self.engine.release(req_id, abort=False)
            if not first.error.missing_mm_hashes:
                raise error_from_engine(first.error)
            self.engine.mirror.invalidate(first.error.missing_mm_hashes)
        raise EngineUnavailableError("the engine kept missing multimodal items")

    # ------------------------------------------------------------------ outputs

    async def _advance(
        self,
        gen: Generation,
        detok: IncrementalDetokenizer,
        out: RequestOutput,
        body: ChatCompletionRequest,
        arrival: float,
    ) -> str:
        """Applies one engine output; returns the new text."""
        if not gen.token_ids and out.new_token_ids:
            self.metrics.ttft.observe(time.time() - arrival)
        gen.token_ids.extend(out.new_token_ids)
        self.metrics.generation_tokens.inc(len(out.new_token_ids))
        if body.logprobs and out.logprobs:
            gen.logprobs.extend(self._logprob_entries(out, detok))
        delta = detok.push(out.new_token_ids)
        if detok.stopped:
            gen.finish_reason = "stop"
            self.engine.release(gen.req_id, abort=True)
        elif out.finish_reason is not None:
            delta += detok.flush()
            gen.finish_reason = str(out.finish_reason)
        if gen.finish_reason is not None:
            self.metrics.request_success.labels(finish_reason=gen.finish_reason).inc()
            self.metrics.e2e_latency.observe(time.time() - arrival)
        gen.text += delta
        return delta

    async def _collect(
        self,
        body: ChatCompletionRequest,
        gen: Generation,
        detok: IncrementalDetokenizer,
        outputs: AsyncIterator[RequestOutput],
        arrival: float,
    ) -> None:
        async for out in outputs:
            await self._advance(gen, detok, out, body, arrival)
            if gen.finish_reason is not None:
                return

    async def _stream(
        self,
        body: ChatCompletionRequest,
        gen: Generation,
        detok: IncrementalDetokenizer,
        outputs: AsyncIterator[RequestOutput],
        arrival: float,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        created = int(arrival)
        try:
            yield _sse(self._chunk(gen, created, {"role": "assistant", "content": ""}, include_usage))
            async for out in outputs:
                num_logprobs = len(gen.logprobs)
                delta = await self._advance(gen, detok, out, body, arrival)
                logprobs = {"content": gen.logprobs[num_logprobs:]} if body.logprobs else None
                if delta or logprobs and logprobs["content"] or gen.finish_reason is not None:
                    yield _sse(
                        self._chunk(
                            gen,
                            created,
                            {"content": delta} if delta else {},
                            include_usage,
                            logprobs=logprobs,
                            finish_reason=gen.finish_reason,
                        )
                    )
                if gen.finish_reason is not None:
                    break
            if include_usage:
                yield _sse(
                    {
                        "id": gen.req_id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": _usage(gen),
                    }
                )
            yield "data: [DONE]\n\n"
        except MMServeError as exc:
            yield sse_error_event(exc)
        finally:
            self.engine.release(gen.req_id, abort=gen.finish_reason is None)

    def _chunk(
        self,
        gen: Generation,
        created: int,
        delta: dict[str, Any],
        include_usage: bool,
        logprobs: dict[str, Any] | None = None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": gen.req_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.model_name,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
        }
        if include_usage:
            chunk["usage"] = None
        return chunk

    def _completion(self, gen: Generation, arrival: float) -> dict[str, Any]:
        return {
            "id": gen.req_id,
            "object": "chat.completion",
            "created": int(arrival),
            "model": self.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": gen.text},
                    "logprobs": {"content": gen.logprobs} if gen.logprobs else None,
                    "finish_reason": gen.finish_reason,
                }
            ],
            "usage": _usage(gen),
        }

    @staticmethod
    def _logprob_entries(out: RequestOutput, detok: IncrementalDetokenizer) -> list[dict[str, Any]]:
        entries = []
        for entry in out.logprobs or []:

            def one(token_id: int, logprob: float) -> dict[str, Any]:
                token = detok.token_strings([token_id])[0]
                return {"token": token, "logprob": logprob, "bytes": detok.token_bytes(token_id)}

            item = one(entry.sampled.token_id, entry.sampled.logprob)
            item["top_logprobs"] = [one(lp.token_id, lp.logprob) for lp in entry.top]
            entries.append(item)
        return entries


async def _chain(
    first: RequestOutput, queue: asyncio.Queue[RequestOutput | EngineGone]
) -> AsyncIterator[RequestOutput]:
    yield first
    while first.finish_reason is None:
        out = await queue.get()
        if isinstance(out, EngineGone):
            raise EngineUnavailableError(out.reason)
        yield out
        if out.finish_reason is not None:
            return


def _usage(gen: Generation) -> dict[str, Any]:
    return {
        "prompt_tokens": gen.num_prompt_tokens,
        "completion_tokens": len(gen.token_ids),
        "total_tokens": gen.num_prompt_tokens + len(gen.token_ids),
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
