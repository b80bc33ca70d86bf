"""Serves one chat completion: prepare inputs, hand the request to the engine, turn engine outputs into
an OpenAI ``chat.completion`` or an SSE stream of ``chat.completion.chunk``s. A client that goes away
aborts its request in the engine; a stop string found by the detokenizer does too."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.api.constraints import RequestedConstraint, requested_constraint
from app.api.detokenizer import IncrementalDetokenizer
from app.api.error_handlers import sse_error_event
from app.api.request_guards import request_tenant
from app.api.responses import Generation, chunk, completion, final_usage_chunk, logprob_entries, sse
from app.api.sampling import SamplingDefaults, choice_sampling, sampling_params
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
from workers.families.processing import TemplateOptions

log = logging.getLogger("mmserve.api")

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
        defaults: SamplingDefaults | None = None,
    ) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.inputs = inputs
        self.engine = engine
        self.metrics = metrics
        self.defaults = defaults if defaults is not None else SamplingDefaults()
        self.tokenizer = inputs.family.tokenizer
        self._warned_fields: set[str] = set()  # unknown request fields logged once each

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        """An ``n > 1`` request is prepared once and sent as one engine request per choice: the first
        alone, the others once it is prefilled, so they find its prompt's blocks in the prefix cache
        and its items in the engine's caches (docs/api.md, "Several choices")."""
        if body.model != self.model_name:
            raise ModelNotFoundError(f"The model `{body.model}` does not exist.")
        if not self.engine.is_ready:
            raise EngineUnavailableError("The engine is not ready.")
        self._warn_unknown_fields(body)
        arrival = time.time()
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        response_id = f"chatcmpl-{body.request_id}" if body.request_id is not None else base_id
        constraint = requested_constraint(body.response_format, body.structured_outputs)  # before any work
        if constraint is not None and body.allowed_token_ids is not None:  # they could leave no token
            msg = f"allowed_token_ids cannot be combined with an output constraint ({constraint.param})"
            raise InvalidRequestError(msg, param="allowed_token_ids")
        scope = CacheScope.of(
            tenant=request_tenant(raw.scope),
            cache_salt=body.cache_salt,
            isolate_tenants=self.inputs.settings.tenant_cache_isolation,
        )
        template = TemplateOptions(body.add_generation_prompt, body.continue_final_message)
        prepared = await self.inputs.prepare(body.messages, body.mm_processor_kwargs or {}, scope, template)
        send_lock = asyncio.Lock()  # one choice at a time resolves and sends the shared ``prepared``
        req_ids = [base_id, *(f"{base_id}-{index}" for index in range(1, body.n))]
        submitted = [await self._submit(body, prepared, req_ids[0], constraint, 0, send_lock)]
        if body.n > 1:
            try:
                submitted += await self._submit_all(body, prepared, req_ids[1:], constraint, send_lock)
            except BaseException:
                self.engine.release(req_ids[0], abort=True)
                raise
        self.inputs.count_uuid_hits(prepared)
        self.metrics.prompt_tokens.inc(len(prepared.prompt_token_ids))
        gens = [
            Generation(
                req_id=req_id,
                response_id=response_id,
                index=index,
                model_name=self.model_name,
                arrival=arrival,
                num_prompt_tokens=len(prepared.prompt_token_ids),
                num_cached_tokens=submitted[0][1].num_cached_tokens,
                want_logprobs=bool(body.logprobs),
                detok=IncrementalDetokenizer(
                    self.tokenizer,
                    skip_special_tokens=body.skip_special_tokens,
                    stop=body.stop,
                    include_stop_str=body.include_stop_str_in_output,
                ),
            )
            for index, req_id in enumerate(req_ids)
        ]
        outputs = [request_outputs(first, queue) for queue, first in submitted]
        if body.stream:
            return StreamingResponse(
                self._stream(gens, outputs, body.include_usage), media_type="text/event-stream"
            )
        collect = asyncio.create_task(self._collect_all(gens, outputs))
        try:
            while not collect.done():
                await asyncio.wait({collect}, timeout=DISCONNECT_POLL_S)
                if not collect.done() and await raw.is_disconnected():
                    collect.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collect
        finally:
            self._release(gens)
        if collect.cancelled():  # the client went away: nobody reads this (nginx's "client closed")
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(completion(gens))

    def _warn_unknown_fields(self, body: ChatCompletionRequest) -> None:
        """A field no spec knows is accepted, as vLLM does, and logged the first time it is seen."""
        new = sorted(set(body.model_extra or {}) - self._warned_fields)
        if new:
            self._warned_fields.update(new)
            log.warning("request fields mmserve does not know were ignored: %s", new)

    def _release(self, gens: list[Generation]) -> None:
        for gen in gens:
            self.engine.release(gen.req_id, abort=gen.finish_reason is None)

    # ------------------------------------------------------------------ submission

    def _sampling(self, body: ChatCompletionRequest, prompt_len: int, index: int) -> SamplingParams:
        family = self.inputs.family
        first = sampling_params(
            body, self.defaults, prompt_len, self.max_model_len, family.eos_token_ids, family.vocab_size
        )
        return choice_sampling(first, index)

    async def _submit_all(
        self,
        body: ChatCompletionRequest,
        prepared: PreparedRequest,
        req_ids: list[str],
        constraint: RequestedConstraint | None,
        send_lock: asyncio.Lock,
    ) -> list[tuple[asyncio.Queue[RequestOutput | EngineGone], RequestOutput]]:
        """The choices after the first, sent together; if one fails, the others sent are aborted."""
        results = await asyncio.gather(
            *(
                self._submit(body, prepared, req_id, constraint, index, send_lock)
                for index, req_id in enumerate(req_ids, start=1)
            ),
            return_exceptions=True,
        )
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is None:
            return [r for r in results if not isinstance(r, BaseException)]
        for req_id, result in zip(req_ids, results, strict=True):
            if not isinstance(result, BaseException):
                self.engine.release(req_id, abort=True)
        raise failure

    async def _submit(
        self,
        body: ChatCompletionRequest,
        prepared: PreparedRequest,
        req_id: str,
        constraint: RequestedConstraint | None,
        index: int,
        send_lock: asyncio.Lock,
    ) -> tuple[asyncio.Queue[RequestOutput | EngineGone], RequestOutput]:
        """Resolves, sends and waits for the first output; re-sends with payloads if the engine lacked an
        item the mirror claimed, or found an shm reference stale (the safety net, counted, normally never
        taken)."""
        for _attempt in range(MAX_RESENDS + 1):
            queue = None
            async with send_lock:
                try:
                    while queue is None:
                        await self.inputs.resolve(prepared)
                        sampling = self._sampling(body, len(prepared.prompt_token_ids), index)
                        queue = self.inputs.submit(
                            prepared, req_id, sampling, constraint.constraint if constraint else None
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

    async def _collect_all(self, gens: list[Generation], outputs: list[AsyncIterator[RequestOutput]]) -> None:
        await asyncio.gather(*(self._collect(gen, out) for gen, out in zip(gens, outputs, strict=True)))

    async def _collect(self, gen: Generation, outputs: AsyncIterator[RequestOutput]) -> None:
        async for out in outputs:
            self._advance(gen, out)
            if gen.finish_reason is not None:
                return

    async def _stream(
        self, gens: list[Generation], outputs: list[AsyncIterator[RequestOutput]], include_usage: bool
    ) -> AsyncIterator[str]:
        """SSE events, each choice's in its order (the choices interleaved as their outputs come); the
        requests are aborted in the engine if the client goes away mid-stream."""
        try:
            for gen in gens:
                yield sse(chunk(gen, {"role": "assistant", "content": ""}, include_usage))
            async with contextlib.aclosing(interleaved(outputs, gens)) as merged:  # its pumps end with it
                async for index, out in merged:
                    gen = gens[index]
                    num_logprobs = len(gen.logprobs)
                    delta = self._advance(gen, out)
                    logprobs = {"content": gen.logprobs[num_logprobs:]} if gen.want_logprobs else None
                    if delta or (logprobs and logprobs["content"]) or gen.finish_reason is not None:
                        content = {"content": delta} if delta else {}
                        yield sse(chunk(gen, content, include_usage, logprobs, gen.finish_reason))
            if include_usage:
                yield sse(final_usage_chunk(gens))
            yield "data: [DONE]\n\n"
        except MMServeError as exc:
            yield sse_error_event(exc)
        finally:
            self._release(gens)


async def interleaved(
    outputs: list[AsyncIterator[RequestOutput]], gens: list[Generation]
) -> AsyncGenerator[tuple[int, RequestOutput]]:
    """``(index, output)`` of every choice's outputs as they come, until every choice finished (a choice
    ended by a stop string gets no further outputs). The first failure is raised."""
    if len(outputs) == 1:
        async for out in outputs[0]:
            yield 0, out
            if gens[0].finish_reason is not None:
                return
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()

    async def pump(index: int, source: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in source:
                merged.put_nowait((index, out))
        except Exception as exc:  # noqa: BLE001 (handed to the consumer, which raises it)
            merged.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(index, source)) for index, source in enumerate(outputs)]
    try:
        while any(gen.finish_reason is None for gen in gens):
            index, item = await merged.get()
            if isinstance(item, Exception):
                raise item
            if gens[index].finish_reason is None:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


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
