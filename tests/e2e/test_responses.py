"""``POST /v1/responses`` through the openai SDK on the tiny LLaVA: a string or message items with images,
instructions, ``text.format``, ``top_p``, ``cache_salt``, ``metadata`` (echoed and stored) and ``user``
(no effect); the answer is the chat endpoint's for the same conversation (one input path, one output
path); the typed stream reassembles to it; what is not implemented is a 400 naming it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.e2e.conftest import data_url, make_image
from tests.e2e.metrics import delta
from tests.e2e.server import Server
from tests.e2e.test_media_ids import assert_a_repeat_hit, cache_hits

pytestmark = pytest.mark.slow

IMAGE = data_url(make_image(6601))


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def chat_text(
    server: Server, messages: list[dict[str, Any]], max_tokens: int, **extra: Any
) -> dict[str, Any]:
    body = {"model": "tiny-llava", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def test_a_string_input_is_the_chat_answer(server: Server) -> None:
    response = client(server).responses.create(
        model="tiny-llava", input="Hello there", max_output_tokens=8, temperature=0
    )
    chat = chat_text(server, [{"role": "user", "content": "Hello there"}], 8)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == 8


def test_images_and_instructions_take_the_chat_path_and_its_caches(server: Server) -> None:
    items: Any = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is in the picture?"},
                {"type": "input_image", "image_url": IMAGE},
            ],
        }
    ]
    before = server.metrics()
    response = client(server).responses.create(
        model="tiny-llava", instructions="Be brief.", input=items, max_output_tokens=6, temperature=0
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in the picture?"},
                {"type": "image_url", "image_url": {"url": IMAGE}},
            ],
        },
    ]
    chat = chat_text(server, messages, 6)
    after = server.metrics()
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.usage is not None and response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert delta(before, after, "mmserve_mm_processor_seconds_count") == 1  # the chat request hit
    assert delta(before, after, "mmserve_encoder_runs_total") == 1


def test_the_stream_is_openais_event_sequence_and_reassembles(server: Server) -> None:
    kwargs: Any = {
        "model": "tiny-llava",
        "input": "Tell me a story",
        "max_output_tokens": 7,
        "temperature": 0,
    }
    whole = client(server).responses.create(**kwargs)
    with client(server).responses.stream(**kwargs) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # max_output_tokens reached, as OpenAI says it
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.usage is not None
    assert last.response.usage.output_tokens == 7


class Record(BaseModel):
    n: int


def test_text_format_is_a_structured_output(server: Server) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    parsed = client(server).responses.parse(
        model="tiny-llava", input="A record, please.", max_output_tokens=40, temperature=0, text_format=Record
    )
    assert isinstance(parsed.output_parsed, Record)
    chat = chat_text(
        server,
        [{"role": "user", "content": "A record, please."}],
        40,
        response_format={"type": "json_schema", "json_schema": {"name": "Record", "schema": schema}},
    )
    assert json.loads(parsed.output_text) == json.loads(chat["choices"][0]["message"]["content"])


def test_text_format_json_object_is_a_json_object(server: Server) -> None:
    """The same greedy answer as chat's ``response_format`` json_object, which parses; this input's
    unconstrained answer is text (tests above)."""
    response = client(server).responses.create(
        model="tiny-llava",
        input="Tell me a story",
        max_output_tokens=16,
        temperature=0,
        text={"format": {"type": "json_object"}},
    )
    assert response.status == "completed" and isinstance(json.loads(response.output_text), dict)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_object"
    chat = chat_text(
        server,
        [{"role": "user", "content": "Tell me a story"}],
        16,
        response_format={"type": "json_object"},
    )
    assert response.output_text == chat["choices"][0]["message"]["content"]


def test_metadata_and_labels_are_echoed_and_stored_and_change_nothing(server: Server) -> None:
    metadata = {"trace": "t-42", "team": "vision"}
    labels: dict[str, Any] = {
        "user": "user-7",
        "safety_identifier": "sid-1",
        "prompt_cache_key": "agent-3",
        "prompt_cache_retention": "24h",
        "max_tool_calls": 2,
    }
    kwargs: Any = {"model": "tiny-llava", "input": "Hello there", "max_output_tokens": 6, "temperature": 0}
    labelled = client(server).responses.create(**kwargs, metadata=metadata, **labels)
    stored = client(server).responses.retrieve(labelled.id)
    for response in (labelled, stored):
        assert response.metadata == metadata
        assert {name: getattr(response, name) for name in labels} == labels
    plain = client(server).responses.create(**kwargs)
    assert plain.metadata == {} and plain.output_text == labelled.output_text
    assert all(getattr(plain, name) is None for name in labels)


def test_a_tiny_top_p_samples_the_top_token(server: Server) -> None:
    """At temperature 1, ``top_p`` 1e-6 keeps only the top token: the greedy answer (a temperature-1
    sample of 16 tokens without it differs from greedy: checked)."""
    kwargs: Any = {"model": "tiny-llava", "input": "Hello there", "max_output_tokens": 16}
    greedy = client(server).responses.create(**kwargs, temperature=0)
    narrow = client(server).responses.create(**kwargs, temperature=1.0, top_p=1e-6)
    assert narrow.top_p == 1e-6 and narrow.output_text == greedy.output_text


def test_a_cache_salt_shares_no_cache_hit_with_another_salt(server: Server) -> None:
    items: Any = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Salted?"},
                {"type": "input_image", "image_url": data_url(make_image(6604))},
            ],
        }
    ]

    def ask(salt: str) -> Any:
        return client(server).responses.create(
            model="tiny-llava",
            input=items,
            max_output_tokens=6,
            temperature=0,
            store=False,
            extra_body={"cache_salt": salt},
        )

    first = ask("salt-a")
    before = server.metrics()
    same = ask("salt-a")
    middle = server.metrics()
    other = ask("salt-b")
    after = server.metrics()
    assert first.output_text == same.output_text == other.output_text
    assert_a_repeat_hit(before, middle)
    assert cache_hits(middle, after) == dict.fromkeys(cache_hits(middle, after), 0.0)
    assert same.usage is not None and same.usage.input_tokens_details.cached_tokens > 0
    assert other.usage is not None and other.usage.input_tokens_details.cached_tokens == 0
    assert delta(middle, after, "mmserve_encoder_runs_total") == 1


def test_a_media_id_names_an_image_sent_before(server: Server) -> None:
    def ask(image: dict[str, Any]) -> Any:
        items: Any = [{"role": "user", "content": [{"type": "input_text", "text": "And this?"}, image]}]
        return client(server).responses.create(
            model="tiny-llava", input=items, max_output_tokens=6, temperature=0, store=False
        )

    url = data_url(make_image(6602))
    first = ask({"type": "input_image", "image_url": url, "uuid": "responses-shot"})
    before = server.metrics()
    again = ask({"type": "input_image", "uuid": "responses-shot"})  # the uuid alone, as on chat
    after = server.metrics()
    assert again.output_text == first.output_text
    assert again.usage is not None and first.usage is not None
    assert again.usage.input_tokens == first.usage.input_tokens
    assert delta(before, after, "mmserve_mm_processor_seconds_count") == 0
    resp = httpx.post(
        f"{server.base_url}/v1/responses",
        json={"model": "tiny-llava", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        timeout=60,
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input[0].content[0].image_url"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"conversation": "conv_123"}, "conversation"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        (  # no call c
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
            "input[0].call_id",
        ),
        ({"input": [{"type": "computer_call", "call_id": "c"}]}, "input[0]"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0]",
        ),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
                        ],
                    }
                ]
            },
            "input[0].content[0]",
        ),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"text": {"format": {"type": "text", "schema": {"type": "object"}}}}, "text.format.schema"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"input": []}, "input"),
        ({"model": "other"}, None),
    ],
)
def test_what_is_not_implemented_is_a_400_naming_it(
    server: Server, extra: dict[str, Any], param: Any
) -> None:
    body = {"model": "tiny-llava", "input": "x", "max_output_tokens": 2, **extra}
    resp = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert resp.status_code == (404 if "model" in extra else 400), resp.text
    error = resp.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    parts = [part for item in extra.get("input", []) for part in item.get("content", [])]
    for part in parts:  # a refused content part is named by its type
        assert repr(part["type"]) in error["message"], error


def test_responses_and_events_are_the_sdks_types_strictly_and_its_dumps_go_back_as_input(
    server: Server,
) -> None:
    """Every object and event validates against the openai SDK's own models (strict: no field left to
    default), a json_schema format without a name is echoed with the one applied, and what the SDK
    dumps of an answer (``model_dump()``: its null fields included) is taken back as input."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body: dict[str, Any] = {
        "model": "tiny-llava",
        "input": "A record, please.",
        "max_output_tokens": 24,
        "temperature": 0,
        "text": {"format": {"type": "json_schema", "schema": schema}},
    }
    resp = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    response = Response.model_validate(resp.json(), strict=True)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema" and response.text.format.name == "response"
    assert response.usage is not None and response.usage.input_tokens_details.cache_write_tokens == 0
    events = TypeAdapter(ResponseStreamEvent)
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json={**body, "stream": True}) as streamed:
        payloads = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
    for payload in payloads:
        events.validate_python(payload, strict=True)

    sdk = client(server)
    first = sdk.responses.create(model="tiny-llava", input="Hello there", max_output_tokens=6, temperature=0)
    dumped = [item.model_dump() for item in first.output]  # phase: None and the like
    follow_up = sdk.responses.create(
        model="tiny-llava",
        input=[{"role": "user", "content": "Hello there"}, *dumped, {"role": "user", "content": "And?"}],
        max_output_tokens=4,
        temperature=0,
        stream_options={"include_obfuscation": False},
        reasoning={"effort": None},
    )
    assert follow_up.usage is not None and follow_up.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]


def test_included_logprobs_are_chats_streamed_or_not(server: Server) -> None:
    """``include`` the output text's logprobs (with ``top_logprobs`` alternatives): chat's for the same
    conversation, token for token, in the output_text part, and over the stream's text deltas; the
    includables naming what mmserve never makes (reasoning, hosted tools' results) add nothing."""
    from openai.types.responses import Response

    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]
    chat = chat_text(server, messages, 6, logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"]
    include = ["message.output_text.logprobs", "reasoning.encrypted_content", "web_search_call.results"]
    body = {"model": "tiny-llava", "input": "Hello there", "max_output_tokens": 6, "temperature": 0}
    resp = httpx.post(f"{server.base_url}/v1/responses", json={**body, "include": include, "top_logprobs": 3})
    assert resp.status_code == 200, resp.text
    response = Response.model_validate(resp.json(), strict=True)
    [part] = response.output[0].content  # type: ignore[union-attr]
    assert [lp.model_dump() for lp in part.logprobs] == chat  # type: ignore[union-attr]
    assert all(len(lp["top_logprobs"]) == 3 for lp in chat)
    streamed_body = {**body, "include": include, "top_logprobs": 3, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json=streamed_body) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
    deltas = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    assert deltas == done["logprobs"] == chat
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == chat
    plain = httpx.post(f"{server.base_url}/v1/responses", json=body).json()
    assert plain["output"][0]["content"][0]["logprobs"] == []  # none unless included
    for extra, param in (
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"include": ["nothing.real"]}, "include[0]"),
    ):
        refused = httpx.post(f"{server.base_url}/v1/responses", json={**body, **extra})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
