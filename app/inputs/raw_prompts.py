"""A prompt given as it is (``/v1/completions``): no chat template, no media. Its text is tokenized once,
as vLLM's completions do (``add_special_tokens``: the tokenizer's BOS first), or its token ids are taken
as given; either is checked (ids within the vocabulary, no media placeholder, which would stand for an
item the request does not have) and becomes a ``PreparedRequest`` whose ids ``resolve`` leaves alone
(docs/architecture.md, "Request path")."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from app.errors import InvalidRequestError
from app.inputs.input_processor import PreparedRequest
from app.inputs.prompts import OFF_LOOP_PROMPT_CHARS
from workers.families.processing import FamilyProcessor


@dataclass(frozen=True)
class RawPrompt:
    prompt: str | list[int]  # text, or token ids
    add_special_tokens: bool = True  # text only
    param: str = "prompt"  # where it sits in the request, for its errors


async def prepare_prompt(family: FamilyProcessor, raw: RawPrompt) -> PreparedRequest:
    """The prompt's ``PreparedRequest`` (its text, "" for ids; its ids); a 400 naming ``raw.param`` for
    an id outside the vocabulary, a media placeholder, or no token at all."""
    if isinstance(raw.prompt, str):
        text = raw.prompt
        if len(text) > OFF_LOOP_PROMPT_CHARS:  # (app/inputs/prompts.py: not on the event loop)
            token_ids = await asyncio.to_thread(_encode, family, text, raw.add_special_tokens)
        else:
            token_ids = _encode(family, text, raw.add_special_tokens)
    else:
        text, token_ids = "", list(raw.prompt)
        outside = sorted({t for t in token_ids if t >= family.vocab_size})
        if outside:
            raise InvalidRequestError(
                f"{raw.param} holds token ids outside the model's vocabulary of {family.vocab_size}: "
                f"{outside[:8]}",
                param=raw.param,
                code="invalid_value",
            )
    given = set(token_ids)
    placeholders = {t for t in (family.image_token_id, family.video_token_id) if t is not None and t in given}
    if placeholders:
        names = ", ".join(repr(family.tokenizer.convert_ids_to_tokens(t)) for t in sorted(placeholders))
        raise InvalidRequestError(
            f"{raw.param} holds the media placeholder token {names}, which stands for an image or a video: "
            "a prompt here is text; send media to /v1/chat/completions",
            param=raw.param,
        )
    if not token_ids:
        raise InvalidRequestError(f"{raw.param} has no tokens", param=raw.param)
    return PreparedRequest(text, [], prompt_token_ids=token_ids, ids_given=True)


def _encode(family: FamilyProcessor, text: str, add_special_tokens: bool) -> list[int]:
    return list(family.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
