"""``POST /v1/responses`` bodies, in OpenAI's shapes (docs/api.md, "Responses"); their translation into
the chat request every endpoint shares is app/api/responses_chat.py's. Fields are declared or refused: an
unknown one is a 400 naming it (``extra="forbid"``); those mmserve does not implement yet are refused by
name. An optional field sent as ``null`` is left out, as OpenAI takes it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from app.api.request_fields import is_default
from app.api.sampling_schemas import INT64_MAX, INT64_MIN, MAX_CACHE_SALT_CHARS
from app.api.schemas import MediaUuid, media_or_uuid
from app.api.tool_schemas import TOOL_CHOICE_KIND, Modes

# field -> (values accepted as "off", why it is refused otherwise)
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "conversation": (
        (None,),
        "conversation objects are not supported: chain responses by previous_response_id",
    ),
    "reasoning": ((None, {}, {"effort": None}, {"effort": "none"}), "the served model does not reason"),
    "prompt": ((None,), "prompt templates are not supported"),
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


ItemId = Annotated[str | None, Field(min_length=1, max_length=128)]  # as an item_reference's


class InputText(_Body):
    type: Literal["input_text", "output_text"]  # output_text: an assistant turn of the history
    text: str
    annotations: list[Any] | None = None  # on output_text, as the SDK sends a previous answer back
    logprobs: list[Any] | None = None
    prompt_cache_breakpoint: None = None  # what the SDK dumps of its own parts: only null


class InputImage(_Body):
    type: Literal["input_image"]
    # a media id, as on chat's image parts (declared first: image_url's check reads it)
    uuid: MediaUuid = None
    # an http(s) or data URL, under the chat request's media policy (no file ids); may be left out with a uuid
    image_url: str | None = Field(None, validate_default=True)
    detail: Literal["auto", "low", "high", "original"] | None = None  # accepted, not used
    file_id: None = None  # no file ids; null as input_items lists it and the SDK dumps it
    prompt_cache_breakpoint: None = None

    _check_media = field_validator("image_url")(media_or_uuid)

    def chat_part(self) -> dict[str, Any]:
        part: dict[str, Any] = {
            "type": "image_url",
            "image_url": {"url": self.image_url} if self.image_url is not None else None,
        }
        return part if self.uuid is None else {**part, "uuid": self.uuid}


def _each(values: list[Any], validate: Callable[[Any], Any], title: str) -> list[Any]:
    """``validate`` on every value; the errors located at their index (``input[1].content[0]``)."""
    results: list[Any] = []
    errors: list[InitErrorDetails] = []
    for index, value in enumerate(values):
        try:
            results.append(validate(value))
        except ValidationError as exc:
            for error in exc.errors():
                custom = PydanticCustomError(error["type"], error["msg"].replace("{", "(").replace("}", ")"))
                errors.append({"type": custom, "loc": (index, *error["loc"]), "input": error["input"]})
        except ValueError as exc:
            custom = PydanticCustomError("invalid_value", str(exc).replace("{", "(").replace("}", ")"))
            errors.append({"type": custom, "loc": (index,), "input": value})
    if errors:
        raise ValidationError.from_exception_data(title, errors)
    return results


def _part(part: Any, role: str | None = None) -> Any:
    """A content part (of a message by ``role``: an assistant's parts are text, and only an assistant's
    text is ``output_text``, as OpenAI's item shapes have them; its ``refusal`` part is read as its text)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "output_text" and role not in (None, "assistant"):
        raise ValueError(f"output_text is an assistant message's text: a {role} message's is input_text")
    if kind in ("input_text", "output_text"):
        return InputText.model_validate(part)
    if kind == "refusal" and role == "assistant":  # an OpenAI model's refusal sent back: what it said
        if not isinstance(part.get("refusal"), str):
            raise ValueError("a refusal part's refusal must be a string")
        return InputText(type="output_text", text=part["refusal"])
    if kind == "input_image":
        if role == "assistant":
            raise ValueError("an assistant message holds text (output_text), not images")
        return InputImage.model_validate(part)
    raise ValueError(f"content part type {kind!r} is not supported (input_text, input_image, output_text)")


ItemStatus = Literal["in_progress", "completed", "incomplete"] | None  # an item sent back: OpenAI's


class InputMessage(_Body):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Annotated[InputText | InputImage, Field()]]
    id: ItemId = None  # an earlier output item sent back
    status: ItemStatus = None
    phase: Literal["commentary", "final_answer"] | None = None  # a reasoning model's label: not used

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, content: Any, info: ValidationInfo) -> Any:
        if isinstance(content, list):
            role = info.data.get("role", "user")
            return _each(content, lambda part: _part(part, role), "content")
        return content


class FunctionCallItem(_Body):
    """An earlier answer's call, sent back as history."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: ItemId = None
    status: ItemStatus = None
    # what the SDK's own call objects carry, dumped: hosted tools' fields, none of which a call here has
    caller: None = None
    namespace: None = None
    async_: None = Field(None, validation_alias=AliasChoices("async", "async_"))  # the SDK dumps async_
    created_by: None = None


class FunctionCallOutputItem(_Body):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str
    id: ItemId = None
    status: ItemStatus = None
    # as on a call: what the SDK's listed output items carry, only null
    caller: None = None
    name: None = None
    namespace: None = None
    created_by: None = None

    @field_validator("output", mode="before")
    @classmethod
    def _text_parts(cls, output: Any) -> Any:
        """The output as text parts (``input_text``), as the SDK allows: their text, joined."""
        if not isinstance(output, list):
            return output
        parts = _each(output, _part, "output")
        if any(not isinstance(part, InputText) for part in parts):
            raise ValueError("a function_call_output's output is text: a string or input_text parts")
        return "".join(part.text for part in parts)


class ItemReference(_Body):
    """An item of a stored conversation, sent again by its id (app/api/response_items.py): the request is
    served with the item itself in its place."""

    type: Literal["item_reference"] | None = None
    id: str = Field(min_length=1, max_length=128)


_ITEMS: dict[str, type[_Body]] = {
    "message": InputMessage,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "item_reference": ItemReference,
}


def parse_items(items: list[dict[str, Any]]) -> list[Any]:
    """Input items as stored (``model_dump``'s dicts) back as their models."""
    return _each(items, _item, "input")


def dump_items(items: list[Any]) -> list[dict[str, Any]]:
    """Parsed input (or output) items as the plain dicts a store keeps."""
    return [item.model_dump(by_alias=True, exclude_none=True) for item in items]


def _item(item: Any) -> Any:
    kind = (item.get("type") or _untyped(item)) if isinstance(item, dict) else None
    if isinstance(kind, str) and kind in _ITEMS:
        return _ITEMS[kind].model_validate(item)
    raise ValueError(
        f"input item type {kind!r} is not supported "
        "(message, function_call, function_call_output, item_reference)"
    )


def _untyped(item: dict[str, Any]) -> str:
    """What an item without a ``type`` is, as OpenAI reads it: a message, or a reference (an id alone)."""
    return "item_reference" if item.keys() - {"type"} == {"id"} else "message"


class FunctionTool(_Body):
    """The Responses API's function tool (flat: no ``function`` object around its fields)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def _tool(tool: Any) -> Any:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind == "function":
        return FunctionTool.model_validate(tool)
    raise ValueError(f"tool type {kind!r} is not supported: only function tools (no built-in tools)")


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class AllowedTools(_Body):
    """OpenAI's ``ToolChoiceAllowed``: chat's ``allowed_tools``, flat (function tools only)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[NamedFunction] = Field(min_length=1, max_length=128)


class FormatText(_Body):
    """OpenAI's ``ResponseFormatText``: no constraint."""

    type: Literal["text"]


class FormatJsonObject(_Body):
    """OpenAI's ``ResponseFormatJSONObject``: any JSON object, as chat's ``response_format`` json_object."""

    type: Literal["json_object"]


class FormatJsonSchema(_Body):
    """OpenAI's ``ResponseFormatTextJSONSchemaConfig``: chat's ``response_format.json_schema``, flat."""

    type: Literal["json_schema"]
    name: str | None = None  # OpenAI requires it; "response" where left out
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


# text.format is typed by its type, as OpenAI's union: a key another type has (a schema with type text) is
# unknown to this one, so a 400 naming it
_FORMATS: dict[str, type[_Body]] = {
    "text": FormatText,
    "json_object": FormatJsonObject,
    "json_schema": FormatJsonSchema,
}


class _FormatType(BaseModel):
    """Only a format's type: a 400 naming ``text.format.type`` where it is missing or none of these."""

    type: Literal["text", "json_object", "json_schema"]


class TextConfig(_Body):
    format: FormatText | FormatJsonObject | FormatJsonSchema | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, without effect

    @field_validator("format", mode="before")
    @classmethod
    def _format(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("a format is an object with a type (text, json_object or json_schema)")
        return _FORMATS[_FormatType.model_validate(value).type].model_validate(value)


_MetadataKey = Annotated[str, Field(max_length=64)]
_MetadataValue = Annotated[str, Field(max_length=512)]


class BackgroundOptions(_Body):
    """Every window is met by running at once, as a background response does; labels beside it."""

    completion_window: Literal["soonest", "2h", "8h"] | None = None
    continuation_id: str | None = None


class ResponsesStreamOptions(_Body):
    include_obfuscation: bool = True  # OpenAI pads events against side channels; mmserve sends none


# OpenAI's ``ResponseIncludable``: the output text's logprobs; the others name what mmserve never makes
# (reasoning, hosted tools' results) or no output holds (input images), so there is nothing to add
LOGPROBS = "message.output_text.logprobs"
Includable = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "message.input_image.image_url",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
]


INCLUDABLE = frozenset(get_args(Includable))


class ResponsesInput(_Body):
    """What a response is made from: the fields ``POST /v1/responses/input_tokens`` counts, and every
    request's."""

    model: str | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=128)  # (read by input's check)
    input: str | list[Any] | None = Field(None, validate_default=True)  # may be left out after one
    instructions: str | None = None
    text: TextConfig | None = None
    # vLLM's extensions, as on chat
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS, strict=True)
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = Field(None, max_length=128)  # function tools (``_tool``), as on chat
    tool_choice: (
        Annotated[
            Modes | Annotated[NamedFunction, Tag("Named")] | Annotated[AllowedTools, Tag("Allowed")],
            TOOL_CHOICE_KIND,
        ]
        | None
    ) = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None  # auto: the oldest items dropped to fit
    # refused unless off (REFUSED)
    conversation: Any = None
    reasoning: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.data.get("previous_response_id") is None:
            raise PydanticCustomError("missing", "input is required without a previous_response_id")
        if isinstance(value, list):
            if not value:
                raise ValueError("input must not be empty")
            return _each(value, _item, "input")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, value: Any) -> Any:
        return _each(value, _tool, "tools") if isinstance(value, list) else value

    @field_validator(*REFUSED, check_fields=False)
    @classmethod
    def _refused(cls, value: Any, info: Any) -> Any:
        accepted, reason = REFUSED[info.field_name]
        if not is_default(value, accepted):
            raise ValueError(f"{info.field_name} is not supported: {reason}")
        return value

    def input_items(self) -> list[Any]:
        """``input`` as a list of items (a string is one user message; none: no items)."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return self.input


class ResponsesRequest(ResponsesInput):
    model: str
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = None  # None: false
    store: bool | None = None  # None: true, as OpenAI's
    metadata: dict[_MetadataKey, _MetadataValue] | None = Field(None, max_length=16)  # OpenAI's bounds
    include: list[Includable] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)  # alternatives per token, with LOGPROBS included
    max_tool_calls: int | None = Field(None, ge=1)  # a bound on built-in tools' calls: mmserve runs none
    background: bool | None = None  # run after the answer: the queued response is returned at once
    background_options: BackgroundOptions | None = None
    priority: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, strict=True)  # vLLM's, as on chat
    # refused unless off (REFUSED)
    prompt: Any = None
    # accepted without effect, and echoed: labels and hosted-service options
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # accepted without effect
    prompt_cache_options: Any = None
    service_tier: Any = None
    stream_options: ResponsesStreamOptions | None = None
