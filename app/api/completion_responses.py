"""The OpenAI response shapes of a legacy completion (``text_completion``): the whole object and its stream
chunks, built from each choice's ``Generation`` (app/api/outputs.py). Choices are numbered prompt by
prompt (prompt i's choice j is ``i * n + j``); the usage counts each prompt once and every choice's
tokens. Logprobs take the legacy form: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the sampled
token and the top alternatives, as vLLM's) and ``text_offset`` (each token's offset in the choice's
text, the echoed prompt included, counted in characters); with ``echo`` they begin with the prompt's
tokens, the first of which has none (nothing comes before it)."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from app.api.detokenizer import IncrementalDetokenizer
from app.api.outputs import Generation, finite, token_texts, usage_counts
from app.api.responses import stream_choice, stream_envelope
from app.api.sampling_schemas import StreamUsage
from wire.protocol import PromptLogprobs

OBJECT = "text_completion"


def usage(gens: list[Generation], n: int, echo_only: bool = False) -> dict[str, Any]:
    """Each prompt's tokens once (its first choice's count), every choice's completion (none where the
    answer is the prompt alone)."""
    firsts = gens[::n]
    num_prompt = sum(gen.num_prompt_tokens for gen in firsts)
    num_completion = 0 if echo_only else sum(len(gen.token_ids) for gen in gens)
    return usage_counts(num_prompt, num_completion, sum(gen.num_cached_tokens for gen in firsts))


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
            "top_logprobs": [_top(entry) for entry in entries],
            "text_offset": offsets,
        }


def _top(entry: dict[str, Any]) -> dict[str, float]:
    """A token's ``top_logprobs`` item: itself and its alternatives, by token text."""
    return {entry["token"]: entry["logprob"]} | {
        alt["token"]: alt["logprob"] for alt in entry["top_logprobs"]
    }


def prompt_logprobs(
    prompt_ids: Sequence[int],
    run: PromptLogprobs,
    detok: IncrementalDetokenizer,
    echoed: str,
    num_top: int,
    as_ids: bool = False,
) -> dict[str, Any]:
    """An echoed prompt's legacy logprobs: its first token's null, then each token's (the engine's
    ``run``) given those before it, with ``num_top`` alternatives; each token's ``text_offset`` is where
    its text begins in the prompt as its ids decode (``detok``, fresh: pushed here), within ``echoed``;
    ``as_ids``: tokens spelt ``token_id:<id>``."""
    tokens = token_texts(detok, list(prompt_ids), as_ids)
    offsets = []
    length = 0
    for token_id in prompt_ids:
        offsets.append(min(length, len(echoed)))
        length += len(detok.push([token_id]))
    logprobs: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    assert run.first == 1 and run.count == len(prompt_ids) - 1
    for i, token in enumerate(tokens[1:]):  # (as chat's entries read: _top)
        logprob = finite(run.logprobs[i])
        logprobs.append(logprob)
        top_ids, top_logprobs = run.top(i)
        top = {token: logprob}  # then each alternative by its text, into the one dict
        for text, alt_logprob in zip(
            token_texts(detok, top_ids[:num_top], as_ids), top_logprobs, strict=False
        ):
            top[text] = finite(alt_logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def joined(first: dict[str, Any] | None, then: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two runs of legacy logprobs as one (the prompt's, then the answer's)."""
    if first is None or then is None:
        return then if first is None else first
    return {key: first[key] + then[key] for key in first}


def completion(
    gens: list[Generation],
    n: int,
    echoed: list[str],
    prompt_pieces: list[dict[str, Any] | None],
    echo_only: bool = False,
    vllm_prompt_logprobs: list[list[Any]] | None = None,
) -> dict[str, Any]:
    """The whole ``text_completion``; ``echoed``: each prompt's text before its choices' (or ""), with
    its logprobs (``prompt_pieces``, None without); ``echo_only``: the answers are left out;
    ``vllm_prompt_logprobs``: each prompt's, where vLLM's ``prompt_logprobs`` asked for them; the
    prompt's and the answer's token ids with each choice, where the response returns them."""
    choices = []
    for gen in gens:
        prompt = gen.index // n
        prefix = echoed[prompt]
        logprobs = None
        if gen.want_logprobs and not echo_only:
            logprobs = LegacyLogprobs(len(prefix)).piece(gen.logprobs)
        choice = {
            "index": gen.index,
            "text": prefix if echo_only else prefix + gen.text,
            "logprobs": joined(prompt_pieces[prompt], logprobs),
            "finish_reason": "length" if echo_only else gen.finish_reason,
        }
        if vllm_prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs[prompt]
        if gen.prompt_token_ids is not None:
            choice["prompt_token_ids"] = list(gen.prompt_token_ids)
            choice["token_ids"] = [] if echo_only else list(gen.token_ids)
        choices.append(choice)
    return envelope(gens[0], choices, usage(gens, n, echo_only))


def chunk(
    gen: Generation,
    text: str,
    stream_usage: StreamUsage,
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    token_ids: list[int] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    echo_only: bool = False,
) -> dict[str, Any]:
    """A stream chunk of one choice, with the answer's ``token_ids`` it adds and the ``prompt_token_ids``
    (on a choice's first chunk) where the response returns them; with usage each says ``usage: null``
    and a last one (``envelope(gen, [], usage(...))``) carries the totals, or with continuous usage each
    says the choice's so far (no completion tokens where the answer is the prompt alone)."""
    choice = stream_choice(gen.index, {"text": text}, logprobs, finish_reason, token_ids, prompt_token_ids)
    return stream_envelope(envelope(gen, [choice], None), gen, stream_usage, 0 if echo_only else None)


def envelope(gen: Generation, choices: list[dict[str, Any]], usage: Any) -> dict[str, Any]:
    return {
        "id": gen.response_id,
        "object": OBJECT,
        "created": gen.created,
        "model": gen.model_name,
        "choices": choices,
        "usage": usage,
    }
