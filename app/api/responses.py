"""The OpenAI response shapes of a chat completion: the whole ``chat.completion`` object, stream chunks,
usage and logprobs, built from the accumulated ``Generation`` of each of a request's choices."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from app.api.detokenizer import IncrementalDetokenizer
from wire.protocol import TokenLogprobs


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
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    last_token_at: float | None = None  # unix time the latest output with tokens reached the API

    @property
    def created(self) -> int:
        return int(self.arrival)


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


def logprob_entries(entries: list[TokenLogprobs], detok: IncrementalDetokenizer) -> list[dict[str, Any]]:
    """OpenAI ``logprobs.content`` items: token text (``bytes:…`` for partial characters), raw bytes."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        token = detok.token_strings([token_id])[0]
        return {"token": token, "logprob": logprob, "bytes": detok.token_bytes(token_id)}

    result = []
    for entry in entries:
        item = one(entry.sampled.token_id, entry.sampled.logprob)
        item["top_logprobs"] = [one(lp.token_id, lp.logprob) for lp in entry.top]
        result.append(item)
    return result


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
