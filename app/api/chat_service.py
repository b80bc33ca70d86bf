"""Serves one chat completion: prepare inputs, hand the request to the engine, turn engine outputs into
an OpenAI ``chat.completion`` or an SSE stream of ``chat.completion.chunk``s. A client that goes away
aborts its request in the engine; a stop string found by the detokenizer does too."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.api.constraints import RequestedConstraint, requested_constraint
from app.api.detokenizer import IncrementalDetokenizer
from app.api.error_handlers import sse_error_event
from app.api.request_guards import request_tenant
from app.api.responses import Generation, chunk, completion, final_usage_chunk, logprob_entries, sse
from app.api.schemas import ChatCompletionRequest
from app.errors import (
    ContextLengthError,
    EngineUnavailableError,
    InternalError,
    InvalidRequestError,
    MMServeError,
    ModelNotFoundError,
    TooManyRequestsError,
)
from app.inputs.engine_client import EngineClient, EngineGone
from app.inputs.input_processor import InputProcessor, PreparedRequest
from app.inputs.media_ids import CacheScope
from app.metrics import ApiMetrics
from wire.protocol import ErrorInfo, RequestOutput, SamplingParams

MAX_RESENDS = 2
CLIENT_CLOSED_REQUEST = 499
DISCONNECT_POLL_S = 0.5


# the engine's errors about a request's constraint (engine/structured/): 400s naming the field it came from
CONSTRAINT_ERROR_CODES = frozenset({"invalid_constraint", "constraint_compile_timeout"})


def error_from_engine(info: ErrorInfo, constraint_param: str | None = None) -> MMServeError:
    if info.code == "context_length_exceeded":
        return ContextLengthError(info.message)
    if info.code in CONSTRAINT_ERROR_CODES:
        return InvalidRequestError(info.message, code=info.code, param=constraint_param)
    if info.http_status == 429:
        return TooManyRequestsError(info.message, code=info.code)
    if info.http_status == 503:
        return EngineUnavailableError(info.message, code=info.code)
    if info.http_status >= 500:
        return InternalError(info.message, code=info.code)
    return InvalidRequestError(info.message, code=info.code)


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
        self.tokenizer = inputs.family.tokenizer

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        if body.model != self.model_name:
            raise ModelNotFoundError(f"The model `{body.model}` does not exist.")
        if not self.engine.is_ready:
            raise EngineUnavailableError("The engine is not ready.")
        arrival = time.time()
        req_id = f"chatcmpl-{uuid.uuid4().hex}"
        constraint = requested_constraint(body.response_format, body.structured_outputs)  # before any work
        scope = CacheScope.of(
            tenant=request_tenant(raw.scope),
            cache_salt=body.cache_salt,
            isolate_tenants=self.inputs.settings.tenant_cache_isolation,
        )
        prepared = await self.inputs.prepare(body.messages, body.mm_processor_kwargs or {}, scope)
        queue, first = await self._submit(body, prepared, req_id, constraint)
        self.inputs.count_uuid_hits(prepared)
        self.metrics.prompt_tokens.inc(len(prepared.prompt_token_ids))
        gen = Generation(
            req_id=req_id,
            model_name=self.model_name,
            arrival=arrival,
            num_prompt_tokens=len(prepared.prompt_token_ids),
            num_cached_tokens=first.num_cached_tokens,
            want_logprobs=bool(body.logprobs),
            detok=IncrementalDetokenizer(self.tokenizer, stop=body.stop),
        )
        outputs = request_outputs(first, queue)
        if body.stream:
            return StreamingResponse(
                self._stream(gen, outputs, body.include_usage), media_type="text/event-stream"
            )
        collect = asyncio.create_task(self._collect(gen, outputs))
        try:
            while not collect.done():
                await asyncio.wait({collect}, timeout=DISCONNECT_POLL_S)
                if not collect.done() and await raw.is_disconnected():
                    collect.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collect
        finally:
            self.engine.release(req_id, abort=gen.finish_reason is None)
        if collect.cancelled():  # the client went away: nobody reads this (nginx's "client closed")
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(completion(gen))

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
            eos_token_ids=tuple(self.inputs.family.eos_token_ids),
            num_top_logprobs=body.num_top_logprobs(),
        )

    async def _submit(
        self,
        body: ChatCompletionRequest,
        prepared: PreparedRequest,
        req_id: str,
        constraint: RequestedConstraint | None = None,
    ) -> tuple[asyncio.Queue[RequestOutput | EngineGone], RequestOutput]:
        """Resolves, sends and waits for the first output; re-sends with payloads if the engine lacked an
        item the mirror claimed, or found an shm reference stale (the safety net, counted, normally never
        taken)."""
        for _attempt in range(MAX_RESENDS + 1):
            queue = None
            try:
                while queue is None:
                    await self.inputs.resolve(prepared)
                    sampling = self._sampling(body, len(prepared.prompt_token_ids))
                    queue = self.inputs.submit(
                        prepared, req_id, sampling, constraint.constraint if constraint is not None else None
                    )
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
                raise error_from_engine(first.error, constraint.param if constraint is not None else None)
            self.engine.forget(first.error.missing_mm_hashes)
            self.inputs.send_payloads(prepared, first.error.missing_mm_hashes)
        raise EngineUnavailableError("the engine kept missing multimodal items")

    # ------------------------------------------------------------------ outputs

    def _advance(self, gen: Generation, out: RequestOutput) -> str:
        """Applies one engine output to ``gen``; returns the new text."""
        if out.new_token_ids:
            self._observe_latency(gen, len(out.new_token_ids))
        gen.token_ids.extend(out.new_token_ids)
        self.metrics.generation_tokens.inc(len(out.new_token_ids))
        if gen.want_logprobs and out.logprobs:
            gen.logprobs.extend(logprob_entries(out.logprobs, gen.detok))
        delta = gen.detok.push(out.new_token_ids)
        if gen.detok.stopped:
            gen.finish_reason = "stop"
            self.engine.release(gen.req_id, abort=True)
        elif out.finish_reason is not None:
            delta += gen.detok.flush()
            gen.finish_reason = str(out.finish_reason)
        if gen.finish_reason is not None:
            self.metrics.request_success.labels(finish_reason=gen.finish_reason).inc()
            self.metrics.e2e_latency.observe(time.time() - gen.arrival)
        gen.text += delta
        return delta

    def _observe_latency(self, gen: Generation, num_new_tokens: int) -> None:
        """TTFT for a request's first tokens; after them, an output of k tokens t seconds after the
        previous one is k inter-token latencies of t/k (outputs merged under load spread their wait)."""
        now = time.time()
        if gen.last_token_at is None:
            self.metrics.ttft.observe(now - gen.arrival)
        else:
            per_token_s = (now - gen.last_token_at) / num_new_tokens
            for _ in range(num_new_tokens):
                self.metrics.inter_token_latency.observe(per_token_s)
        gen.last_token_at = now

    async def _collect(self, gen: Generation, outputs: AsyncIterator[RequestOutput]) -> None:
        async for out in outputs:
            self._advance(gen, out)
            if gen.finish_reason is not None:
                return

    async def _stream(
        self, gen: Generation, outputs: AsyncIterator[RequestOutput], include_usage: bool
    ) -> AsyncIterator[str]:
        """SSE events; the request is aborted in the engine if the client goes away mid-stream."""
        try:
            yield sse(chunk(gen, {"role": "assistant", "content": ""}, include_usage))
            async for out in outputs:
                num_logprobs = len(gen.logprobs)
                delta = self._advance(gen, out)
                logprobs = {"content": gen.logprobs[num_logprobs:]} if gen.want_logprobs else None
                if delta or (logprobs and logprobs["content"]) or gen.finish_reason is not None:
                    content = {"content": delta} if delta else {}
                    yield sse(chunk(gen, content, include_usage, logprobs, gen.finish_reason))
                if gen.finish_reason is not None:
                    break
            if include_usage:
                yield sse(final_usage_chunk(gen))
            yield "data: [DONE]\n\n"
        except MMServeError as exc:
            yield sse_error_event(exc)
        finally:
            self.engine.release(gen.req_id, abort=gen.finish_reason is None)


async def request_outputs(
    first: RequestOutput, queue: asyncio.Queue[RequestOutput | EngineGone]
) -> AsyncIterator[RequestOutput]:
    """The request's outputs in order. Outputs that queued up while the consumer was busy (the API
    behind the engine under load) come out merged into one, as vLLM's output collector does: one SSE
    chunk and one detokenizer call for several tokens instead of one each, so a busy API does less
    work per token rather than falling further behind. A failure is never merged: it comes after the
    outputs before it."""
    yield first
    if first.finish_reason is not None:
        return
    pending: RequestOutput | EngineGone | None = None
    while True:
        out = pending if pending is not None else await queue.get()
        pending = None
        if isinstance(out, EngineGone):
            raise EngineUnavailableError(out.reason)
        if out.error is not None:  # e.g. the worker died or its step failed under the request
            raise error_from_engine(out.error)
        while out.finish_reason is None and not queue.empty():
            following = queue.get_nowait()
            if isinstance(following, EngineGone) or following.error is not None:
                pending = following
                break
            out = merged(out, following)
        yield out
        if out.finish_reason is not None:
            return


def merged(out: RequestOutput, following: RequestOutput) -> RequestOutput:
    """``out`` then ``following`` (the same request's next output) as one output."""
    logprobs = None
    if out.logprobs is not None or following.logprobs is not None:
        logprobs = [*(out.logprobs or []), *(following.logprobs or [])]
    return msgspec.structs.replace(
        following, new_token_ids=[*out.new_token_ids, *following.new_token_ids], logprobs=logprobs
    )
