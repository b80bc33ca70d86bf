"""The Responses request as the chat request every endpoint shares (docs/api.md, "Responses"), and the
way back: an error the chat request's checks raise names the Responses field the client sent, in its
``param`` and its message (``ResponsesParams.error``).

Input items do not map one to one onto chat messages: the instructions come first, a stored conversation
before the input, and calls made together are one assistant message. So the messages are built with a
table of where each of their paths came from, and an error is named by the deepest path it holds::

    messages[0]                                 instructions
    messages[1..k]                              previous_response_id   (the stored conversation)
    messages[k+1].content[1].image_url.url      input[0].content[1].image_url
    messages[k+2].tool_calls[0], [1]            input[1], input[2]     (.function.arguments: .arguments;
                                                                   the calls after an answer's text join
                                                                   its message)
    messages[k+3].tool_call_id                  input[3].call_id       (a function_call_output)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from app.api.error_handlers import validation_error_detail
from app.api.responses_api_schemas import (
    LOGPROBS,
    AllowedTools,
    FormatJsonObject,
    FormatJsonSchema,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputText,
    NamedFunction,
    ResponsesRequest,
)
from app.api.sampling import reword_length_error
from app.api.schemas import ChatCompletionRequest
from app.errors import InvalidRequestError, MMServeError

# the chat request's other fields -> the Responses request's: its function tools and named tool choice are
# flat ({"type": "function", "name": ...}), its schema is text.format's own
_FIELDS = (
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"^(tools\[\d+\])\.function"), r"\1"),
    (re.compile(r"^tool_choice\.allowed_tools\.(tools\[\d+\])\.function"), r"tool_choice.\1"),
    (re.compile(r"^tool_choice\.(function|allowed_tools)"), "tool_choice"),
    (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
)
# a path in an error's message that the Responses request spells otherwise (a bare "messages" is prose)
_CHAT_PATH = re.compile(
    r"(?<![\w.\]])"
    r"(?:messages\[\d+\]|response_format|max_completion_tokens|tools\[\d+\]\.function"
    r"|tool_choice\.function|tool_choice\.allowed_tools)"
    r"(?:\.\w+|\[\d+\])*"
)
_ROOT = re.compile(r"[.\[]")  # where a path's first name ends
# a length error's words for the input and the output, where chat's speak of messages and a completion
_CONTEXT_WORDS = (
    ("the messages are", "the input is"),
    ("in the messages", "in the input"),
    ("in the completion", "for the output"),
    ("room for a completion", "room for an output"),
    ("Shorten the messages.", "Shorten the input, or set truncation to auto."),
)

# a chat message's (a call's, a part's) paths -> its input item's (part's), by what the item is
_WHOLE = {"": ""}
_MESSAGE = {"": "", ".role": ".role", ".content": ".content"}
_TEXT_PART = {"": "", ".text": ".text"}
_IMAGE_PART = {"": "", ".image_url": ".image_url", ".image_url.url": ".image_url", ".uuid": ".uuid"}
_CALL = {"": "", ".id": ".call_id", ".function.name": ".name", ".function.arguments": ".arguments"}
_CALL_OUTPUT = {"": "", ".tool_call_id": ".call_id", ".content": ".output"}


@dataclass
class ResponsesParams:
    """Where the chat request's message paths came from in the Responses request, filled while its
    messages are built (``chat_request``); then read to name an error's fields."""

    paths: dict[str, str] = field(default_factory=dict)

    def add(self, chat_path: str, origin: str, renames: dict[str, str]) -> None:
        """``chat_path`` (a message, a call, a part) came from ``origin``; ``renames`` maps its paths
        below onto the origin's."""
        self.paths.update({chat_path + below: origin + there for below, there in renames.items()})

    def name(self, param: str) -> str:
        """The Responses field for a chat request's ``param``: a message's path is named by the deepest
        path recorded that holds it (an input item's part, the item, or ``input``), and no deeper than
        what the client sent: instructions, a stored conversation (``previous_response_id``) or a string
        input are named whole."""
        if param == "messages" or param.startswith("messages["):
            held = [
                path for path in self.paths if param == path or param.startswith((f"{path}.", f"{path}["))
            ]
            named = self.paths[max(held, key=len)] if held else "input"  # (all of the messages)
            return named if named.startswith("input[") else _ROOT.split(named, maxsplit=1)[0]
        for pattern, replacement in _FIELDS:
            param = pattern.sub(replacement, param)
        return param

    def error(self, exc: MMServeError) -> MMServeError:
        """``exc``, raised by the chat request's checks, naming the Responses fields instead."""
        exc.param = None if exc.param is None else self.name(exc.param)
        exc.message = _CHAT_PATH.sub(lambda found: self.name(found.group()), exc.message)
        reword_length_error(exc, _CONTEXT_WORDS)
        return exc


def chat_request(body: ResponsesRequest, history: list[Any]) -> tuple[ChatCompletionRequest, ResponsesParams]:
    """The chat request with the meaning of ``body`` after ``history`` (a stored conversation's items, from
    ``parse_items``), and what names its errors' fields; its validation errors are raised named so."""
    params = ResponsesParams()
    logprobs = _logprobs(body)
    fields = {
        "model": body.model,
        "messages": _messages(body, history, params),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "response_format": _response_format(body),
        "cache_salt": body.cache_salt,
        "mm_processor_kwargs": body.mm_processor_kwargs,
        "tools": _tools(body),
        "tool_choice": _tool_choice(body),
        "parallel_tool_calls": body.parallel_tool_calls,
        "logprobs": logprobs,
        "top_logprobs": body.top_logprobs if logprobs else None,
        "priority": body.priority,
    }
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        detail = validation_error_detail(exc.errors())
        raise params.error(InvalidRequestError(detail.message, param=detail.param)) from exc
    if chat.logprobs and chat.parses_tool_calls:  # which tokens were the text's and which a call's
        raise InvalidRequestError(
            f"include {LOGPROBS!r} gives the logprobs of a text answer: not with tools the answer may call "
            "(tool_choice 'none' leaves the text alone)",
            param="include",
        )
    return chat, params


def _messages(body: ResponsesRequest, history: list[Any], params: ResponsesParams) -> list[dict[str, Any]]:
    """The chat messages: the instructions as a system message (never carried over from a previous
    response, as OpenAI's), the stored conversation, then the input; each recorded in ``params``."""
    messages: list[dict[str, Any]] = []

    def add(message: dict[str, Any], origin: str, renames: dict[str, str]) -> str:
        chat_path = f"messages[{len(messages)}]"
        params.add(chat_path, origin, renames)
        messages.append(message)
        return chat_path

    if body.instructions:
        add({"role": "system", "content": body.instructions}, "instructions", _WHOLE)
    input_origin = "input[{}]" if isinstance(body.input, list) else "input"
    origins = [
        *(("previous_response_id", item) for item in history),
        *((input_origin.format(i), item) for i, item in enumerate(body.input_items())),
    ]
    for origin, item in origins:
        if isinstance(item, FunctionCallItem):
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                add({"role": "assistant", "content": None, "tool_calls": []}, origin, _WHOLE)
            # an answer's text and the calls after it, or calls made together: one assistant turn, as the
            # model wrote it (and as chat's assistant message with content and tool_calls renders it)
            calls = messages[-1].setdefault("tool_calls", [])
            params.add(f"messages[{len(messages) - 1}].tool_calls[{len(calls)}]", origin, _CALL)
            function = {"name": item.name, "arguments": item.arguments}
            calls.append({"id": item.call_id, "type": "function", "function": function})
        elif isinstance(item, FunctionCallOutputItem):
            add({"role": "tool", "tool_call_id": item.call_id, "content": item.output}, origin, _CALL_OUTPUT)
        elif isinstance(item.content, str):
            add({"role": item.role, "content": item.content}, origin, _MESSAGE)
        else:
            parts: list[dict[str, Any]] = []
            chat_path = add({"role": item.role, "content": parts}, origin, _MESSAGE)
            for p, part in enumerate(item.content):
                if isinstance(part, InputText):
                    params.add(f"{chat_path}.content[{p}]", f"{origin}.content[{p}]", _TEXT_PART)
                    parts.append({"type": "text", "text": part.text})
                else:
                    params.add(f"{chat_path}.content[{p}]", f"{origin}.content[{p}]", _IMAGE_PART)
                    parts.append(part.chat_part())
    return messages


def _logprobs(body: ResponsesRequest) -> bool | None:
    """The output text's logprobs, where ``include`` asks for them (``top_logprobs`` alone is refused:
    OpenAI gives none without it, and a silent nothing would look like a model that is sure)."""
    if LOGPROBS in (body.include or ()):
        return True
    if body.top_logprobs:
        raise InvalidRequestError(
            f"top_logprobs gives alternatives to the logprobs that include {LOGPROBS!r} asks for",
            param="top_logprobs",
        )
    return None


def _tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    """``tools`` in the chat request's shape, in their order."""
    if body.tools is None:
        return None
    return [
        {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
        for tool in body.tools
    ]


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice == "auto" and not body.tools:  # Responses' default, without tools too (chat's needs them)
        return None
    if isinstance(choice, NamedFunction):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, AllowedTools):
        refs = [{"type": "function", "function": {"name": tool.name}} for tool in choice.tools]
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.mode, "tools": refs}}
    return choice


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None for ``text``: no constraint)."""
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, FormatJsonObject):
        return {"type": "json_object"}
    if isinstance(fmt, FormatJsonSchema):
        schema: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": schema}
    return None
