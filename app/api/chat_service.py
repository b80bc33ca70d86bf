"""Serves one chat completion: the request's fields become a ``RequestSpec`` (app/inputs/submission.py)
and the choices' outputs (app/api/outputs.py) become an OpenAI ``chat.completion`` or an SSE stream of
``chat.completion.chunk``s. A client that goes away aborts its choices in the engine."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from app.api.constraints import RequestedConstraint, requested_constraint
from app.api.detokenizer import IncrementalDetokenizer
from app.api.disconnect import unless_client_leaves
from app.api.error_handlers import sse_error_event
from app.api.json_out import JSONOut, sse
from app.api.outputs import ChoiceOutputs, Generation
from app.api.prompt_logprobs import vllm_prompt_logprobs
from app.api.request_fields import UnknownFields, template_variables, unknown_field_names
from app.api.request_guards import request_tenant
from app.api.responses import (
    chunk,
    completion,
    final_usage_chunk,
    tool_stream_deltas,
    with_prompt_token_ids,
)
from app.api.sampling import (
    SamplingDefaults,
    bad_words_token_ids,
    choice_sampling,
    prompt_truncation,
    sampling_params,
)
from app.api.sampling_schemas import MAX_REQUEST_ID_CHARS, SamplingRequest, StreamUsage
from app.api.schemas import ChatCompletionRequest
from app.api.tool_schemas import (
    ANSWER_KINDS,
    answers_or_calls,
    calls_only,
    check_tools,
    choice_name,
    template_tools,
    tool_constraint,
)
from app.errors import EngineUnavailableError, InvalidRequestError, MMServeError, ModelNotFoundError
from app.inputs.engine_client import EngineClient
from app.inputs.input_processor import InputProcessor
from app.inputs.submission import RequestSpec, Submitted, submit
from app.metrics import ApiMetrics
from wire.protocol import Constraint, SamplingParams
from workers.families.processing import TemplateOptions


@dataclass(frozen=True)
class RequestTools:
    json: str | None = None  # TemplateOptions.tools
    constraint: Constraint | None = None


class ChatService:
    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        inputs: InputProcessor,
        engine: EngineClient,
        metrics: ApiMetrics,
        defaults: SamplingDefaults | None = None,
        response_format_whitespace: bool = False,
    ) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.inputs = inputs
        self.engine = engine
        self.metrics = metrics
        self.defaults = defaults if defaults is not None else SamplingDefaults()
        self.response_format_whitespace = response_format_whitespace  # --response-format-whitespace any
        self.tokenizer = inputs.family.tokenizer
        self.unknown_fields = UnknownFields()

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self.check_ready(body)
        given = client_request_id(raw, body)
        arrival = time.time()
        spec = self.spec(body, raw)
        submitted = await unless_client_leaves(raw, submit(self.inputs, self.engine, spec))
        self.metrics.prompt_tokens.inc(submitted.num_prompt_tokens)
        response_id = f"chatcmpl-{given}" if given is not None else spec.req_ids[0]
        gens = [
            self.generation(body, submitted, index, response_id, arrival)
            for index in range(len(submitted.choices))
        ]
        answer_or_calls = answers_or_calls(spec.constraint)  # (once: it decodes the constraint's spec)
        for gen in gens:
            gen.parse_tool_calls, gen.answer_or_calls = body.parses_tool_calls, answer_or_calls
        outputs = ChoiceOutputs(gens, submitted.choices, self.engine, self.metrics)
        if body.stream:
            return StreamingResponse(
                self._stream(
                    outputs,
                    body.stream_usage,
                    body.parses_tool_calls and calls_only(body.tool_choice),
                    body.echoed,
                    submitted.prompt_text if body.return_prompt_text else None,
                ),
                media_type="text/event-stream",
            )
        await outputs.collect_while_connected(raw)
        response = completion(gens, body.echoed)
        if body.return_prompt_text:
            response["prompt_text"] = submitted.prompt_text
        if body.prompt_logprobs is not None:
            detok = IncrementalDetokenizer(self.tokenizer)
            response["prompt_logprobs"] = vllm_prompt_logprobs(
                submitted.prompt_token_ids, submitted.prompt_logprobs, detok, body.prompt_logprobs
            )
        return JSONOut(response)

    def generation(
        self,
        body: SamplingRequest,
        submitted: Submitted,
        choice: int,
        response_id: str,
        arrival: float,
        index: int | None = None,
        after_prompt: bool = False,
    ) -> Generation:
        """What accumulates choice ``choice`` of ``submitted``'s output (``index``: its index in the
        response, where it is not ``choice``; ``after_prompt``: its text decoded after the prompt's last
        ids, as a raw prompt's continuation; a chat answer is decoded alone, as transformers decodes it)."""
        return Generation(
            req_id=submitted.choices[choice].req_id,
            response_id=response_id,
            index=choice if index is None else index,
            model_name=self.model_name,
            arrival=arrival,
            num_prompt_tokens=submitted.num_prompt_tokens,
            num_cached_tokens=submitted.choices[0].first.num_cached_tokens,
            want_logprobs=body.num_top_logprobs() is not None,
            detok=IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=body.skip_special_tokens,
                stop=body.stop,
                include_stop_str=body.include_stop_str_in_output,
                min_tokens=body.min_tokens,
                context=list(submitted.prompt_tail) if after_prompt else None,
            ),
            stop_token_ids=frozenset([*self.inputs.family.eos_token_ids, *(body.stop_token_ids or ())]),
            prompt_token_ids=submitted.prompt_token_ids if body.return_token_ids else None,
            tokens_as_ids=body.return_tokens_as_token_ids,
        )

    def check_ready(self, body: SamplingRequest) -> None:
        """The model is this one and the engine answers; unknown fields are logged."""
        if body.model != self.model_name:
            raise ModelNotFoundError(f"The model `{body.model}` does not exist.")
        if not self.engine.is_ready:
            raise EngineUnavailableError("The engine is not ready.")
        self.unknown_fields.log(unknown_field_names(body))

    def spec(self, body: ChatCompletionRequest, raw: Request) -> RequestSpec:
        """The request as the input path takes it; its constraint is checked first, before any work."""
        constraint = self.answer_constraint(body)
        tools = self._tools(body, constraint)
        if tools.constraint is not None:
            constraint = RequestedConstraint(tools.constraint, "tools")
        alone_with_allowed_tokens(body, constraint)
        bad_words = self.bad_words(body)
        scope = self.inputs.cache_scope(request_tenant(raw.scope), body.cache_salt)
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        return RequestSpec(
            messages=body.messages,
            mm_processor_kwargs=body.mm_processor_kwargs or {},
            scope=scope,
            template=TemplateOptions(
                body.add_generation_prompt,
                body.continue_final_message,
                tools.json,
                template_variables(self.inputs.family, body.chat_template_kwargs),
                body.documents_json,
            ),
            req_ids=[base_id, *(f"{base_id}-{index}" for index in range(1, body.n))],
            sampling=lambda num_prompt_tokens, index: self.sampling(
                body, num_prompt_tokens, index, bad_words
            ),
            constraint=constraint.constraint if constraint is not None else None,
            constraint_param=constraint.param if constraint is not None else None,
            priority=body.priority,
            truncation=prompt_truncation(body, self.max_model_len),
        )

    def answer_constraint(self, body: SamplingRequest) -> RequestedConstraint | None:
        """The constraint ``response_format`` or ``structured_outputs`` asks for, checked (a 400 now)."""
        return requested_constraint(
            body.response_format, body.structured_outputs, self.response_format_whitespace
        )

    def _tools(self, body: ChatCompletionRequest, constraint: RequestedConstraint | None) -> RequestTools:
        """The request's tools for the template (with a history of calls, an empty list: the template
        that renders them) and the constraint its ``tool_choice`` asks for."""
        check_tools(body.tools, body.tool_choice)
        family = self.inputs.family
        rendered = template_tools(family, body.tools, body.messages)
        if rendered is None:
            return RequestTools()
        parser = family.tool_call_parser
        assert parser is not None  # template_tools refuses a family without one
        answer = constraint.constraint if constraint is not None else None
        beside = answer if answer is not None and answer.kind in ANSWER_KINDS else None
        tool_cons = tool_constraint(body.tools, body.tool_choice, body.parallel_tool_calls, parser, beside)
        if tool_cons is not None and constraint is not None and beside is None:
            raise InvalidRequestError(
                f"tools with tool_choice {choice_name(body.tool_choice)!r} cannot be combined with "
                f"{constraint.param}: both constrain the answer",
                param=constraint.param,
            )
        return RequestTools(rendered, tool_cons)

    def bad_words(self, body: SamplingRequest) -> tuple[tuple[int, ...], ...] | None:
        """The request's ``bad_words`` as token sequences, tokenized once per request (a 400 now, before
        any work, for an id outside the vocabulary)."""
        if not body.bad_words:
            return None
        return bad_words_token_ids(body.bad_words, self.tokenizer, self.inputs.family.vocab_size)

    def sampling(
        self,
        body: SamplingRequest,
        num_prompt_tokens: int,
        index: int,
        bad_words: tuple[tuple[int, ...], ...] | None = None,
    ) -> SamplingParams:
        """Choice ``index``'s parameters for a prompt of ``num_prompt_tokens`` (``bad_words``: the
        request's, from ``bad_words``)."""
        family = self.inputs.family
        first = sampling_params(
            body,
            self.defaults,
            num_prompt_tokens,
            self.max_model_len,
            family.eos_token_ids,
            family.vocab_size,
        )
        params = choice_sampling(first, index)
        if bad_words is not None:
            params = msgspec.structs.replace(params, bad_words=bad_words)
        if index == 0 and body.num_prompt_logprobs() is not None:  # (the others echo the first's)
            params = msgspec.structs.replace(params, num_prompt_logprobs=body.num_prompt_logprobs())
        return params

    async def _stream(
        self,
        outputs: ChoiceOutputs,
        stream_usage: StreamUsage,
        calls_only: bool = False,
        echoed: str = "",
        prompt_text: str | None = None,
    ) -> AsyncIterator[str]:
        """SSE events: each choice's role chunk (its content null where the answer is calls only, as
        OpenAI's; the prompt's token ids and ``prompt_text`` where the response returns them), and its
        ``echoed`` text, then its deltas as they come, then the usage."""
        gens = outputs.gens
        try:
            for gen in gens:
                first = {"role": "assistant", "content": None if calls_only else ""}
                role_chunk = with_prompt_token_ids(chunk(gen, first, stream_usage), gen)
                if prompt_text is not None:
                    role_chunk["prompt_text"] = prompt_text
                yield sse(role_chunk)
            for gen in gens if echoed else ():
                yield sse(chunk(gen, {"content": echoed}, stream_usage))
            calls = {gen.index: gen.call_streamer() for gen in gens if gen.parse_tool_calls}
            async for delta in outputs.deltas():
                gen = gens[delta.index]
                logprobs = {"content": delta.logprobs} if gen.want_logprobs else None
                token_ids = delta.token_ids if gen.returns_token_ids else None
                streamer = calls.get(delta.index)
                if streamer is None:
                    content = {"content": delta.text} if delta.text else {}
                    yield sse(chunk(gen, content, stream_usage, logprobs, delta.finish_reason, token_ids))
                    continue
                for event in tool_stream_deltas(streamer, delta.text, gen):
                    yield sse(chunk(gen, event, stream_usage))
                if logprobs is not None or token_ids is not None or delta.finish_reason is not None:
                    reason = delta.finish_reason
                    if reason is not None:
                        reason = streamer.finish_reason(reason)
                    yield sse(chunk(gen, {}, stream_usage, logprobs, reason, token_ids))
            if stream_usage is not StreamUsage.NONE:
                yield sse(final_usage_chunk(gens))
            yield "data: [DONE]\n\n"
        except MMServeError as exc:
            yield sse_error_event(exc)
        finally:
            outputs.release()


def alone_with_allowed_tokens(body: SamplingRequest, constraint: RequestedConstraint | None) -> None:
    """``allowed_token_ids`` and an output constraint together could leave no token: a 400."""
    if constraint is not None and body.allowed_token_ids is not None:
        msg = f"allowed_token_ids cannot be combined with an output constraint ({constraint.param})"
        raise InvalidRequestError(msg, param="allowed_token_ids")


def client_request_id(raw: Request, body: SamplingRequest) -> str | None:
    """The id a client gave its request: the ``X-Request-Id`` header over the body's ``request_id``, as
    vLLM reads them (the same bounds: 1-128 printable characters, or a 400 naming the header)."""
    header = raw.headers.get("x-request-id")
    if header is None:
        return body.request_id
    if not 1 <= len(header) <= MAX_REQUEST_ID_CHARS or not header.isprintable():
        raise InvalidRequestError(
            f"the X-Request-Id header must be 1 to {MAX_REQUEST_ID_CHARS} printable characters",
            param="x-request-id",
        )
    return header
