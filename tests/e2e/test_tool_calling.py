"""Tool calling on the chat API, served by the tiny Qwen2.5-VL and Qwen3-VL with an image: ``required``, a
named function and ``auto`` are constrained by xgrammar's structural tags, so the call's arguments always
parse and validate; greedy answers equal transformers' ``generate`` with xgrammar's HF logits processor on
the same structural tag; streamed deltas reassemble (the openai SDK's own stream state) to the
non-streamed message; ``none`` neither constrains nor parses a call; ``strict`` changes nothing;
``required`` with parallel calls may call again; a history of calls and results renders and is answered;
bad tool requests are 400s naming their field. The tiny models never open a call by themselves (their
LM-head rows for the tool tokens are zero); ``auto`` is pushed into one with ``logit_bias``."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import pytest
import torch
import xgrammar as xgr
from openai import OpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.e2e.conftest import Oracle, data_url, make_image
from tests.e2e.server import Server
from tests.e2e.structured_oracle import (
    constrained_greedy,
    eos_ids,
    served_tokens_are_the_oracles,
    tool_calls_tag,
)

pytestmark = pytest.mark.slow

FAMILIES = ["qwen2_5_vl", "qwen3_vl"]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"unit": {"enum": ["h", "m"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["unit", "n"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
TEXT = "What is the weather where this picture was taken?"
IMAGE = make_image(960, (320, 240))
MAX_TOKENS = 96  # a call here is about 40 tokens
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# the prompt renders both tools; the answer may call get_time only
GET_TIME = {"type": "function", "function": {"name": "get_time"}}
ALLOWED = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [GET_TIME]}}


def messages(text: str = TEXT) -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(IMAGE)}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def body(family: str, tool_choice: Any, **extra: Any) -> dict[str, Any]:
    return {
        "model": f"tiny-{family}",
        "messages": messages(),
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        **extra,
    }


def ask(server: Server, payload: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=300)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def tool_template(oracle: Oracle) -> str:
    """The template with tools: the processor's (Qwen3-VL) or, as on a real Qwen2.5-VL, the tokenizer's."""
    for template in (oracle.processor.chat_template, oracle.processor.tokenizer.chat_template):
        if "tools" in template:
            return str(template)
    raise AssertionError("no template with tools")


def oracle_answer(oracle: Oracle, tool_choice: Any, parallel: bool = True) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy answer to the same prompt (the checkpoint's own template with the tools),
    under the structural tag xgrammar builds for these tools and this tool choice."""
    parts = [{"type": "image"}, {"type": "text", "text": TEXT}]
    prompt = oracle.processor.apply_chat_template(
        [{"role": "user", "content": parts}],
        tools=TOOLS,
        chat_template=tool_template(oracle),
        add_generation_prompt=True,
        tokenize=False,
    )
    inputs = oracle.processor(text=[prompt], images=[IMAGE], return_tensors="pt")
    vocab_size = oracle.model.get_output_embeddings().weight.shape[0]
    info = xgr.TokenizerInfo.from_huggingface(
        oracle.processor.tokenizer, vocab_size=vocab_size, stop_token_ids=eos_ids(oracle)
    )
    tag = tool_calls_tag(TOOLS, tool_choice, parallel)
    grammar = xgr.GrammarCompiler(info, cache_enabled=False).compile_structural_tag(tag)
    return constrained_greedy(oracle, inputs, grammar, MAX_TOKENS)


def calls_of(response: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each call's name and decoded arguments, which validate against its tool's schema."""
    calls = []
    for call in response["choices"][0]["message"].get("tool_calls") or []:
        assert call["type"] == "function" and call["id"].startswith("call_")
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, SCHEMAS[call["function"]["name"]])
        calls.append((call["function"]["name"], arguments))
    return calls


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tool_choice", ["required", NAMED, ALLOWED], ids=["required", "named", "allowed"])
def test_a_constrained_call_validates_and_equals_generate(
    family: str,
    tool_choice: Any,
    family_server: Callable[..., Server],
    family_oracle: Callable[[str], Oracle],
) -> None:
    """One call (``required`` without parallel calls ends after its first), then the end."""
    oracle = family_oracle(family)
    response = ask(family_server(family), body(family, tool_choice, parallel_tool_calls=False))
    calls = calls_of(response)
    assert len(calls) == 1, response["choices"][0]
    if tool_choice in (NAMED, ALLOWED):
        assert calls[0][0] == ("get_weather" if tool_choice == NAMED else "get_time")
    assert response["choices"][0]["message"]["content"] is None
    assert response["choices"][0]["finish_reason"] == "tool_calls"
    hf_ids, hf_logprobs = oracle_answer(oracle, tool_choice, parallel=False)
    if served_tokens_are_the_oracles(response, oracle, hf_ids, hf_logprobs):
        text = oracle.processor.tokenizer.decode(hf_ids, skip_special_tokens=True)
        assert text.startswith("<tool_call>") and text.endswith("</tool_call>"), text
        call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert [(call["name"], call["arguments"])] == calls


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_deltas_reassemble_to_the_message(family: str, family_server: Callable[..., Server]) -> None:
    server = family_server(family)
    whole = ask(server, body(family, NAMED))["choices"][0]
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    state = ChatCompletionStreamState()
    chunks = list(client.chat.completions.create(**body(family, NAMED), stream=True))
    for chunk in chunks:
        state.handle_chunk(chunk)
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == whole["finish_reason"] == "tool_calls"
    assert streamed.message.content is None is whole["message"]["content"]  # (calls only: OpenAI's null)
    [call] = streamed.message.tool_calls or []
    [want] = whole["message"]["tool_calls"]
    assert (call.function.name, json.loads(call.function.arguments)) == (
        want["function"]["name"],
        json.loads(want["function"]["arguments"]),
    )
    first = next(
        c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls
    )
    assert first.id and first.function.name == "get_weather"  # id and name come first


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_is_free_text_until_a_call_opens_then_the_call_is_well_formed(
    family: str, family_server: Callable[..., Server], family_oracle: Callable[[str], Oracle]
) -> None:
    server = family_server(family)
    plain = ask(server, body(family, "auto"))["choices"][0]
    assert plain["message"]["content"] and not plain["message"].get("tool_calls")
    assert "<tool_call>" not in plain["message"]["content"]
    open_id = family_oracle(family).processor.tokenizer.convert_tokens_to_ids("<tool_call>")
    pushed = ask(server, body(family, "auto", logit_bias={str(open_id): 100}, parallel_tool_calls=False))
    assert [name for name, _ in calls_of(pushed)] in (["get_weather"], ["get_time"])
    assert pushed["choices"][0]["finish_reason"] == "tool_calls"


def open_call_bias(oracle: Oracle) -> dict[str, float]:
    """A ``logit_bias`` that makes the tiny model write ``<tool_call>`` wherever it may."""
    return {str(oracle.processor.tokenizer.convert_tokens_to_ids("<tool_call>")): 100}


@pytest.mark.parametrize("family", FAMILIES)
def test_none_neither_constrains_nor_parses_a_call(
    family: str, family_server: Callable[..., Server], family_oracle: Callable[[str], Oracle]
) -> None:
    """Pushed into ``<tool_call>`` by the bias, the model writes it again and again (``auto`` would hold
    what follows to a call); made to write a whole call to a declared tool (a regex), the call stays
    text in ``content``, and the answer ends with "stop", not "tool_calls"."""
    server = family_server(family)
    pushed = ask(server, body(family, "none", logit_bias=open_call_bias(family_oracle(family))))["choices"][0]
    assert pushed["message"]["content"].startswith("<tool_call><tool_call>"), pushed
    assert not pushed["message"].get("tool_calls") and pushed["finish_reason"] == "length"
    call = '<tool_call>\n{"name": "get_time", "arguments": {"unit": "h", "n": 7}}\n</tool_call>'
    written = ask(server, body(family, "none", structured_outputs={"regex": re.escape(call)}))["choices"][0]
    assert written["message"]["content"] == call, written
    assert not written["message"].get("tool_calls") and written["finish_reason"] == "stop"


@pytest.mark.parametrize("strict", [True, False])
def test_strict_is_accepted_and_a_call_is_held_to_its_schema_either_way(
    strict: bool, family_server: Callable[..., Server]
) -> None:
    """``strict`` (OpenAI's) is accepted and changes no constraint: a ``required`` call's arguments
    validate with ``strict: false`` as with ``true`` (unconstrained, the tiny model writes no call)."""
    tools = [{**tool, "function": {**tool["function"], "strict": strict}} for tool in TOOLS]
    response = ask(
        family_server("qwen2_5_vl"), body("qwen2_5_vl", "required", parallel_tool_calls=False, tools=tools)
    )
    assert len(calls_of(response)) == 1 and response["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("family", FAMILIES)
def test_required_with_parallel_calls_may_call_again(
    family: str, family_server: Callable[..., Server], family_oracle: Callable[[str], Oracle]
) -> None:
    """Kept from ending (EOS biased away) and pushed into ``<tool_call>`` (``get_time`` only: its arguments
    hold no string the push could fill), ``required`` with parallel calls calls again, a newline between
    two calls, until the max tokens, every closed call well-formed and no text between or after them;
    without parallel calls the answer ends after the first (EOS is then the only token allowed)."""
    server = family_server(family)
    oracle = family_oracle(family)
    bias = open_call_bias(oracle) | {str(token_id): -100 for token_id in eos_ids(oracle)}
    push = {"logit_bias": bias, "tools": [TOOLS[1]], "max_tokens": 160}
    several = ask(server, body(family, "required", parallel_tool_calls=True, **push))
    assert several["choices"][0]["finish_reason"] == "length", several
    assert several["choices"][0]["message"]["content"] is None, several  # nothing but calls
    # every call whole but maybe the last, which the max tokens may have cut (its arguments so far)
    made = several["choices"][0]["message"]["tool_calls"]
    last = made[-1]["function"]["arguments"]
    whole = made if last.endswith("}") and last.count("{") == last.count("}") else made[:-1]
    several["choices"][0]["message"]["tool_calls"] = whole
    assert len(calls_of(several)) >= 2, several
    one = ask(server, body(family, "required", parallel_tool_calls=False, **push))
    assert len(calls_of(one)) == 1 and one["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_history_of_calls_and_results_is_answered(
    family: str, family_server: Callable[..., Server]
) -> None:
    server = family_server(family)
    first = ask(server, body(family, NAMED))["choices"][0]["message"]
    history = [
        *messages(),
        {"role": "assistant", "content": None, "tool_calls": first["tool_calls"]},
        {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": '{"forecast": "sunny"}'},
    ]
    follow = {**body(family, "none"), "messages": history}
    answer = ask(server, follow)
    assert answer["choices"][0]["message"]["content"] and not answer["choices"][0]["message"].get(
        "tool_calls"
    )
    alone = ask(server, body(family, "none"))
    assert answer["usage"]["prompt_tokens"] > alone["usage"]["prompt_tokens"]  # the history is in the prompt
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the image's blocks: cached


def bad(server: Server, payload: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=60)
    assert resp.status_code == 400, resp.text
    return dict(resp.json()["error"])


def test_bad_tool_requests_are_400s_naming_their_field(family_server: Callable[..., Server]) -> None:
    server = family_server("qwen2_5_vl")
    unknown = {"type": "function", "function": {"name": "nowhere"}}
    assert bad(server, body("qwen2_5_vl", unknown))["param"] == "tool_choice.function.name"
    narrowed = body(
        "qwen2_5_vl", {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [unknown]}}
    )
    assert bad(server, narrowed)["param"] == "tool_choice.allowed_tools.tools[0].function.name"
    schema = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}},
        }
    ]
    assert bad(server, {**body("qwen2_5_vl", "auto"), "tools": schema})["param"].startswith(
        "tools[0].function.parameters"
    )
    orphan = [*messages(), {"role": "tool", "tool_call_id": "call_nobody", "content": "42"}]
    assert (
        bad(server, {**body("qwen2_5_vl", "auto"), "messages": orphan})["param"] == "messages[1].tool_call_id"
    )
    both = {**body("qwen2_5_vl", "auto"), "structured_outputs": {"regex": "[a-z]+"}}
    assert bad(server, both)["param"].startswith("structured_outputs")
    assert bad(server, {**body("qwen2_5_vl", "required"), "tools": []})["param"] == "tool_choice"
    assert bad(server, {**body("qwen2_5_vl", "auto"), "tools": None})["param"] == "tool_choice"
    # arguments are an object: a schema of another type would make calls that leak into content
    for root in ("integer", "array", "string", "null"):
        scalar = [{"type": "function", "function": {"name": "f", "parameters": {"type": root}}}]
        error = bad(server, {**body("qwen2_5_vl", "required"), "tools": scalar})
        assert error["param"] == "tools[0].function.parameters.type", error
    # a misspelt key of a declaration is refused, not read as a function without parameters
    typo = [{"type": "function", "function": {"name": "f", "parmeters": {"type": "object"}}}]
    assert bad(server, {**body("qwen2_5_vl", "required"), "tools": typo})["param"] == (
        "tools[0].function.parmeters"
    )


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_tools_on_a_model_without_a_tool_format_are_refused(
    family: str, family_server: Callable[..., Server]
) -> None:
    error = bad(family_server(family), body(family, "auto"))
    assert error["param"] == "tools" and "no tool format" in error["message"]


# ---------------------------------------------------------------- the Responses API


def responses_body(family: str, tool_choice: Any, **extra: Any) -> dict[str, Any]:
    content = [{"type": "input_image", "image_url": data_url(IMAGE)}, {"type": "input_text", "text": TEXT}]
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    return {
        "model": f"tiny-{family}",
        "input": [{"role": "user", "content": content}],
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
        **extra,
    }


def test_responses_call_a_function_streamed_or_not_and_take_its_output(
    family_server: Callable[..., Server],
) -> None:
    server = family_server("qwen2_5_vl")
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    named = {"type": "function", "name": "get_weather"}
    chat = ask(server, body("qwen2_5_vl", NAMED, parallel_tool_calls=False))
    response = client.responses.create(**responses_body("qwen2_5_vl", named))
    assert response.status == "completed"
    [call] = [item for item in response.output if item.type == "function_call"]
    assert [item.type for item in response.output] == ["function_call"]  # no text besides the call
    allowed = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "get_time"}],
    }
    narrowed = client.responses.create(**responses_body("qwen2_5_vl", allowed))
    assert [item.name for item in narrowed.output if item.type == "function_call"] == ["get_time"]
    assert (
        narrowed.tool_choice.type == "allowed_tools"
        and narrowed.usage.input_tokens == response.usage.input_tokens
    )
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert arguments == json.loads(chat["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])

    with client.responses.stream(**responses_body("qwen2_5_vl", named)) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds[2:-1] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    [streamed] = final.output
    assert streamed.type == "function_call" and json.loads(streamed.arguments) == arguments

    follow_up = responses_body(
        "qwen2_5_vl",
        "none",
        input=[
            *responses_body("qwen2_5_vl", "none")["input"],
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "sunny"}'},
        ],
    )
    answer = client.responses.create(**follow_up)
    assert answer.output_text and answer.usage.input_tokens > response.usage.input_tokens
    assert answer.usage.input_tokens_details.cached_tokens > 0
    # the same turn as the SDK's objects dump it (caller, namespace: null) and an output of text parts
    sdk_shaped = responses_body(
        "qwen2_5_vl",
        "none",
        input=[
            *responses_body("qwen2_5_vl", "none")["input"],
            call.model_dump(),
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": [
                    {"type": "input_text", "text": '{"forecast": '},
                    {"type": "input_text", "text": '"sunny"}'},
                ],
            },
        ],
    )
    assert client.responses.create(**sdk_shaped).output_text == answer.output_text
    # an answer's text and its call are one assistant turn, as on chat: the same prompt, token for token
    said = {"role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    as_items = [*follow_up["input"][:1], said, call.model_dump(), result]
    counted = client.responses.input_tokens.count(
        model=follow_up["model"], input=as_items, tools=follow_up["tools"]
    )
    chat_call = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    as_messages = [
        *messages(),
        {"role": "assistant", "content": "Let me check.", "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    tokenized = httpx.post(
        f"{server.base_url}/tokenize", json={"messages": as_messages, "tools": TOOLS}, timeout=60
    )
    assert tokenized.status_code == 200 and tokenized.json()["count"] == counted.input_tokens


REPORT = {
    "type": "object",
    "properties": {"place": {"type": "string", "maxLength": 10}, "sunny": {"type": "boolean"}},
    "required": ["place", "sunny"],
    "additionalProperties": False,
}


def test_an_output_format_beside_tools_is_the_answer_or_calls(
    family_server: Callable[..., Server], family_oracle: Callable[[str], Oracle]
) -> None:
    """OpenAI's agents send tools with an output type: under ``auto`` the answer is the format's JSON
    alone or calls alone; under ``required`` calls (the format has no text to hold). On Responses too."""
    server = family_server("qwen2_5_vl")
    schema_format = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT}}
    oracle = family_oracle("qwen2_5_vl")
    bias = open_call_bias(oracle)
    brace = {str(oracle.processor.tokenizer.convert_tokens_to_ids("{")): 100}  # (the answer's first)
    answered = ask(server, body("qwen2_5_vl", "auto", response_format=schema_format, logit_bias=brace))
    choice = answered["choices"][0]
    assert choice["finish_reason"] == "stop" and not choice["message"].get("tool_calls"), choice
    jsonschema.validate(json.loads(choice["message"]["content"]), REPORT)
    called = ask(server, body("qwen2_5_vl", "auto", response_format=schema_format, logit_bias=bias))
    assert calls_of(called) and called["choices"][0]["message"]["content"] is None
    required = ask(server, body("qwen2_5_vl", "required", response_format={"type": "json_object"}))
    assert calls_of(required) and required["choices"][0]["finish_reason"] == "tool_calls"
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    text = {"format": {"type": "json_schema", "name": "report", "schema": REPORT}}
    response = client.responses.create(**responses_body("qwen2_5_vl", "auto", text=text))
    assert response.status == "completed"
    [item] = response.output
    if item.type == "function_call":
        jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])
    else:
        jsonschema.validate(json.loads(response.output_text), REPORT)
