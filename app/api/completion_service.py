"""Serves one legacy completion (``POST /v1/completions``): each prompt of the request, as it is (no chat
template, no media: app/inputs/raw_prompts.py), becomes a ``RequestSpec`` with chat's sampling and output
constraint (the chat service's own pieces), the prompts are submitted together, and the choices'
outputs (app/api/outputs.py) become a ``text_completion`` or an SSE stream of them
(app/api/completion_responses.py). A client that goes away aborts every choice in the engine."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from app.api.chat_service import ChatService, alone_with_allowed_tokens, client_request_id
from app.api.completion_responses import LegacyLogprobs, chunk, completion, envelope, prompt_logprobs, usage
from app.api.completion_schemas import CompletionRequest, Prompt
from app.api.detokenizer import IncrementalDetokenizer
from app.api.disconnect import unless_client_leaves
from app.api.error_handlers import sse_error_event
from app.api.json_out import JSONOut, sse
from app.api.outputs import ChoiceOutputs
from app.api.prompt_logprobs import vllm_prompt_logprobs
from app.api.request_guards import request_tenant
from app.api.sampling import prompt_truncation, reword_length_error
from app.api.sampling_schemas import StreamUsage
from app.errors import MMServeError
from app.inputs.raw_prompts import RawPrompt
from app.inputs.submission import RequestSpec, Submitted, submit, submit_together
from workers.families.processing import TemplateOptions

# a length error's words for the prompt, where chat's speak of messages (app/api/sampling.py)
_PROMPT_WORDS = (
    ("the messages are", "the prompt is"),
    ("in the messages", "in the prompt"),
    ("Shorten the messages.", "Shorten the prompt."),
)


class CompletionService:
    def __init__(self, chat: ChatService) -> None:
        self.chat = chat

    async def create(self, body: CompletionRequest, raw: Request) -> Response:
        chat = self.chat
        chat.check_ready(body)
        given = client_request_id(raw, body)
        arrival = time.time()
        prompts = body.prompts()
        base_id = f"cmpl-{uuid.uuid4().hex}"
        specs = self._specs(body, raw, prompts, base_id)
        submissions = [self._submit(spec) for spec in specs]
        done = await unless_client_leaves(raw, submit_together(chat.engine, submissions))
        for submitted in done:
            chat.metrics.prompt_tokens.inc(submitted.num_prompt_tokens)
        response_id = f"cmpl-{given}" if given is not None else base_id
        gens = [
            chat.generation(body, submitted, j, response_id, arrival, index=i * body.n + j, after_prompt=True)
            for i, submitted in enumerate(done)
            for j in range(body.n)
        ]
        # a cut prompt is echoed as its ids that were kept decode
        shown = [list(s.prompt_token_ids) if s.truncated else p for s, p in zip(done, prompts, strict=True)]
        echoed = [self._text(prompt, body.skip_special_tokens) if body.echo else "" for prompt in shown]
        scored = body.echo and body.logprobs is not None
        pieces = [
            self._prompt_piece(submitted, prompt, text, body) if scored else None
            for submitted, prompt, text in zip(done, shown, echoed, strict=True)
        ]
        vllm_pieces = None
        if body.prompt_logprobs is not None:
            detok = IncrementalDetokenizer(chat.tokenizer)
            vllm_pieces = [
                vllm_prompt_logprobs(s.prompt_token_ids, s.prompt_logprobs, detok, body.prompt_logprobs)
                for s in done
            ]
        every_choice = [choice for submitted in done for choice in submitted.choices]
        outputs = ChoiceOutputs(gens, every_choice, chat.engine, chat.metrics)
        echo = Echo(echoed, pieces, body.echo_only)
        if body.stream:
            return StreamingResponse(
                self._stream(outputs, body.n, echo, body.stream_usage, raw), media_type="text/event-stream"
            )
        await outputs.collect_while_connected(raw)
        return JSONOut(completion(gens, body.n, echoed, pieces, body.echo_only, vllm_pieces))

    def _specs(
        self, body: CompletionRequest, raw: Request, prompts: list[Prompt], base_id: str
    ) -> list[RequestSpec]:
        """One request into the engine per prompt, its constraint checked first (before any work); the
        first prompt's first choice has ``base_id``."""
        chat = self.chat
        constraint = chat.answer_constraint(body)
        alone_with_allowed_tokens(body, constraint)
        scope = chat.inputs.cache_scope(request_tenant(raw.scope), body.cache_salt)
        truncation = prompt_truncation(body, chat.max_model_len)
        bad_words = chat.bad_words(body)
        specs = []
        for i, prompt in enumerate(prompts):
            prompt_id = base_id if i == 0 else f"{base_id}-p{i}"
            specs.append(
                RequestSpec(
                    messages=[],
                    mm_processor_kwargs={},
                    scope=scope,
                    template=TemplateOptions(),
                    req_ids=[prompt_id, *(f"{prompt_id}-{j}" for j in range(1, body.n))],
                    sampling=lambda num_prompt_tokens, index: chat.sampling(
                        body, num_prompt_tokens, index, bad_words
                    ),
                    constraint=constraint.constraint if constraint is not None else None,
                    constraint_param=constraint.param if constraint is not None else None,
                    raw_prompt=RawPrompt(
                        prompt, body.add_special_tokens, "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                    ),
                    priority=body.priority,
                    truncation=truncation,
                )
            )
        return specs

    def _prompt_piece(
        self, submitted: Submitted, prompt: Prompt, echoed: str, body: CompletionRequest
    ) -> dict[str, Any]:
        """The echoed prompt's legacy logprobs; their offsets count the special tokens' text where the
        echo has it (ids decoded without ``skip_special_tokens``), not where the tokenizer added them to
        a text."""
        assert body.logprobs is not None
        skip = isinstance(prompt, str) or body.skip_special_tokens
        detok = IncrementalDetokenizer(self.chat.tokenizer, skip_special_tokens=skip)
        return prompt_logprobs(
            submitted.prompt_token_ids,
            submitted.prompt_logprobs,
            detok,
            echoed,
            body.logprobs,
            body.return_tokens_as_token_ids,
        )

    async def _submit(self, spec: RequestSpec) -> Submitted:
        """``submit``, its errors naming the prompt where chat's would name the messages."""
        try:
            return await submit(self.chat.inputs, self.chat.engine, spec)
        except MMServeError as exc:
            assert spec.raw_prompt is not None
            if exc.param == "messages" or exc.code == "kv_cache_exceeded":  # (the engine's names none)
                exc.param = spec.raw_prompt.param
            reword_length_error(exc, _PROMPT_WORDS)
            raise

    def _text(self, prompt: Prompt, skip_special_tokens: bool) -> str:
        """A prompt's text as echoed: as sent, or its token ids decoded as the answer's are."""
        if isinstance(prompt, str):
            return prompt
        return str(self.chat.tokenizer.decode(prompt, skip_special_tokens=skip_special_tokens))

    async def _stream(
        self, outputs: ChoiceOutputs, n: int, echo: Echo, stream_usage: StreamUsage, raw: Request
    ) -> AsyncIterator[str]:
        """SSE events: each choice's echoed prompt (with ``echo``, and its logprobs), then its text as it
        comes (none, and ``length``, where the answer is the prompt alone), then the usage (with
        ``include_usage``). Where the response returns token ids, a choice's first chunk carries the
        prompt's and each chunk the answer's it adds."""
        gens = outputs.gens
        try:
            logprobs = {
                gen.index: LegacyLogprobs(len(echo.texts[gen.index // n]))
                for gen in gens
                if gen.want_logprobs
            }
            unsent_prompts = {gen.index: gen.prompt_token_ids for gen in gens if gen.returns_token_ids}
            if echo.only:
                await outputs.collect_while_connected(raw)  # (each choice ran one token, not sent)
            for gen in gens:
                prompt = gen.index // n
                if echo.texts[prompt] or echo.pieces[prompt] is not None or echo.only:
                    reason = "length" if echo.only else None
                    token_ids: list[int] | None = [] if gen.returns_token_ids else None
                    yield sse(
                        chunk(
                            gen, echo.texts[prompt], stream_usage, echo.pieces[prompt], reason, token_ids,
                            unsent_prompts.pop(gen.index, None), echo_only=echo.only,
                        )
                    )  # fmt: skip
            if not echo.only:
                async for delta in outputs.deltas():
                    gen = gens[delta.index]
                    legacy = logprobs.get(delta.index)
                    piece = legacy.piece(delta.logprobs) if legacy is not None else None
                    token_ids = delta.token_ids if gen.returns_token_ids else None
                    prompt_ids = unsent_prompts.pop(delta.index, None)
                    yield sse(
                        chunk(
                            gen, delta.text, stream_usage, piece, delta.finish_reason, token_ids, prompt_ids
                        )
                    )
            if stream_usage is not StreamUsage.NONE:
                yield sse(envelope(gens[0], [], usage(gens, n, echo.only)))
            yield "data: [DONE]\n\n"
        except MMServeError as exc:
            yield sse_error_event(exc)
        finally:
            outputs.release()


@dataclass(frozen=True)
class Echo:
    """What a completion echoes of its prompts: each one's text ("" without ``echo``) and its legacy
    logprobs (None without ``logprobs``); ``only``: the prompts alone, no answer (``max_tokens`` 0)."""

    texts: list[str]
    pieces: list[dict[str, Any] | None]
    only: bool
