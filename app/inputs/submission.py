"""A request into the engine in one call: ``submit(spec)`` prepares its prompt and media once, then sends
each choice (the first alone, the others once it is prefilled) and waits for each one's first output
(docs/architecture.md, "Request path"). An endpoint builds a ``RequestSpec`` at its edge and reads the
``Submitted`` choices' outputs; it never calls the stages of ``InputProcessor`` itself.

Errors the engine reports about a request become the API's typed errors here (``error_from_engine``),
for the first output and for those after it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from app.errors import (
    ContextLengthError,
    EngineUnavailableError,
    InternalError,
    InvalidRequestError,
    MMServeError,
    TooManyRequestsError,
)
from app.inputs.engine_client import EngineClient, EngineGone
from app.inputs.input_processor import InputProcessor, PreparedRequest
from app.inputs.media_ids import CacheScope
from app.inputs.raw_prompts import RawPrompt, prepare_prompt
from app.inputs.truncation import Truncation
from wire.prompt_logprobs import empty_run
from wire.protocol import Constraint, ErrorInfo, PromptLogprobs, RequestOutput, SamplingParams
from workers.families.processing import TemplateOptions

MAX_RESENDS = 2
PROMPT_TAIL = 5  # ids of context for decoding an answer (vLLM's detokenizer starts 5 ids back too)
T = TypeVar("T")
# the engine's errors about a request's constraint (engine/structured/): 400s naming the field it came from
CONSTRAINT_ERROR_CODES = frozenset(
    {"invalid_constraint", "constraint_compile_timeout", "constraint_too_large"}
)

OutputQueue = asyncio.Queue[RequestOutput | EngineGone]


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
    return InvalidRequestError(info.message, code=info.code, param=info.param)


@dataclass(frozen=True)
class RequestSpec:
    """What an endpoint asks of the engine, translated at its edge: the chat-template messages' source
    (or a raw prompt, which has no template and no media), how the template ends, the media options,
    the cache scope, the constraint (and the request field it came from, which errors about it name),
    and each choice's sampling from the prompt's length."""

    messages: list[Any]
    mm_processor_kwargs: dict[str, Any]
    scope: CacheScope
    template: TemplateOptions
    req_ids: list[str]  # one per choice; the first is the request's own
    sampling: Callable[[int, int], SamplingParams]  # (prompt tokens, choice index) -> its parameters
    constraint: Constraint | None = None
    constraint_param: str | None = None
    raw_prompt: RawPrompt | None = None  # a prompt as it is, in place of the messages (no template)
    priority: int = 0  # its place under --scheduling-policy priority (lower first)
    truncation: Truncation | None = None  # the prompt cut to its last (or first) tokens


@dataclass(frozen=True)
class SubmittedChoice:
    req_id: str
    queue: OutputQueue
    first: RequestOutput  # its first output, without an error


@dataclass(frozen=True)
class Submitted:
    choices: list[SubmittedChoice]
    prompt_token_ids: tuple[int, ...]
    truncated: bool = False  # its prompt was cut (``RequestSpec.truncation``)
    prompt_text: str = ""  # the rendered chat template (one media token per item), or a raw prompt's text

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prompt_tail(self) -> tuple[int, ...]:
        """The prompt's last ids: what a raw prompt's answer is decoded after."""
        return self.prompt_token_ids[-PROMPT_TAIL:]

    @property
    def prompt_logprobs(self) -> PromptLogprobs:
        """Its prompt tokens' logprobs from the second on, where its first choice asked for them."""
        return self.choices[0].first.prompt_logprobs or empty_run(1, 0)


async def submit(inputs: InputProcessor, engine: EngineClient, spec: RequestSpec) -> Submitted:
    """Every choice of ``spec`` running in the engine, or a typed error (every choice sent is then
    aborted). Cancelling the caller aborts the choices sent."""
    if spec.raw_prompt is not None:
        prepared = await prepare_prompt(inputs.family, spec.raw_prompt)
    else:
        prepared = await inputs.prepare(spec.messages, spec.mm_processor_kwargs, spec.scope, spec.template)
    send_lock = asyncio.Lock()  # one choice at a time resolves and sends the shared ``prepared``
    first = await _submit_choice(inputs, engine, spec, prepared, 0, send_lock)
    choices = [first]
    if len(spec.req_ids) > 1:
        try:
            choices += await _submit_rest(inputs, engine, spec, prepared, send_lock)
        except BaseException:
            engine.release(first.req_id, abort=True)
            raise
    inputs.count_uuid_hits(prepared)
    return Submitted(choices, tuple(prepared.prompt_token_ids), prepared.truncated, prepared.prompt)


async def _submit_rest(
    inputs: InputProcessor,
    engine: EngineClient,
    spec: RequestSpec,
    prepared: PreparedRequest,
    send_lock: asyncio.Lock,
) -> list[SubmittedChoice]:
    """The choices after the first, sent together once it is prefilled; if one fails, or the caller is
    cancelled (its client left), the others are cancelled, and those already running are aborted."""
    choices = [
        _submit_choice(inputs, engine, spec, prepared, index, send_lock)
        for index in range(1, len(spec.req_ids))
    ]
    return await _all_or_aborted(engine, choices, lambda choice: [choice.req_id])


async def submit_together(
    engine: EngineClient, submissions: list[Coroutine[Any, Any, Submitted]]
) -> list[Submitted]:
    """Several requests' ``submit``, run together (a batch of prompts): if one fails, or the caller is
    cancelled, the others are cancelled, and the choices of those already running are aborted."""
    return await _all_or_aborted(engine, submissions, lambda done: [choice.req_id for choice in done.choices])


async def _all_or_aborted(
    engine: EngineClient, coros: list[Coroutine[Any, Any, T]], req_ids: Callable[[T], list[str]]
) -> list[T]:
    """The results of ``coros``, run together; on a failure or a cancel, the rest are cancelled (one
    cancelled while it waits aborts its own requests) and the ``req_ids`` of each that had succeeded are
    aborted."""
    tasks = [asyncio.ensure_future(coro) for coro in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and task.exception() is None:
                for req_id in req_ids(task.result()):
                    engine.release(req_id, abort=True)
        raise


async def _submit_choice(
    inputs: InputProcessor,
    engine: EngineClient,
    spec: RequestSpec,
    prepared: PreparedRequest,
    index: int,
    send_lock: asyncio.Lock,
) -> SubmittedChoice:
    """Resolves, sends and waits for the first output; re-sends with payloads if the engine lacked an
    item the mirror claimed, or found an shm reference stale (the safety net, counted, normally never
    taken)."""
    req_id = spec.req_ids[index]
    for _attempt in range(MAX_RESENDS + 1):
        queue = None
        async with send_lock:
            try:
                while queue is None:
                    await inputs.resolve(prepared)
                    if spec.truncation is not None:
                        prepared.truncated = spec.truncation.apply(prepared) or prepared.truncated
                    sampling = spec.sampling(len(prepared.prompt_token_ids), index)
                    queue = inputs.submit(
                        prepared,
                        req_id,
                        sampling,
                        spec.constraint,
                        later_choice=index > 0,
                        priority=spec.priority,
                    )
            finally:
                inputs.release_pins(prepared)
        try:
            first = await queue.get()
        except asyncio.CancelledError:
            engine.release(req_id, abort=True)
            raise
        if isinstance(first, EngineGone):
            engine.release(req_id, abort=False)
            raise EngineUnavailableError(first.reason, code=first.code)
        if first.error is None:
            return SubmittedChoice(req_id, queue, first)
        engine.release(req_id, abort=False)
        if not first.error.missing_mm_hashes:
            raise error_from_engine(first.error, spec.constraint_param)
        engine.forget(first.error.missing_mm_hashes)
        inputs.send_payloads(prepared, first.error.missing_mm_hashes)
    raise EngineUnavailableError("the engine kept missing multimodal items")


async def prompt_token_ids(
    inputs: InputProcessor,
    messages: list[Any],
    mm_processor_kwargs: dict[str, Any],
    scope: CacheScope,
    template: TemplateOptions,
) -> list[int]:
    """The prompt ids a request with these messages would send, media processed (through the processor
    cache) but nothing sent: what ``/tokenize`` counts."""
    prepared = await inputs.prepare(messages, mm_processor_kwargs, scope, template)
    try:
        await inputs.resolve(prepared)
    finally:
        inputs.release_pins(prepared)
    return list(prepared.prompt_token_ids)
