"""The Responses request without a server: ``text.format`` typed by its ``type`` as OpenAI's union, a
``null`` taken as "not given", and the chat request it becomes (app/api/responses_chat.py) with the way
back: an error of the chat request's checks names, in its param and its message, the Responses field the
client sent (the input item and part, not the chat message)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from openai.types.responses import Response, ResponseTextConfig
from pydantic import ValidationError

from app.api.error_handlers import validation_error_detail
from app.api.outputs import Generation
from app.api.responses_api_schemas import ResponsesRequest, parse_items
from app.api.responses_chat import chat_request
from app.api.responses_object import Turn, response_object
from app.api.tool_schemas import check_tools, template_tools
from app.errors import ContextLengthError, InvalidRequestError, MediaError, MMServeError

IMAGE = "data:image/png;base64,iVBORw0KGgo="
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "tiny-llava", "input": "hi", **fields})


def refusal(**fields: Any) -> tuple[str | None, str]:
    """The param and message of the 400 the request's validation answers."""
    with pytest.raises(ValidationError) as caught:
        request(**fields)
    detail = validation_error_detail(caught.value.errors())
    return detail.param, detail.message


def chat_error(body: ResponsesRequest, history: list[dict[str, Any]] | None = None) -> MMServeError:
    with pytest.raises(MMServeError) as caught:
        chat_request(body, parse_items(history or []))
    return caught.value


def answered(body: ResponsesRequest, status: str | None = None, **ended: Any) -> dict[str, Any]:
    """The response object answering ``body``, its answer ended as ``ended`` says (no tokens)."""
    gen = Generation(
        req_id="r", response_id="resp_1", index=0, model_name="tiny-llava", arrival=1000.0,
        num_prompt_tokens=1, num_cached_tokens=0, want_logprobs=False,
        detok=SimpleNamespace(token_ids=[]), **ended,  # type: ignore[arg-type]
    )  # fmt: skip
    return response_object(Turn(body, gen, "", [], False, 1.0, 1.0), [], status)


def echoed_format(body: ResponsesRequest) -> dict[str, Any]:
    """``text`` of the response object answering ``body`` (the answer itself does not matter here)."""
    text = answered(body)["text"]
    ResponseTextConfig.model_validate(text)  # OpenAI's shape
    return dict(text["format"])


def test_the_object_has_openais_optional_fields_as_applied() -> None:
    """``completed_at`` (the last token's time, only once completed), ``text.verbosity``, ``top_logprobs``
    and ``service_tier`` as OpenAI's objects carry them; the SDK's ``Response`` takes the object."""
    done = answered(request(), finish_reason="stop", last_token_at=1002.7)
    assert (done["created_at"], done["completed_at"]) == (1000, 1002)
    assert (done["text"]["verbosity"], done["top_logprobs"], done["service_tier"]) == ("medium", 0, "default")
    Response.model_validate(done)
    cut = answered(request(), finish_reason="length", last_token_at=1002.7)
    assert cut["status"] == "incomplete" and cut["completed_at"] is None
    assert answered(request(), "queued")["completed_at"] is None
    asked = answered(request(text={"verbosity": "low"}, top_logprobs=3), finish_reason="stop")
    assert (asked["text"]["verbosity"], asked["top_logprobs"]) == ("low", 3)
    Response.model_validate(asked)


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({"type": "text", "schema": SCHEMA}, "text.format.schema"),
        ({"type": "text", "name": "n"}, "text.format.name"),
        ({"type": "text", "strict": True}, "text.format.strict"),
        ({"type": "json_object", "schema": SCHEMA}, "text.format.schema"),
        ({"type": "json_object", "description": "d"}, "text.format.description"),
        ({"type": "json_schema", "name": "n"}, "text.format.schema"),  # a json_schema needs its schema
        ({"type": "xml"}, "text.format.type"),
        ({"schema": SCHEMA}, "text.format.type"),
        ("json_object", "text.format"),
    ],
)
def test_a_text_format_key_its_type_has_not_is_a_400_naming_it(fmt: Any, param: str) -> None:
    found, message = refusal(text={"format": fmt})
    assert found == param and f"'{param}'" in message, message


def test_a_text_format_echoes_only_what_applies() -> None:
    assert echoed_format(request()) == {"type": "text"}
    assert echoed_format(request(text={"format": {"type": "text"}})) == {"type": "text"}
    assert echoed_format(request(text={"format": {"type": "json_object"}})) == {"type": "json_object"}
    json_schema = {"type": "json_schema", "name": "n", "schema": SCHEMA, "strict": True}
    assert echoed_format(request(text={"format": {**json_schema, "description": None}})) == json_schema


def test_a_text_format_is_the_chat_requests_response_format() -> None:
    def response_format(fmt: dict[str, Any]) -> Any:
        chat, _ = chat_request(request(text={"format": fmt}), [])
        return None if chat.response_format is None else chat.response_format.model_dump(by_alias=True)

    assert response_format({"type": "text"}) is None
    assert response_format({"type": "json_object"}) == {"type": "json_object", "json_schema": None}
    constrained = response_format({"type": "json_schema", "schema": SCHEMA, "strict": True})
    assert constrained["json_schema"] == {
        "name": "response",
        "description": None,
        "schema": SCHEMA,
        "strict": True,
    }


NULLABLE = [
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "text",
    "stream",
    "store",
    "previous_response_id",
    "metadata",
    "user",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "cache_salt",
    "mm_processor_kwargs",
    "truncation",
    "include",
    "reasoning",
    "top_logprobs",
    "max_tool_calls",
]


@pytest.mark.parametrize("name", NULLABLE)
def test_an_optional_field_sent_as_null_is_not_given(name: str) -> None:
    """OpenAI's clients send ``null`` for "the default"; chat takes it so too."""
    given, plain = request(**{name: None}), request()
    assert given == plain
    assert chat_request(given, []) == chat_request(plain, [])
    assert not given.stream and echoed_format(given) == {"type": "text"}


def test_an_optional_key_inside_sent_as_null_is_not_given() -> None:
    given = request(
        text={"format": None, "verbosity": None},
        tools=[{"type": "function", "name": "f", "description": None, "parameters": None, "strict": None}],
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE, "detail": None}]}],
    )
    plain = request(
        text={},
        tools=[{"type": "function", "name": "f"}],
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE}]}],
    )
    assert chat_request(given, []) == chat_request(plain, [])
    assert echoed_format(given) == {"type": "text"}


NESTED = "[" * 5000 + "]" * 5000
CALLS = [
    {"role": "user", "content": "hi"},
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    {"type": "function_call", "call_id": "c2", "name": "g", "arguments": f'{{"a": {NESTED}}}'},
    {"type": "function_call_output", "call_id": "c1", "output": "ok"},
]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": CALLS}, "input[2].arguments"),  # the second of the calls made together
        ({"tools": [{"type": "function", "name": "bad name", "parameters": {}}]}, "tools[0].name"),
        (
            {"text": {"format": {"type": "json_schema", "name": "bad name", "schema": SCHEMA}}},
            "text.format.name",
        ),
    ],
)
def test_validation_errors_of_the_chat_request_name_the_responses_fields(
    fields: dict[str, Any], param: str
) -> None:
    error = chat_error(request(**fields))
    assert isinstance(error, InvalidRequestError) and error.param == param
    assert f"'{param}'" in error.message, error.message
    for chat_name in ("messages", "function", "response_format", "json_schema"):
        assert chat_name not in error.message, error.message


def test_an_error_about_a_message_names_its_input_item_and_part() -> None:
    """Instructions and a stored conversation come before the input among the chat messages; calls made
    together are one assistant message: each error still names what the client sent."""
    history: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": IMAGE}]},
        {"type": "function_call", "call_id": "c0", "name": "f", "arguments": "{}"},
    ]
    items = [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},  # joins c0's message
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "and"}, {"type": "input_image", "image_url": IMAGE}],
        },
        {"role": "user", "content": "a string"},
    ]
    body = request(instructions="Be brief.", input=items, previous_response_id="resp_0")
    chat, params = chat_request(body, parse_items(history))
    assert [message.role for message in chat.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "user",
        "user",
    ]
    named = {
        "messages[0].content": "instructions",
        "messages[1].content[0].image_url.url": "previous_response_id",
        "messages[2].tool_calls[0].function.arguments": "previous_response_id",
        "messages[2].tool_calls[1].function.arguments": "input[0].arguments",
        "messages[2].tool_calls[1].id": "input[0].call_id",
        "messages[3].tool_call_id": "input[1].call_id",
        "messages[3].content": "input[1].output",
        "messages[4].content[0].text": "input[2].content[0].text",
        "messages[4].content[1].image_url.url": "input[2].content[1].image_url",
        "messages[4].content[1].uuid": "input[2].content[1].uuid",
        "messages[4].role": "input[2].role",
        "messages[5].content": "input[3].content",
        "messages": "input",
    }
    assert {path: params.name(path) for path in named} == named
    media = params.error(
        MediaError("Data URL payload is not valid base64.", param="messages[4].content[1].image_url.url")
    )
    assert media.param == "input[2].content[1].image_url" and media.code == "invalid_image"
    _, string_input = chat_request(request(input="just text"), [])
    assert string_input.name("messages[0].content") == "input"


def test_an_error_message_names_the_responses_fields_and_leaves_prose_alone() -> None:
    _, params = chat_request(
        request(input=[{"type": "function_call_output", "call_id": "c", "output": "x"}]), []
    )
    unanswered = params.error(
        InvalidRequestError(
            "no earlier assistant message made a tool call with id 'c'", param="messages[0].tool_call_id"
        )
    )
    assert unanswered.param == "input[0].call_id"
    constrained = params.error(
        InvalidRequestError(
            "tools with tool_choice 'required' cannot be combined with response_format.json_schema.schema: "
            "both constrain the answer",
            param="response_format.json_schema.schema",
        )
    )
    assert constrained.param == "text.format.schema"
    assert "cannot be combined with text.format.schema: both" in constrained.message
    long = params.error(ContextLengthError("requested 9 tokens (8 in the messages, 1 in the completion)."))
    assert long.param == "input" and long.message == "requested 9 tokens (8 in the input, 1 for the output)."
    full = params.error(ContextLengthError("However, the messages are 9 tokens, ... Shorten the messages."))
    assert full.message == "However, the input is 9 tokens, ... Shorten the input, or set truncation to auto."
    named = params.error(InvalidRequestError("x", param="tool_choice.function.name"))
    assert named.param == "tool_choice.name"
    assert params.error(InvalidRequestError("x", param="max_completion_tokens")).param == "max_output_tokens"


@pytest.mark.parametrize(
    ("metadata", "param"),
    [
        ({"k": "v" * 513}, "metadata.k"),
        ({"k" * 65: "v"}, "metadata." + "k" * 65),
        ({f"k{i}": "v" for i in range(17)}, "metadata"),
    ],
)
def test_metadata_past_openais_bounds_is_a_400_naming_it(metadata: dict[str, str], param: str) -> None:
    assert refusal(metadata=metadata)[0] == param
    request(metadata={"k" * 64: "v" * 512})  # at the bounds


def test_an_answers_text_and_its_calls_are_one_assistant_turn() -> None:
    """As the model wrote them (text, then its calls) and as chat's assistant message with content and
    ``tool_calls`` renders them: not a turn of text and then another of calls."""
    answer = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Let me look."}],
    }
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    result = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
    chat, params = chat_request(
        request(input=[{"role": "user", "content": "hi"}, answer, call, call, result]), []
    )
    assert [message.role for message in chat.messages] == ["user", "assistant", "tool"]
    turn = chat.messages[1].model_dump(exclude_none=True)
    assert turn["content"] == [{"type": "text", "text": "Let me look."}] and len(turn["tool_calls"]) == 2
    assert params.name("messages[1].tool_calls[1].function.arguments") == "input[3].arguments"
    assert params.name("messages[1].content[0]") == "input[1].content[0]"


def test_allowed_tools_are_chats_and_their_errors_name_the_responses_fields() -> None:
    refs = [{"type": "function", "name": "f"}, {"type": "function", "name": "g"}]
    choice = {"type": "allowed_tools", "mode": "required", "tools": refs}
    tools = [{"type": "function", "name": "f", "parameters": {}}]
    chat, params = chat_request(request(tools=tools, tool_choice=choice), [])
    assert chat.tool_choice is not None and not isinstance(chat.tool_choice, str)
    assert chat.tool_choice.model_dump(exclude_none=True) == {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "required",
            "tools": [{"type": "function", "function": {"name": n}} for n in "fg"],
        },
    }
    with pytest.raises(InvalidRequestError) as caught:
        check_tools(chat.tools, chat.tool_choice)
    assert params.error(caught.value).param == "tool_choice.tools[1].name"


def test_logprobs_are_for_a_text_answer_not_one_with_tools_to_call() -> None:
    tools = [{"type": "function", "name": "f", "parameters": {}}]
    include = ["message.output_text.logprobs"]
    error = chat_error(request(tools=tools, include=include))
    assert isinstance(error, InvalidRequestError) and error.param == "include"
    chat, _ = chat_request(request(tools=tools, include=include, tool_choice="none", top_logprobs=2), [])
    assert chat.logprobs and chat.top_logprobs == 2


def test_max_tool_calls_bounds_built_in_tools_so_changes_nothing_here() -> None:
    """OpenAI's bound on calls to built-in tools, of which mmserve runs none: the request is the same."""
    assert chat_request(request(max_tool_calls=1), []) == chat_request(request(), [])
    with pytest.raises(ValidationError):
        request(max_tool_calls=0)


@pytest.mark.parametrize(
    "fields",
    [{"user": 7}, {"safety_identifier": ["a"]}, {"prompt_cache_key": 1.5}, {"prompt_cache_retention": "1h"}],
)
def test_echoed_labels_are_of_openais_types(fields: dict[str, Any]) -> None:
    """The response echoes them, and the SDK reads them as strings (a retention as one of two)."""
    assert refusal(**fields)[0] == next(iter(fields))


def test_item_ids_are_bounded_and_a_null_type_is_no_type() -> None:
    for item_id in ("", "x" * 129):
        with pytest.raises(ValidationError):
            request(input=[{"role": "user", "content": "hi", "id": item_id}])
    [reference] = request(input=[{"type": None, "id": "msg_1"}]).input_items()
    assert type(reference).__name__ == "ItemReference" and reference.id == "msg_1"
    [message] = request(input=[{"type": None, "role": "user", "content": "hi"}]).input_items()
    assert type(message).__name__ == "InputMessage"


def test_parts_are_those_of_the_messages_role_and_a_status_is_openais() -> None:
    """An assistant's parts are text (``input_text`` taken, as OpenAI's input shape has it); only an
    assistant's text is ``output_text``; an item's status is one of OpenAI's three."""
    text = {"type": "input_text", "text": "x"}
    request(input=[{"role": "assistant", "content": [text]}])
    output_text = {"type": "output_text", "text": "x"}
    for role in ("user", "system", "developer"):
        param, message = refusal(input=[{"role": role, "content": [output_text]}])
        assert param == "input[0].content[0]" and "assistant" in message, (param, message)
    param, message = refusal(
        input=[{"role": "assistant", "content": [{"type": "input_image", "image_url": IMAGE}]}]
    )
    assert param == "input[0].content[0]" and "not images" in message
    for item in (
        {"role": "user", "content": "a", "status": "bogus"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "status": "weird"},
        {"type": "function_call_output", "call_id": "c", "output": "x", "status": "done"},
    ):
        param, _ = refusal(input=[item])
        assert param == "input[0].status", param
    request(input=[{"role": "user", "content": "a", "status": "completed"}])


def test_an_assistants_refusal_part_is_what_it_said() -> None:
    """OpenAI's output message may hold a refusal part; sent back, it is the assistant's text."""
    said = request(input=[{"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}])
    written = request(input=[{"role": "assistant", "content": [{"type": "output_text", "text": "I can't."}]}])
    assert said == written
    assert refusal(input=[{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}])[0] == (
        "input[0].content[0]"
    )
    assert (
        refusal(input=[{"role": "assistant", "content": [{"type": "refusal"}]}])[0] == "input[0].content[0]"
    )


def test_a_call_in_the_history_of_a_model_without_a_tool_format_is_named() -> None:
    llava = SimpleNamespace(tool_chat_template=None, tool_call_parser=None, config={"model_type": "llava"})
    items = [
        {"role": "user", "content": "Click it."},
        {"type": "function_call", "call_id": "c1", "name": "click", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
    ]
    chat, params = chat_request(request(input=items), [])
    with pytest.raises(InvalidRequestError) as refused:
        template_tools(llava, None, chat.messages)
    assert refused.value.param == "messages[1].tool_calls[0]" and "no tool format" in refused.value.message
    assert params.error(refused.value).param == "input[1]"


def test_auto_without_tools_is_responses_default_not_a_chat_request_for_calls() -> None:
    """Responses' tool_choice defaults to auto, tools or none; chat's auto needs tools (as OpenAI's)."""
    chat, _ = chat_request(request(tool_choice="auto"), [])
    assert chat.tool_choice is None and not chat.parses_tool_calls
    check_tools(chat.tools, chat.tool_choice)
    with pytest.raises(InvalidRequestError) as caught:
        check_tools(None, "auto")
    assert caught.value.param == "tool_choice"
