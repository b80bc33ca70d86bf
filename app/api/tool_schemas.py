"""Tool calling on the chat API (docs/api.md, "Tool calling"): the request's ``tools`` and ``tool_choice``,
the history's assistant ``tool_calls`` and ``tool`` messages, checked at the HTTP edge, and the
constraint that makes a call well-formed.

``required`` makes the answer start with a call, a named function makes it that one call; ``auto``
leaves the text free until the model opens a call, then constrains the call to a declared tool's name
and arguments schema until it closes (xgrammar's structural tags, engine/structured/backend.py).
``none`` renders the tools and constrains nothing; the answer is then plain content. ``allowed_tools``
is ``auto`` or ``required`` over some of the tools, all of which the prompt still renders.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from app.api.json_schema_support import check_json_schema
from app.errors import InvalidRequestError
from wire.protocol import MAX_CONSTRAINT_CHARS, Constraint, ConstraintKind
from workers.families import STRUCTURAL_TAG_FORMATS  # the tool-call syntax of each parser

MAX_TOOLS = 128


class _Open(BaseModel):
    """A key OpenAI's shape does not have is kept for the log of unknown fields and read by nothing else,
    as vLLM takes it: clients add ``cache_control`` to tools, and a streamed call's ``index`` to the calls
    they send back. A function with such a key and no ``parameters`` is refused (``check_tools``): the
    key is most likely a misspelt ``parameters``."""

    model_config = ConfigDict(extra="allow")


class FunctionDefinition(_Open):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = (
        None  # the arguments are always constrained to the schema (a call is never malformed)
    )


class ChatTool(_Open):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(_Open):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1, max_length=MAX_TOOLS)


class AllowedToolChoice(_Open):
    """OpenAI's ``allowed_tools``: ``mode`` (``auto`` or ``required``) over these tools only, while the
    prompt renders all of the request's tools, so a client that narrows the choice turn by turn keeps
    one prompt prefix (and its cached KV)."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


def choice_kind(value: Any) -> str | None:
    """Which member of a tool choice ``value`` is meant as: a string a mode, an object by its ``type``.
    Only that member validates it, so an error names its field (``tool_choice.function.name``)."""
    if isinstance(value, str):
        return "Mode"
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return {"function": "Named", "allowed_tools": "Allowed"}.get(kind) if isinstance(kind, str) else None


# (the tags are capitalised: an error's parameter leaves them out, app/api/error_handlers.py)
TOOL_CHOICE_KIND = Discriminator(
    choice_kind,
    custom_error_type="invalid_tool_choice",
    custom_error_message="Input should be 'none', 'auto', 'required', or an object of type 'function' or "
    "'allowed_tools'",
)
Modes = Annotated[Literal["none", "auto", "required"], Tag("Mode")]
ToolChoice = Annotated[
    Modes | Annotated[NamedToolChoice, Tag("Named")] | Annotated[AllowedToolChoice, Tag("Allowed")],
    TOOL_CHOICE_KIND,
]


class FunctionCallParam(_Open):
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _an_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"arguments must be JSON text of an object: {exc}") from exc
        except RecursionError as exc:
            raise ValueError("arguments are nested too deeply") from exc
        if not isinstance(value, dict):
            raise ValueError("arguments must be JSON text of an object")
        return arguments


class ToolCallParam(_Open):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCallParam


def tools_json(tools: list[ChatTool]) -> str:
    """The tools as the chat template reads them (OpenAI's shape, without keys it does not have), as
    JSON text."""
    return json.dumps([_declared(tool) for tool in tools], ensure_ascii=False)


def _declared(model: BaseModel) -> dict[str, Any]:
    """A declaration's fields that are set, nested ones too, without the keys its model does not declare."""
    fields = {name: getattr(model, name) for name in type(model).model_fields}
    return {
        name: _declared(value) if isinstance(value, BaseModel) else value
        for name, value in fields.items()
        if value is not None
    }


def check_tools(tools: list[ChatTool] | None, tool_choice: ToolChoice | None) -> None:
    """Each tool's parameters a JSON schema whose every part is enforced, no two tools of one name, and a
    ``tool_choice`` that names a declared tool; ``InvalidRequestError`` naming the field otherwise."""
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        if tool.function.name in names:
            raise InvalidRequestError(
                f"two tools are named {tool.function.name!r}", param=f"tools[{i}].function.name"
            )
        names.add(tool.function.name)
        parameters = tool.function.parameters
        if parameters is None and tool.function.model_extra:
            key = sorted(tool.function.model_extra)[0]
            raise InvalidRequestError(
                f"a function declares no 'parameters' but has {key!r}, which OpenAI's shape does not "
                "have: is it a misspelt 'parameters'?",
                param=f"tools[{i}].function.{key}",
            )
        if parameters is not None:
            if parameters.get("type", "object") != "object":
                raise InvalidRequestError(
                    f"a function's parameters are an object, so their schema's type is 'object', not "
                    f"{parameters['type']!r}",
                    param=f"tools[{i}].function.parameters.type",
                )
            check_json_schema(parameters, f"tools[{i}].function.parameters")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise InvalidRequestError(
            f"tool_choice names {tool_choice.function.name!r}, which is not among the request's tools",
            param="tool_choice.function.name",
        )
    if isinstance(tool_choice, AllowedToolChoice):
        for i, ref in enumerate(tool_choice.allowed_tools.tools):
            if ref.function.name not in names:
                raise InvalidRequestError(
                    f"tool_choice allows {ref.function.name!r}, which is not among the request's tools",
                    param=f"tool_choice.allowed_tools.tools[{i}].function.name",
                )
    if tool_choice in ("auto", "required") and not names:  # (as OpenAI's and vLLM's: only "none" without)
        raise InvalidRequestError(
            f"tool_choice {tool_choice!r} needs tools: give tools, or leave tool_choice out",
            param="tool_choice",
        )


def calls_only(tool_choice: ToolChoice | None) -> bool:
    """Whether the answer is calls and nothing else: ``required`` (allowed tools' too), a named function."""
    if isinstance(tool_choice, AllowedToolChoice):
        return tool_choice.allowed_tools.mode == "required"
    return tool_choice == "required" or isinstance(tool_choice, NamedToolChoice)


def choice_name(tool_choice: ToolChoice | None) -> str:
    """How an error names the tool choice: ``auto`` (left out), ``required``, ``function``, …"""
    if tool_choice is None or isinstance(tool_choice, str):
        return tool_choice or "auto"
    return tool_choice.type


def check_tool_history(messages: list[Any]) -> str | None:
    """Each tool message answers a call an earlier assistant message made (``InvalidRequestError``
    naming its ``tool_call_id`` otherwise). Returns where the history's first tool call or result is
    (``messages[2].tool_calls[0]``, ``messages[3]``), None where it has none."""
    made: set[str] = set()
    first: str | None = None
    for i, message in enumerate(messages):
        for call in message.tool_calls or []:
            made.add(call.id)
            first = first or f"messages[{i}].tool_calls[0]"
        if message.role == "tool":
            first = first or f"messages[{i}]"
            if message.tool_call_id not in made:
                raise InvalidRequestError(
                    f"no earlier assistant message made a tool call with id {message.tool_call_id!r}",
                    param=f"messages[{i}].tool_call_id",
                )
    return first


def template_tools(family: Any, tools: list[ChatTool] | None, messages: list[Any]) -> str | None:
    """``TemplateOptions.tools`` for a request with these tools and messages: None without tools or calls
    in the history, else the tools as JSON text (``"[]"``: only the history has calls). A family whose
    template renders no tools refuses either (``InvalidRequestError`` naming ``tools``, or the history's
    first call or result)."""
    in_history = check_tool_history(messages)
    if not tools and not in_history:
        return None
    if family.tool_chat_template is None or family.tool_call_parser is None:
        missing = (
            "its chat template renders no tools, tool calls or tool messages"
            if family.tool_chat_template is None
            else "no tool-call parser reads its calls"
        )
        raise InvalidRequestError(
            f"This model ({family.config.get('model_type')}) has no tool format: {missing} (the server "
            "gives it one with --chat-template and --tool-call-parser).",
            param="tools" if tools else in_history,
        )
    return tools_json(tools or [])


# an output format a request with tools may have beside them: its answer is then that JSON, or calls
ANSWER_KINDS = (ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT)
JSON_OBJECT = '{"type":"object"}'


def tool_constraint(
    tools: list[ChatTool] | None,
    tool_choice: ToolChoice | None,
    parallel: bool,
    parser: str,
    answer: Constraint | None = None,
) -> Constraint | None:
    """The constraint of a request with tools (None where nothing is constrained: no tools, or
    ``tool_choice`` none). ``answer``, an output format of ``ANSWER_KINDS``: where the model may answer
    without calling (``auto``), it answers that JSON alone or calls alone; where it may not, the format
    has no text to hold."""
    if not tools or tool_choice == "none":
        return None
    if isinstance(tool_choice, NamedToolChoice):
        choice: Any = _declared(tool_choice)
    elif isinstance(tool_choice, AllowedToolChoice):  # its mode over the allowed tools (as xgrammar's own)
        allowed = {ref.function.name for ref in tool_choice.allowed_tools.tools}
        tools = [tool for tool in tools if tool.function.name in allowed]
        choice = tool_choice.allowed_tools.mode
    else:
        choice = tool_choice or "auto"
    functions = [
        {
            "type": "function",
            # an object always (no parameters: any object), whatever the schema leaves out
            "function": {
                "name": t.function.name,
                "parameters": {**(t.function.parameters or {}), "type": "object"},
            },
        }
        for t in tools
    ]
    fields: dict[str, Any] = {
        "format": STRUCTURAL_TAG_FORMATS[parser],
        "tools": functions,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
    }
    if answer is not None and not calls_only(tool_choice):
        json_object = answer.kind is ConstraintKind.JSON_OBJECT
        fields["answer"] = {
            "schema": json.loads(JSON_OBJECT if json_object else answer.spec),
            "strict": not json_object,  # (json_object: any properties)
            "any_whitespace": answer.any_whitespace,
        }
    spec = json.dumps(fields, ensure_ascii=False, separators=(",", ":"))
    if len(spec) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequestError(
            f"the tools are {len(spec)} characters long as a constraint; at most {MAX_CONSTRAINT_CHARS}",
            param="tools",
        )
    return Constraint(ConstraintKind.TOOL_CALLS, spec)


def answers_or_calls(constraint: Constraint | None) -> bool:
    """Whether ``constraint`` is one ``tool_constraint`` made with an answer beside the calls: the
    output is that JSON alone or calls alone."""
    if constraint is None or constraint.kind is not ConstraintKind.TOOL_CALLS:
        return False
    return "answer" in json.loads(constraint.spec)
