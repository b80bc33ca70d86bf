"""The output side of a request, shared by every endpoint: each choice's engine outputs become text
(detokenised incrementally, stop strings applied: a match aborts that choice in the engine), logprob
entries and a finish reason, accumulated in its ``Generation``, with the latency metrics observed. An
endpoint only formats: the whole answer from the ``Generation``s once ``collect`` returns, or each
``ChoiceDelta`` of ``deltas`` as it comes (docs/architecture.md, "Request path")."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request

from app.api.detokenizer import IncrementalDetokenizer
from app.api.disconnect import unless_client_leaves
from app.api.tool_calls import ParsedOutput, ToolCallStreamer, parse_tool_calls
from app.errors import EngineUnavailableError
from app.inputs.engine_client import EngineClient, EngineGone
from app.inputs.submission import OutputQueue, SubmittedChoice, error_from_engine
from app.metrics import ApiMetrics
from wire.protocol import FinishReason, RequestOutput, TokenLogprobs

LOGPROB_FLOOR = -9999.0  # a logprob JSON cannot carry (-inf, NaN) is sent as this


@dataclass
class Generation:
    """Accumulated output of one choice (one engine request), updated as engine outputs arrive."""

    req_id: str  # the engine's
    response_id: str  # the response's, shared by every choice of a request
    index: int  # the choice's
    model_name: str
    arrival: float  # unix time the request arrived
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    want_logprobs: bool
    detok: IncrementalDetokenizer
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    last_token_at: float | None = None  # unix time the latest output with tokens reached the API
    parse_tool_calls: bool = False  # the request has tools it lets the model call (app/api/tool_calls.py)
    answer_or_calls: bool = False  # ... beside a JSON output format: that JSON alone or calls alone
    stop_token_ids: frozenset[int] = frozenset()  # EOS and the request's stop_token_ids: no text of theirs
    prompt_token_ids: tuple[int, ...] | None = None  # the prompt's, where the response returns token ids
    tokens_as_ids: bool = False  # logprobs spell each token as "token_id:<id>" (vLLM's)

    @property
    def created(self) -> int:
        return int(self.arrival)

    @property
    def cut(self) -> bool:
        """The answer was cut off (by the max tokens or a stop string), not ended by the model."""
        return self.finish_reason == "length" or self.detok.stopped

    @property
    def token_ids(self) -> list[int]:
        """The output's tokens: those the detokenizer took (up to a stop string's last)."""
        return self.detok.token_ids

    @property
    def returns_token_ids(self) -> bool:
        """The response carries the prompt's and the output's token ids (vLLM's ``return_token_ids``)."""
        return self.prompt_token_ids is not None

    def usage(self, num_completion_tokens: int | None = None) -> dict[str, Any]:
        """The usage of this choice's prompt and its output so far (``num_completion_tokens``: its
        count, where the output's tokens are not what counts)."""
        if num_completion_tokens is None:
            num_completion_tokens = len(self.token_ids)
        return usage_counts(self.num_prompt_tokens, num_completion_tokens, self.num_cached_tokens)

    def parsed(self) -> ParsedOutput:
        """The finished text split into content and tool calls (``parse_tool_calls`` is true)."""
        return parse_tool_calls(self.text, cut=self.cut, answer_or_calls=self.answer_or_calls)

    def call_streamer(self) -> ToolCallStreamer:
        """What splits the text into content and tool-call deltas as it streams."""
        return ToolCallStreamer(answer_or_calls=self.answer_or_calls)


@dataclass(frozen=True)
class ChoiceDelta:
    """What one engine output added to choice ``index``: text, logprob entries, the token ids the answer
    took, and the finish reason once it finished (then ``text`` includes what the detokenizer held
    back)."""

    index: int
    text: str
    logprobs: list[dict[str, Any]]
    finish_reason: str | None
    token_ids: list[int]


class ChoiceOutputs:
    """The outputs of one request's choices. Built once every choice was submitted; ``collect`` or
    ``deltas`` is called once; ``release`` always, last (it aborts the choices not finished)."""

    def __init__(
        self,
        gens: list[Generation],
        choices: list[SubmittedChoice],
        engine: EngineClient,
        metrics: ApiMetrics,
    ) -> None:
        self.gens = gens
        self.engine = engine
        self.metrics = metrics
        self._outputs = [request_outputs(c.first, c.queue) for c in choices]

    def release(self) -> None:
        for gen in self.gens:
            self.engine.release(gen.req_id, abort=gen.finish_reason is None)

    async def collect(self) -> None:
        """Until every choice finished."""

        async def one(gen: Generation, outputs: AsyncIterator[RequestOutput]) -> None:
            async for out in outputs:
                self._advance(gen, out)
                if gen.finish_reason is not None:
                    return

        await asyncio.gather(
            *(one(gen, outputs) for gen, outputs in zip(self.gens, self._outputs, strict=True))
        )

    async def collect_while_connected(self, raw: Request) -> None:
        """``collect``, abandoned (``ClientLeft``) the moment the client goes away; releases the choices
        either way."""
        try:
            await unless_client_leaves(raw, self.collect())
        finally:
            self.release()

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Each choice's deltas in its order, the choices interleaved as their outputs come; only deltas
        that carry something (token ids where the response returns them). Raises the first failure."""
        async with contextlib.aclosing(interleaved(self._outputs, self.gens)) as merged_outputs:
            async for index, out in merged_outputs:
                gen = self.gens[index]
                num_logprobs, num_tokens = len(gen.logprobs), len(gen.token_ids)
                text = self._advance(gen, out)
                logprobs = gen.logprobs[num_logprobs:]
                token_ids = gen.token_ids[num_tokens:]  # (the detokenizer only appends: see its push)
                returned_ids = gen.returns_token_ids and token_ids
                if text or logprobs or returned_ids or gen.finish_reason is not None:
                    yield ChoiceDelta(index, text, logprobs, gen.finish_reason, token_ids)

    def _advance(self, gen: Generation, out: RequestOutput) -> str:
        """Applies one engine output to ``gen``; returns the new text. Of an output of several tokens
        (forced tokens, or outputs merged while the API was busy), those after the one that completed a
        stop string are dropped: the answer, its logprobs and its usage are as one token at a time."""
        num_before = len(gen.token_ids)
        ids = out.new_token_ids
        if out.finish_reason is FinishReason.STOP and ids and ids[-1] in gen.stop_token_ids:
            delta = gen.detok.push_ending_on_stop_token(ids)
        else:
            delta = gen.detok.push(ids)
        num_new = len(gen.token_ids) - num_before
        if num_new:
            self._observe_latency(gen, num_new)
        self.metrics.generation_tokens.inc(num_new)
        if gen.want_logprobs and out.logprobs:
            gen.logprobs.extend(logprob_entries(out.logprobs[:num_new], gen.detok, gen.tokens_as_ids))
        if gen.detok.stopped:
            gen.finish_reason = "stop"
            self.engine.release(gen.req_id, abort=True)
        elif out.finish_reason is not None:
            delta += gen.detok.flush()  # (a stop string may match in what it releases)
            gen.finish_reason = "stop" if gen.detok.stopped else str(out.finish_reason)
        if gen.finish_reason is not None:
            self.metrics.request_success.labels(finish_reason=gen.finish_reason).inc()
            self.metrics.e2e_latency.observe(time.time() - gen.arrival)
        gen.text += delta
        return delta

    def _observe_latency(self, gen: Generation, num_new_tokens: int) -> None:
        """TTFT for a choice's first tokens; after them, an output of k tokens t seconds after the
        previous one is k inter-token latencies of t/k (outputs merged under load spread their wait)."""
        now = time.time()
        if gen.last_token_at is None:
            self.metrics.ttft.observe(now - gen.arrival)
        else:
            per_token_s = (now - gen.last_token_at) / num_new_tokens
            for _ in range(num_new_tokens):
                self.metrics.inter_token_latency.observe(per_token_s)
        gen.last_token_at = now


def logprob_entries(
    entries: list[TokenLogprobs], detok: IncrementalDetokenizer, as_ids: bool = False
) -> list[dict[str, Any]]:
    """OpenAI ``logprobs.content`` items: token text (``bytes:…`` for partial characters; with
    ``as_ids``, ``token_id:<id>``), raw bytes (the token's own, either way)."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        token = token_texts(detok, [token_id], as_ids)[0]
        return {"token": token, "logprob": finite(logprob), "bytes": detok.token_bytes(token_id)}

    result = []
    for entry in entries:
        item = one(entry.sampled.token_id, entry.sampled.logprob)
        item["top_logprobs"] = [one(lp.token_id, lp.logprob) for lp in entry.top]
        result.append(item)
    return result


def token_texts(detok: IncrementalDetokenizer, token_ids: list[int], as_ids: bool) -> list[str]:
    """How logprobs spell tokens: their text, or with ``as_ids`` (vLLM's ``return_tokens_as_token_ids``)
    ``token_id:<id>``, which any client maps back to the token whatever its text."""
    if as_ids:
        return [f"token_id:{token_id}" for token_id in token_ids]
    return detok.token_strings(token_ids)


def usage_counts(
    num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int
) -> dict[str, Any]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def finite(logprob: float) -> float:
    """A logprob JSON can carry: it has no -inf or NaN (a model that overflowed), for which vLLM's floor
    stands in, as OpenAI's clients expect a number."""
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


async def request_outputs(first: RequestOutput, queue: OutputQueue) -> AsyncIterator[RequestOutput]:
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
            raise EngineUnavailableError(out.reason, code=out.code)
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
        following,
        new_token_ids=[*out.new_token_ids, *following.new_token_ids],
        logprobs=logprobs,
        prompt_logprobs=out.prompt_logprobs or following.prompt_logprobs,
    )


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
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()

    async def pump(index: int, source: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in source:
                queue.put_nowait((index, out))
        except Exception as exc:  # noqa: BLE001 (handed to the consumer, which raises it)
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(index, source)) for index, source in enumerate(outputs)]
    try:
        while any(gen.finish_reason is None for gen in gens):
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if gens[index].finish_reason is None:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
