"""The OpenAI response shapes of a legacy completion (``text_completion``): the whole object and its stream
chunks, built from each choice's ``Generation`` (app/api/outputs.py). Choices are numbered prompt by
prompt (prompt i's choice j is ``i * n + j``); the usage counts each prompt once and every choice's
tokens. Logprobs take the legacy form: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the sampled
token and the top alternatives, as vLLM's) and ``text_offset`` (each token's offset in the choice's
text, the echoed prompt included, counted in characters)."""

from __future__ import annotations

import codecs
from typing import Any

from app.api.outputs import Generation

OBJECT = "text_completion"


def usage(gens: list[Generation], n: int) -> dict[str, Any]:
    """Each prompt's tokens once (its first choice's count), every choice's completion."""
    firsts = gens[::n]
    num_prompt = sum(gen.num_prompt_tokens for gen in firsts)
    num_completion = sum(len(gen.token_ids) for gen in gens)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": sum(gen.num_cached_tokens for gen in firsts)},
    }


class LegacyLogprobs:
    """Turns a choice's logprob entries (chat's form, app/api/outputs.py) into the legacy form, piece by
    piece as they stream, each token's ``text_offset`` following on from the previous piece's: the
    characters its bytes complete, so a token that is part of a character points at that character."""

    def __init__(self, start: int) -> None:
        self._offset = start  # where the next token's text begins: after the echoed prompt, if any
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def piece(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        offsets = []
        for entry in entries:
            offsets.append(self._offset)
            self._offset += len(self._utf8.decode(bytes(entry["bytes"])))
        return {
            "tokens": [entry["token"] for entry in entries],
            "token_logprobs": [entry["logprob"] for entry in entries],
            "top_logprobs": [
                {entry["token"]: entry["logprob"]}
                | {alt["token"]: alt["logprob"] for alt in entry["top_logprobs"]}
                for entry in entries
            ],
            "text_offset": offsets,
        }


def completion(gens: list[Generation], n: int, echoed: list[str]) -> dict[str, Any]:
    """The whole ``text_completion``; ``echoed``: each prompt's text before its choices' (or "")."""
    choices = []
    for gen in gens:
        prefix = echoed[gen.index // n]
        logprobs = LegacyLogprobs(len(prefix)).piece(gen.logprobs) if gen.want_logprobs else None
        choices.append(
            {
                "index": gen.index,
                "text": prefix + gen.text,
                "logprobs": logprobs,
                "finish_reason": gen.finish_reason,
            }
        )
    return envelope(gens[0], choices, usage(gens, n))


def chunk(
    gen: Generation,
    text: str,
    include_usage: bool,
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """A stream chunk of one choice; with ``include_usage`` each says ``usage: null`` and a last one
    (``envelope(gen, [], usage(...))``) carries the totals."""
    choice = {"index": gen.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    result = envelope(gen, [choice], None)
    if not include_usage:
        del result["usage"]
    return result


def envelope(gen: Generation, choices: list[dict[str, Any]], usage: Any) -> dict[str, Any]:
    return {
        "id": gen.response_id,
        "object": OBJECT,
        "created": gen.created,
        "model": gen.model_name,
        "choices": choices,
        "usage": usage,
    }
