"""``POST /tokenize`` and ``POST /detokenize`` bodies, in vLLM's shapes (docs/api.md, "Tokenize")."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from app.api.request_fields import drop_known_fields, is_default
from app.api.sampling_schemas import MAX_CACHE_SALT_CHARS, null_is_default
from app.api.schemas import ChatMessageParam, one_prompt_end
from app.api.tool_schemas import MAX_TOOLS, ChatTool

# What renders or prepares ``messages``: with a ``prompt`` they would do nothing (vLLM's prompt form takes
# model, prompt, add_special_tokens and return_token_strs only), so one is refused unless at its default.
MESSAGES_ONLY = (
    "add_generation_prompt",
    "continue_final_message",
    "mm_processor_kwargs",
    "cache_salt",
    "tools",
    "chat_template_kwargs",
)


class TokenizeRequest(BaseModel):
    """Either ``prompt`` (text, tokenized as it is) or ``messages`` (rendered by the chat template, with
    every image and video counted as the chat request would count it). A field no spec knows is kept in
    ``model_extra``, for the log, as on chat."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = Field(None, min_length=1, validate_default=True)
    # None: True for a prompt, False for messages (their chat template adds the special tokens), as vLLM
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    mm_processor_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS, strict=True)
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)  # rendered as the chat request does
    chat_template_kwargs: dict[str, Any] | None = None  # as on chat

    @model_validator(mode="before")
    @classmethod
    def _sort_fields(cls, body: Any) -> Any:
        return drop_known_fields(body, cls.model_fields)  # chat_template, ...: refused here as on chat

    @field_validator("messages")
    @classmethod
    def _one_input(cls, messages: list[ChatMessageParam] | None, info: ValidationInfo) -> Any:
        if (messages is None) == (info.data.get("prompt") is None):
            raise ValueError("give either prompt or messages")
        return messages

    @field_validator("add_special_tokens")
    @classmethod
    def _template_adds_them(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("prompt") is None:
            raise ValueError("add_special_tokens must be false with messages: the chat template adds them")
        return value

    @field_validator(*MESSAGES_ONLY)
    @classmethod
    def _for_messages_only(cls, value: Any, info: ValidationInfo) -> Any:
        name = str(info.field_name)
        if info.data.get("prompt") is not None and not is_default(value, (cls.model_fields[name].default,)):
            raise ValueError(f"{name} applies to messages only, not to a prompt")
        return value

    _one_prompt_end = field_validator("continue_final_message")(one_prompt_end)
    _null_is_default = field_validator(
        "add_generation_prompt", "continue_final_message", "return_token_strs", mode="before"
    )(classmethod(null_is_default))


class DetokenizeRequest(BaseModel):
    """An unknown field is kept in ``model_extra``, for the log, as on chat."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)
