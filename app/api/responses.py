"""The OpenAI response shapes of a chat completion: the whole ``chat.completion`` object, stream chunks and
usage, built from the accumulated ``Generation`` of each of a request's choices (app/api/outputs.py)."""

from __future__ import annotations

import json
from typing import Any

from app.api.outputs import Generation


def usage(gens: list[Generation]) -> dict[str, Any]:
    """The prompt once (it was prefilled once), every choice's completion."""
    num_completion_tokens = sum(len(gen.token_ids) for gen in gens)
    return {
        "prompt_tokens": gens[0].num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": gens[0].num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gens[0].num_cached_tokens},
    }


def completion(gens: list[Generation]) -> dict[str, Any]:
    choices = [
        {
            "index": gen.index,
            "message": {"role": "assistant", "content": gen.text},
            "logprobs": {"content": gen.logprobs} if gen.want_logprobs else None,
            "finish_reason": gen.finish_reason,
        }
        for gen in gens
    ]
    return _envelope(gens[0], "chat.completion", choices, usage(gens))


def chunk(
    gen: Generation,
    delta: dict[str, Any],
    include_usage: bool,
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """A ``chat.completion.chunk`` of one choice; with ``include_usage`` every chunk says ``usage: null``
    and a final one (``final_usage_chunk``) carries the totals, as OpenAI streams do."""
    choice = {"index": gen.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    result = _envelope(gen, "chat.completion.chunk", [choice], None)
    if not include_usage:
        del result["usage"]
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


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
