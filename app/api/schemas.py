"""OpenAI chat-completions schemas, as vLLM accepts them: validated here, at the HTTP edge.

Every field OpenAI or vLLM defines is either declared here or classified in
``app.api.request_fields`` (accepted without effect, or refused by name unless it carries its default);
a field no spec knows is kept in ``model_extra`` and logged once by the service. Part lists are
dispatched on ``type`` by hand, so a
validation error's location names the real path (``messages[0].content[1].image_url.url``) instead of
pydantic's union-member labels. Responses dump with plain ``model_dump_json()``: optional fields the
OpenAI wire format sends as ``null`` stay, and a stream delta drops its unset ``role``/``content``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal
from uuid import uuid4

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from app.api.constraint_schemas import ResponseFormat, StructuredOutputs
from app.api.request_fields import drop_known_fields
from app.api.tool_schemas import MAX_TOOLS, ChatTool, ToolCallParam, ToolChoice

FinishReasonLiteral = Literal["stop", "length", "abort"]  # "abort" as in vLLM; the SDK's Literal lacks it
# Integers that travel to the engine must fit its wire format and torch (a seed is a torch.long, as in vLLM).
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 16  # choices per request (docs/api.md, "Several choices")
MAX_TOKEN_ID_LISTS = 4096  # entries of logit_bias, allowed_token_ids or stop_token_ids
MAX_REQUEST_ID_CHARS = 128

# ---------------------------------------------------------------- request


class _Request(BaseModel):
    """Keeps a field it does not declare in ``model_extra``, read by nothing but the log of unknown
    fields (``app.api.request_fields``)."""

    model_config = ConfigDict(extra="allow")


MAX_UUID_CHARS = 128
MAX_CACHE_SALT_CHARS = 1024


def _check_uuid(uuid: Any) -> Any:
    """A media id: 1-128 printable characters (docs/api.md, "Media ids")."""
    if uuid is None:
        return None
    if not isinstance(uuid, str):
        raise ValueError(f"uuid must be a string, got {type(uuid).__name__}")
    if not 1 <= len(uuid) <= MAX_UUID_CHARS or not uuid.isprintable() or not uuid.strip():
        raise ValueError(f"uuid must be 1 to {MAX_UUID_CHARS} printable characters")
    return uuid


MediaUuid = Annotated[str | None, BeforeValidator(_check_uuid)]


def null_is_default(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """A before-validator: clients often send an explicit null for "use the default"."""
    return cls.model_fields[info.field_name or ""].default if value is None else value


def one_prompt_end(continue_final_message: bool, info: ValidationInfo) -> bool:
    """A chat template either opens the assistant's turn or leaves the last message open, not both."""
    if continue_final_message and info.data.get("add_generation_prompt"):
        raise ValueError("continue_final_message needs add_generation_prompt false")
    return continue_final_message


class TextContentPart(_Request):
    type: Literal["text"]
    text: str
    uuid: Any = Field(None, exclude=True)

    @field_validator("uuid")
    @classmethod
    def _no_uuid(cls, uuid: Any) -> None:
        if uuid is not None:
            raise ValueError("uuid is only allowed on image_url and video_url parts")


class ImageURL(_Request):
    url: str  # scheme and data-URL form are checked where the image is fetched (app.media.images)
    detail: Literal["auto", "low", "high"] | None = None  # accepted, not used


def media_or_uuid(media: Any, info: ValidationInfo) -> Any:
    """A media part leaves its media out (``null`` or no key) only with a uuid naming media sent before."""
    if media is None and "uuid" in info.data and info.data["uuid"] is None:
        msg = "{name} is required unless the part carries a uuid of media sent before"
        raise PydanticCustomError("missing", msg, {"name": info.field_name})
    return media


class ImageURLContentPart(_Request):
    type: Literal["image_url"]
    uuid: MediaUuid = None  # declared before the media: its validator reads it
    image_url: ImageURL | None = Field(None, validate_default=True)

    _check_media = field_validator("image_url")(media_or_uuid)

    @property
    def url(self) -> str | None:
        return self.image_url.url if self.image_url is not None else None


class VideoURL(_Request):
    url: str  # http(s)://, data:video/...;base64, or file:// (checked where the video is fetched)


class VideoURLContentPart(_Request):
    type: Literal["video_url"]
    uuid: MediaUuid = None
    video_url: VideoURL | None = Field(None, validate_default=True)

    _check_media = field_validator("video_url")(media_or_uuid)

    @property
    def url(self) -> str | None:
        return self.video_url.url if self.video_url is not None else None


ContentPart = TextContentPart | ImageURLContentPart | VideoURLContentPart
_PART_MODELS: dict[str, type[BaseModel]] = {
    "text": TextContentPart,
    "image_url": ImageURLContentPart,
    "video_url": VideoURLContentPart,
}


def _validate_part(part: Any) -> Any:
    """Dispatch on ``type`` so that errors carry the part's own path, not a union label."""
    if isinstance(part, BaseModel):
        return part
    part_type = part.get("type") if isinstance(part, dict) else None
    if isinstance(part_type, str) and part_type in _PART_MODELS:
        return _PART_MODELS[part_type].model_validate(part)
    got = repr(part_type) if isinstance(part, dict) else type(part).__name__
    msg = "content part type must be 'text', 'image_url' or 'video_url', got {got}"
    error = PydanticCustomError("invalid_content_part", msg, {"got": got})
    loc = ("type",) if isinstance(part, dict) else ()
    raise ValidationError.from_exception_data("ContentPart", [{"type": error, "loc": loc, "input": part}])


_PARTS = TypeAdapter(list[Annotated[ContentPart, BeforeValidator(_validate_part)]])


class ChatMessageParam(_Request):
    """One request message. ``developer`` is read as ``system``; a ``tool`` message answers an earlier
    assistant message's call by its ``tool_call_id`` (docs/api.md, "Tool calling"). An assistant
    message's ``refusal`` is what it said, as its content; its ``function_call`` (OpenAI's deprecated
    form of a call) and ``audio`` (an earlier audio answer) are refused unless null."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = Field(None, validate_default=True)
    name: str | None = None  # accepted, ignored
    tool_calls: list[ToolCallParam] | None = None  # assistant messages only
    tool_call_id: str | None = Field(None, validate_default=True)  # tool messages only
    refusal: str | None = None  # assistant messages only
    function_call: None = None
    audio: None = None

    @field_validator("role", mode="before")
    @classmethod
    def _map_role(cls, role: Any) -> Any:
        if role == "developer":
            return "system"
        if role == "function":
            raise ValueError("role 'function' is OpenAI's deprecated form: send 'tool' messages")
        return role

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"content is required in a {info.data['role']} message")
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError("content must be a string or a list of content parts")
        parts = _PARTS.validate_python(content)
        if info.data.get("role") == "tool":
            media = [f"content[{j}] is {part.type}" for j, part in enumerate(parts) if part.type != "text"]
            if media:
                raise ValueError(f"a tool message's content is text ({', '.join(media)})")
        return parts

    @field_validator("function_call", "audio", mode="before")
    @classmethod
    def _only_null(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return None
        if info.field_name == "function_call":
            raise ValueError("function_call is OpenAI's deprecated form of a call: send it in tool_calls")
        raise ValueError("this model takes no audio: an earlier audio answer cannot be part of the messages")

    @field_validator("refusal")
    @classmethod
    def _assistant_refusal(cls, refusal: str | None, info: ValidationInfo) -> Any:
        if refusal is not None and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry a refusal")
        if refusal is not None and info.data.get("content"):
            raise ValueError("an assistant message has content or a refusal, not both")
        return refusal

    @model_validator(mode="after")
    def _refusal_as_content(self) -> ChatMessageParam:
        if self.refusal is not None:
            self.content, self.refusal = self.refusal, None
        return self

    @field_validator("tool_calls")
    @classmethod
    def _assistant_calls(cls, calls: list[ToolCallParam] | None, info: ValidationInfo) -> Any:
        if calls is not None and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return calls or None

    @field_validator("tool_call_id")
    @classmethod
    def _tool_answers(cls, call_id: str | None, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if role == "tool" and not call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return call_id if role == "tool" else None


class StreamOptions(BaseModel):
    """OpenAI's keys; another is refused by name (a misspelt ``include_usage`` would drop the usage)."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool = True  # OpenAI pads chunks against side channels; mmserve sends none
    continuous_usage_stats: Literal[False] = False  # vLLM's usage in every chunk: not supported


class ChatCompletionRequest(_Request):
    """The fields mmserve implements; the others are sorted out before validation
    (``app.api.request_fields``), and unknown ones land in ``model_extra``."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessageParam] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # None: the model's default (its generation_config.json, docs/configuration.md), else vLLM's
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: list[str] | None = Field(None, max_length=4)  # a single string is read as a one-item list
    n: int = Field(1, ge=1, le=MAX_N)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # token id (as a string, OpenAI's shape) -> bias; ids outside the vocabulary are refused by the service
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_TOKEN_ID_LISTS)
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1, le=_INT64_MAX)  # -1 and 0 mean off; None: the model's default
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=1e6)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_TOKEN_ID_LISTS)
    allowed_token_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_TOKEN_ID_LISTS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: variables for the chat template
    request_id: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID_CHARS)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=_INT64_MAX)
    mm_processor_kwargs: dict[str, Any] | None = None
    # vLLM's: requests with different salts share no cache hit of any kind (docs/api.md, "Cache salts")
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS, strict=True)
    # structured outputs (docs/api.md): OpenAI's response_format, or vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # tool calling (docs/api.md, "Tool calling")
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool = True

    @model_validator(mode="before")
    @classmethod
    def _sort_fields(cls, body: Any) -> Any:
        return drop_known_fields(body, cls.model_fields)

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the answer's calls become ``tool_calls``: it has tools it lets the model call."""
        return bool(self.tools) and self.tool_choice != "none"

    _null_is_default = field_validator(
        "stream", "n", "logprobs", "frequency_penalty", "presence_penalty", "ignore_eos", "min_tokens",
        "include_stop_str_in_output", "skip_special_tokens", "add_generation_prompt",
        "continue_final_message", "parallel_tool_calls", mode="before",
    )(classmethod(null_is_default))  # fmt: skip

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, stop: Any) -> Any:
        stop = [stop] if isinstance(stop, str) else stop
        if isinstance(stop, list) and "" in stop:
            raise ValueError("stop strings must not be empty")
        return stop or None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) > _INT64_MAX:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be from -100 to 100, got {value} for {key}")
        return bias or None

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _token_ids(cls, token_ids: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if token_ids is not None and not all(0 <= t <= _INT64_MAX for t in token_ids):
            raise ValueError(f"{info.field_name} must be token ids (non-negative integers)")
        return token_ids

    _one_prompt_end = field_validator("continue_final_message")(one_prompt_end)

    @field_validator("request_id")
    @classmethod
    def _printable(cls, request_id: str | None) -> str | None:
        if request_id is not None and not request_id.isprintable():
            raise ValueError("request_id must be printable characters")
        return request_id

    # The checks below read fields declared earlier (``info.data``), so each error names its field.
    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions | None, info: ValidationInfo) -> Any:
        if options is not None and not info.data.get("stream", True):
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and not info.data.get("logprobs", True):
            raise ValueError("top_logprobs requires logprobs to be true")
        return top_logprobs

    @field_validator("min_tokens")
    @classmethod
    def _within_max_tokens(cls, min_tokens: int, info: ValidationInfo) -> int:
        limits = [info.data.get("max_completion_tokens"), info.data.get("max_tokens")]
        max_tokens = next((limit for limit in limits if limit is not None), None)
        if max_tokens is not None and min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({min_tokens}) must not exceed the max tokens ({max_tokens})")
        return min_tokens

    def effective_max_tokens(self) -> int | None:
        """``max_completion_tokens`` over ``max_tokens``; None means up to the context limit."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_top_logprobs(self) -> int | None:
        """``SamplingParams.num_top_logprobs``: None without logprobs, else alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (non-streamed responses always carry usage)."""
        return self.stream_options is not None and self.stream_options.include_usage


# ---------------------------------------------------------------- responses


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReasonLiteral


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReasonLiteral | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE event. All chunks of a stream share ``id`` and ``created``; the usage chunk (only with
    ``stream_options.include_usage``) comes last, with empty ``choices``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "mmserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
