"""OpenAI chat-completions schemas, as vLLM accepts them: validated here, at the HTTP edge.

Every field OpenAI or vLLM defines is either declared here (the fields chat shares with completions in
``app.api.sampling_schemas``) or classified in
``app.api.request_fields`` (accepted without effect, or refused by name unless it carries its default);
a field no spec knows is kept in ``model_extra`` and logged once by the service. Part lists are
dispatched on ``type`` by hand, so a
validation error's location names the real path (``messages[0].content[1].image_url.url``) instead of
pydantic's union-member labels. Responses dump with plain ``model_dump_json()``: optional fields the
OpenAI wire format sends as ``null`` stay, and a stream delta drops its unset ``role``/``content``.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal
from uuid import uuid4

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from app.api.sampling_schemas import RequestModel, SamplingRequest, null_is_default
from app.api.tool_schemas import MAX_TOOLS, ChatTool, ToolCallParam, ToolChoice

FinishReasonLiteral = Literal["stop", "length", "abort"]  # "abort" as in vLLM; the SDK's Literal lacks it

# ---------------------------------------------------------------- request


MAX_UUID_CHARS = 128
MAX_DOCUMENTS = 256  # of a request (vLLM's documents)


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


def one_prompt_end(continue_final_message: bool, info: ValidationInfo) -> bool:
    """A chat template either opens the assistant's turn or leaves the last message open, not both."""
    if continue_final_message and info.data.get("add_generation_prompt"):
        raise ValueError("continue_final_message needs add_generation_prompt false")
    return continue_final_message


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str
    uuid: Any = Field(None, exclude=True)

    @field_validator("uuid")
    @classmethod
    def _no_uuid(cls, uuid: Any) -> None:
        if uuid is not None:
            raise ValueError("uuid is only allowed on image_url and video_url parts")


class ImageURL(RequestModel):
    url: str  # scheme and data-URL form are checked where the image is fetched (app.media.images)
    detail: Literal["auto", "low", "high"] | None = None  # accepted, not used


def media_or_uuid(media: Any, info: ValidationInfo) -> Any:
    """A media part leaves its media out (``null`` or no key) only with a uuid naming media sent before."""
    if media is None and "uuid" in info.data and info.data["uuid"] is None:
        msg = "{name} is required unless the part carries a uuid of media sent before"
        raise PydanticCustomError("missing", msg, {"name": info.field_name})
    return media


class ImageURLContentPart(RequestModel):
    type: Literal["image_url"]
    uuid: MediaUuid = None  # declared before the media: its validator reads it
    image_url: ImageURL | None = Field(None, validate_default=True)

    _check_media = field_validator("image_url")(media_or_uuid)

    @property
    def url(self) -> str | None:
        return self.image_url.url if self.image_url is not None else None


class VideoURL(RequestModel):
    url: str  # http(s)://, data:video/...;base64, or file:// (checked where the video is fetched)


class VideoURLContentPart(RequestModel):
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
    """Dispatch on ``type`` so that errors carry the part's own path, not a union label. vLLM's short
    media part, a bare URL without ``type`` (``{"image_url": "https://..."}``), is read as the full one."""
    if isinstance(part, BaseModel):
        return part
    if isinstance(part, dict) and "type" not in part and len(part) == 1:
        [(key, value)] = part.items()
        if key in ("image_url", "video_url") and isinstance(value, str):
            part = {"type": key, key: {"url": value}}
    part_type = part.get("type") if isinstance(part, dict) else None
    if isinstance(part_type, str) and part_type in _PART_MODELS:
        return _PART_MODELS[part_type].model_validate(part)
    got = repr(part_type) if isinstance(part, dict) else type(part).__name__
    msg = "content part type must be 'text', 'image_url' or 'video_url', got {got}"
    error = PydanticCustomError("invalid_content_part", msg, {"got": got})
    loc = ("type",) if isinstance(part, dict) else ()
    raise ValidationError.from_exception_data("ContentPart", [{"type": error, "loc": loc, "input": part}])


_PARTS = TypeAdapter(list[Annotated[ContentPart, BeforeValidator(_validate_part)]])


def _refusal_as_text(part: Any) -> Any:
    """An assistant's refusal part (what an OpenAI model said when it refused: its message's ``refusal``
    as a part) as a text part."""
    if not isinstance(part, dict) or part.get("type") != "refusal":
        return part
    if not isinstance(part.get("refusal"), str):
        raise ValueError("a refusal part's refusal must be a string")
    return {"type": "text", "text": part["refusal"]}


class ChatMessageParam(RequestModel):
    """One request message. ``developer`` is read as ``system``; a ``tool`` message answers an earlier
    assistant message's call by its ``tool_call_id`` (docs/api.md, "Tool calling"). An assistant
    message's ``refusal`` is what it said, as its content (a refusal part, as a text part); its
    ``function_call`` (OpenAI's deprecated form of a call) and ``audio`` (an earlier audio answer) are
    refused unless null."""

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
        if info.data.get("role") == "assistant":
            content = [_refusal_as_text(part) for part in content]
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


class ChatCompletionRequest(SamplingRequest):
    """The chat fields mmserve implements beside the shared ones (app/api/sampling_schemas.py)."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: each choice's content begins with the last message's, where that is the assistant's
    echo: bool = False
    return_prompt_text: bool = False  # vLLM's: the rendered chat template as the response's prompt_text
    # vLLM's: documents for a chat template with a RAG section ("title" and "text" each, as vLLM's)
    documents: list[dict[str, str]] | None = Field(None, max_length=MAX_DOCUMENTS)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: variables for the chat template
    mm_processor_kwargs: dict[str, Any] | None = None
    # tool calling (docs/api.md, "Tool calling")
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool = True

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the answer's calls become ``tool_calls``: it has tools it lets the model call."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def documents_json(self) -> str | None:
        """``TemplateOptions.documents``."""
        return json.dumps(self.documents, ensure_ascii=False) if self.documents is not None else None

    @property
    def echoed(self) -> str:
        """What ``echo`` puts before each choice's content: the last message's text (its text parts
        joined by newlines, as vLLM joins them), where the assistant sent it (a message to continue,
        ``continue_final_message``); "" otherwise."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant" or last.content is None:
            return ""
        if isinstance(last.content, str):
            return last.content
        return "\n".join(part.text for part in last.content if isinstance(part, TextContentPart))

    _null_is_chat_default = field_validator(
        "logprobs",
        "add_generation_prompt",
        "continue_final_message",
        "parallel_tool_calls",
        "echo",
        "return_prompt_text",
        mode="before",
    )(classmethod(null_is_default))

    _one_prompt_end = field_validator("continue_final_message")(one_prompt_end)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and not info.data.get("logprobs", True):
            raise ValueError("top_logprobs requires logprobs to be true")
        return top_logprobs

    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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
