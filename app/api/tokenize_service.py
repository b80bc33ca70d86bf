"""Counts tokens as a chat request would (``/tokenize``) and turns ids back into text (``/detokenize``).

A ``messages`` body goes through the same preparation as a chat request: media fetched under the same
policy, processed through the processor cache (a later chat request with the same media is a hit), each
item counted with the model's own placeholder count. Nothing reaches the engine."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from app.api.request_guards import request_tenant
from app.api.tokenize_schemas import DetokenizeRequest, TokenizeRequest
from app.api.tool_schemas import check_tools, template_tools
from app.errors import InvalidRequestError, ModelNotFoundError
from app.inputs.input_processor import InputProcessor
from app.inputs.submission import prompt_token_ids
from workers.families.processing import TemplateOptions


class TokenizeService:
    def __init__(self, model_name: str, max_model_len: int, inputs: InputProcessor) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.inputs = inputs
        self.tokenizer = inputs.family.tokenizer

    async def tokenize(self, body: TokenizeRequest, raw: Request) -> dict[str, Any]:
        self._check_model(body.model)
        if body.messages is None:
            add_special_tokens = body.add_special_tokens is not False
            token_ids = list(self.tokenizer(body.prompt, add_special_tokens=add_special_tokens)["input_ids"])
        else:
            token_ids = await self._chat_prompt(body, raw)
        token_strs = self.tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
        return {
            "count": len(token_ids),
            "max_model_len": self.max_model_len,
            "tokens": token_ids,
            "token_strs": token_strs,
        }

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(body.model)
        vocab_size = self.inputs.family.vocab_size
        outside = sorted({t for t in body.tokens if not 0 <= t < vocab_size})
        if outside:
            raise InvalidRequestError(
                f"tokens outside the model's vocabulary of {vocab_size}: {outside[:8]}", param="tokens"
            )
        return {"prompt": self.tokenizer.decode(body.tokens)}

    async def _chat_prompt(self, body: TokenizeRequest, raw: Request) -> list[int]:
        """The prompt ids a chat request with these messages would send (``usage.prompt_tokens`` is
        their number)."""
        assert body.messages is not None
        scope = self.inputs.cache_scope(request_tenant(raw.scope), body.cache_salt)
        check_tools(body.tools, None)
        tools = template_tools(self.inputs.family, body.tools, body.messages)
        template = TemplateOptions(body.add_generation_prompt, body.continue_final_message, tools)
        return await prompt_token_ids(
            self.inputs, body.messages, body.mm_processor_kwargs or {}, scope, template
        )

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(f"The model `{model}` does not exist.")
