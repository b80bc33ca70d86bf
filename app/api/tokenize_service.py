"""Counts tokens as a chat request would (``/tokenize``) and turns ids back into text (``/detokenize``).

A ``messages`` body goes through the same preparation as a chat request: media fetched under the same
policy, processed through the processor cache (a later chat request with the same media is a hit), each
item counted with the model's own placeholder count. Nothing reaches the engine.

A ``prompt`` over ``OFF_LOOP_PROMPT_CHARS`` is tokenized in a thread, as the chat request's prompt is, and
more than ``OFF_LOOP_TOKEN_IDS`` ids are turned into strings or text in one: megabytes would otherwise
hold the event loop, and every other request of the API process, for seconds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from fastapi import Request

from app.api.request_fields import UnknownFields, template_variables, unknown_field_names
from app.api.request_guards import request_tenant
from app.api.tokenize_schemas import DetokenizeRequest, TokenizeRequest
from app.api.tool_schemas import check_tools, template_tools
from app.errors import InvalidRequestError, ModelNotFoundError
from app.inputs.input_processor import InputProcessor
from app.inputs.prompts import OFF_LOOP_PROMPT_CHARS
from app.inputs.submission import prompt_token_ids
from workers.families.processing import TemplateOptions

# More ids are decoded or turned into strings in a thread: 65,536 take 10-20 ms, a million 0.15-0.3 s
OFF_LOOP_TOKEN_IDS = 65_536

P = ParamSpec("P")
T = TypeVar("T")


class TokenizeService:
    def __init__(self, model_name: str, max_model_len: int, inputs: InputProcessor) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.inputs = inputs
        self.tokenizer = inputs.family.tokenizer
        self.unknown_fields = UnknownFields()  # logged once each, as on chat

    async def tokenize(self, body: TokenizeRequest, raw: Request) -> dict[str, Any]:
        self._check_model(body.model)
        self.unknown_fields.log(unknown_field_names(body))
        if body.prompt is not None:
            long = len(body.prompt) > OFF_LOOP_PROMPT_CHARS
            token_ids = await _off_loop_if(
                long, self._encode, body.prompt, body.add_special_tokens is not False
            )
        else:
            token_ids = await self._chat_prompt(body, raw)
        token_strs = None
        if body.return_token_strs:
            long = len(token_ids) > OFF_LOOP_TOKEN_IDS
            token_strs = await _off_loop_if(long, self.tokenizer.convert_ids_to_tokens, token_ids)
        return {
            "count": len(token_ids),
            "max_model_len": self.max_model_len,
            "tokens": token_ids,
            "token_strs": token_strs,
        }

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(body.model)
        self.unknown_fields.log(unknown_field_names(body))
        text = await _off_loop_if(len(body.tokens) > OFF_LOOP_TOKEN_IDS, self._decode, body.tokens)
        return {"prompt": text}

    def _encode(self, prompt: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    def _decode(self, token_ids: list[int]) -> str:
        vocab_size = self.inputs.family.vocab_size
        outside = sorted({t for t in token_ids if not 0 <= t < vocab_size})
        if outside:
            raise InvalidRequestError(
                f"tokens outside the model's vocabulary of {vocab_size}: {outside[:8]}",
                param="tokens",
                code="invalid_value",
            )
        return self.tokenizer.decode(token_ids)

    async def _chat_prompt(self, body: TokenizeRequest, raw: Request) -> list[int]:
        """The prompt ids a chat request with these messages would send (``usage.prompt_tokens`` is
        their number)."""
        assert body.messages is not None
        scope = self.inputs.cache_scope(request_tenant(raw.scope), body.cache_salt)
        check_tools(body.tools, None)
        tools = template_tools(self.inputs.family, body.tools, body.messages)
        variables = template_variables(self.inputs.family, body.chat_template_kwargs)
        template = TemplateOptions(body.add_generation_prompt, body.continue_final_message, tools, variables)
        return await prompt_token_ids(
            self.inputs, body.messages, body.mm_processor_kwargs or {}, scope, template
        )

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(f"The model `{model}` does not exist.")


async def _off_loop_if(long: bool, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``work(*args, **kwargs)``, in a thread when ``long``: the loop serves on meanwhile (the tokenizer's
    Rust side releases the GIL, and it is only ever called the same way, which it allows from two threads
    at once: app/inputs/prompts.py)."""
    return await asyncio.to_thread(work, *args, **kwargs) if long else work(*args, **kwargs)
