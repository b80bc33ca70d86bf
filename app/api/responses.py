"""The OpenAI response shapes of a chat completion: the whole ``chat.completion`` object, stream chunks and
usage, built from the accumulated ``Generation`` of each of a request's choices (app/api/outputs.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.api.outputs import Generation, usage_counts
from app.api.sampling_schemas import StreamUsage
from app.api.tool_calls import ToolCall, ToolCallDelta, ToolCallStreamer
from app.api.tool_calls import finish_reason as tool_finish_reason


def usage(gens: list[Generation]) -> dict[str, Any]:
    """The prompt once (it was prefilled once), every choice's completion."""
    num_completion_tokens = sum(len(gen.token_ids) for gen in gens)
    return usage_counts(gens[0].num_prompt_tokens, num_completion_tokens, gens[0].num_cached_tokens)


def completion(gens: list[Generation], echoed: str = "") -> dict[str, Any]:
    """The whole ``chat.completion``; ``echoed``: text each choice's content begins with (``echo``)."""
    choices = []
    for gen in gens:
        message: dict[str, Any] = {"role": "assistant", "content": gen.text}
        reason = gen.finish_reason
        if gen.parse_tool_calls:
            parsed = gen.parsed()
            message["content"] = parsed.content
            if parsed.tool_calls:
                message["tool_calls"] = [tool_call_json(call) for call in parsed.tool_calls]
            reason = tool_finish_reason(parsed, reason or "stop")
        if echoed:
            message["content"] = echoed + (message["content"] or "")
        choice = {
            "index": gen.index,
            "message": message,
            "logprobs": {"content": gen.logprobs} if gen.want_logprobs else None,
            "finish_reason": reason,
        }
        if gen.returns_token_ids:
            choice["token_ids"] = list(gen.token_ids)
        choices.append(choice)
    result = _envelope(gens[0], "chat.completion", choices, usage(gens))
    return with_prompt_token_ids(result, gens[0])


def with_prompt_token_ids(result: dict[str, Any], gen: Generation) -> dict[str, Any]:
    """``result`` with the prompt's token ids at its top level, where ``gen``'s response returns them
    (vLLM's place for chat: a response's first chunk, or the whole response)."""
    if gen.prompt_token_ids is not None:
        result["prompt_token_ids"] = list(gen.prompt_token_ids)
    return result


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_stream_deltas(streamer: ToolCallStreamer, text: str, gen: Generation) -> list[dict[str, Any]]:
    """The stream chunks' ``delta`` objects for a choice's new text: content outside calls, and each call
    as its id and name, then its arguments (once ``gen`` finished, held text is released)."""
    last = gen.finish_reason is not None
    events = streamer.push(text) + (streamer.finish(gen.cut) if last else [])
    return [
        {"tool_calls": [tool_call_delta_json(e)]} if isinstance(e, ToolCallDelta) else {"content": e.content}
        for e in events
    ]


def tool_call_delta_json(delta: ToolCallDelta) -> dict[str, Any]:
    """One entry of a stream chunk's ``delta.tool_calls``: id, type and name first, then arguments."""
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    function = {"name": delta.name, "arguments": delta.arguments}
    return {"index": delta.index, "id": delta.id, "type": "function", "function": function}


def chunk(
    gen: Generation,
    delta: dict[str, Any],
    stream_usage: StreamUsage,
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion.chunk`` of one choice (``token_ids``: the answer's it adds, where the response
    returns them); with usage every chunk says ``usage: null`` and a final one (``final_usage_chunk``)
    carries the totals, as OpenAI streams do, or with continuous usage each says the choice's so far."""
    choice = stream_choice(gen.index, {"delta": delta}, logprobs, finish_reason, token_ids)
    return stream_envelope(_envelope(gen, "chat.completion.chunk", [choice], None), gen, stream_usage)


def stream_choice(
    index: int,
    content: dict[str, Any],
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    token_ids: list[int] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """A stream chunk's choice (chat's or a legacy completion's, by its ``content``: ``delta`` or
    ``text``), with the token ids it carries where the response returns them."""
    choice: dict[str, Any] = {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = list(prompt_token_ids)
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def stream_envelope(
    result: dict[str, Any],
    gen: Generation,
    stream_usage: StreamUsage,
    num_completion_tokens: int | None = None,
) -> dict[str, Any]:
    """A chunk's ``usage`` as ``stream_usage`` says: left out, null, or ``gen``'s so far (its output's
    tokens, or ``num_completion_tokens``)."""
    if stream_usage is StreamUsage.NONE:
        del result["usage"]
    elif stream_usage is StreamUsage.CONTINUOUS:
        result["usage"] = gen.usage(num_completion_tokens)
    return result


def final_usage_chunk(gens: list[Generation]) -> dict[str, Any]:
    return _envelope(gens[0], "chat.completion.chunk", [], usage(gens))


def _envelope(gen: Generation, obj: str, choices: list[dict[str, Any]], usage: Any) -> dict[str, Any]:
    return {
        "id": gen.response_id,
        "object": obj,
        "created": gen.created,
        "model": gen.model_name,
        "choices": choices,
        "usage": usage,
    }
