"""Structured outputs from the client's side, on the tiny LLaVA with every cache on: each constraint kind
answers within its constraint and streams the same answer; the openai SDK's ``parse`` returns an object;
32 concurrent requests mixing 8 schemas and free text all come back right; constraints work with the
other request features; every bad constraint is a 400 naming its field."""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import xgrammar as xgr
from pydantic import BaseModel, Field

from tests.e2e.conftest import greedy_body, make_image, user_message
from tests.e2e.metrics import delta
from tests.e2e.parity import concurrent_bodies
from tests.e2e.server import Server, stream_chunks

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Answer in the requested form."}]


def chat(server: Server, **fields: Any) -> httpx.Response:
    payload = {"model": "tiny-llava", "messages": QUESTION, "max_tokens": 200, "temperature": 0, **fields}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=120)


def answer(server: Server, **fields: Any) -> dict[str, Any]:
    resp = chat(server, **fields)
    assert resp.status_code == 200, resp.text
    return dict(resp.json()["choices"][0])


def streamed(server: Server, **fields: Any) -> tuple[str, str | None]:
    """The stream's content deltas joined, and its finish reason."""
    payload = {
        "model": "tiny-llava",
        "messages": QUESTION,
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
    }
    parts, reason = [], None
    for chunk in stream_chunks(server, {**payload, **fields}, timeout_s=120):
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            parts.append(choice["delta"].get("content", ""))
            reason = choice["finish_reason"] or reason
    return "".join(parts), reason


KINDS: dict[str, tuple[dict[str, Any], Any]] = {
    "regex": (
        {"structured_outputs": {"regex": r"[a-z]{2,6}-\d{3}"}},
        lambda text: re.fullmatch(r"[a-z]{2,6}-\d{3}", text),
    ),
    "choice": (
        {"structured_outputs": {"choice": ["red", "green", "dark blue"]}},
        lambda text: text in ("red", "green", "dark blue"),
    ),
    "grammar": (
        {"structured_outputs": {"grammar": 'root ::= "It is " ("a " | "an ") [a-z]{1,8} "."'}},
        lambda text: re.fullmatch(r"It is an? [a-z]{1,8}\.", text),
    ),
    "json_object": ({"response_format": {"type": "json_object"}}, None),
    "json_object_compact": (
        {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
        None,
    ),
}


def json_object_so_far(text: str, finish_reason: str) -> bool:
    """A JSON object if the answer ended; else (its keys and strings are the model's to end) a text that
    a JSON object can start with, by xgrammar's own JSON grammar over single bytes."""
    if finish_reason == "stop":
        return isinstance(json.loads(text), dict)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([bytes([i]) for i in range(256)]), cache_enabled=False)
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema('{"type": "object"}', strict_mode=False))
    return text.startswith("{") and bool(matcher.accept_string(text))


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_answers_within_its_constraint_and_streams_the_same(server: Server, kind: str) -> None:
    fields, matches = KINDS[kind]
    choice = answer(server, **fields)
    text, reason = choice["message"]["content"], choice["finish_reason"]
    if matches is None:
        assert json_object_so_far(text, reason), text
        assert "\n" not in text or kind == "json_object"
    else:
        assert reason == "stop" and matches(text), choice
    assert streamed(server, **fields) == (text, reason)


class Sighting(BaseModel):
    """What the SDK's ``parse`` asks for: bounded strings and numbers, so the tiny model's answer ends."""

    animal: str = Field(max_length=12)
    count: int = Field(ge=0, le=99)
    certain: bool


def test_the_openai_sdks_parse_returns_an_object(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    completion = client.chat.completions.parse(
        model="tiny-llava",
        messages=[{"role": "user", "content": "What did you see?"}],
        response_format=Sighting,
        max_tokens=400,
        temperature=0,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Sighting)
    assert completion.choices[0].finish_reason == "stop"


def schemas() -> list[dict[str, Any]]:
    """Eight different schemas, each with bounded answers."""
    found = []
    for i in range(8):
        properties: dict[str, Any] = {f"f{i}": {"type": "integer", "minimum": 0, "maximum": 9 + i}}
        if i % 2:
            properties["name"] = {"type": "string", "maxLength": 6}
        if i % 3 == 0:
            properties["flag"] = {"enum": ["on", "off", f"v{i}"]}
        found.append({"type": "object", "properties": properties, "required": list(properties)})
    return found


def test_32_concurrent_requests_mixing_8_schemas_and_free_text(server: Server) -> None:
    """24 constrained (3 per schema; the even schemas compact) and 8 free-text requests at once, some with an
    image: every constrained answer validates, every free-text answer is the one it gets alone, and the
    compiled-grammar cache serves a schema's later uses."""
    shapes = schemas()

    def constrained(i: int) -> dict[str, Any]:
        body = greedy_body([user_message(f"Record {i}.")], 400, ignore_eos=False)
        return {**body, "structured_outputs": {"json": shapes[i % 8], "disable_any_whitespace": i % 2 == 0}}

    def free(i: int) -> dict[str, Any]:
        return greedy_body([user_message(f"Free text {i}.", *([make_image(970 + i)] if i % 2 else []))], 12)

    idle = [concurrent_bodies(server, [free(i)])[0] for i in range(8)]
    before = server.metrics()
    mixed = [constrained(i) for i in range(24)] + [free(i) for i in range(8)]
    responses = concurrent_bodies(server, mixed)
    after = server.metrics()
    for i, response in enumerate(responses[:24]):
        choice = response["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), shapes[i % 8])
    for alone, beside in zip(idle, responses[24:], strict=True):
        assert beside["choices"][0]["message"] == alone["choices"][0]["message"]
    compiles = delta(before, after, "mmserve_structured_output_compile_seconds_count")
    assert compiles == 8  # compiled once each, however many asked
    assert (
        delta(before, after, "mmserve_structured_output_cache_misses_total")
        + delta(before, after, "mmserve_structured_output_cache_hits_total")
        == 24
    )
    again = server.metrics()
    answer(server, structured_outputs={"json": shapes[0], "disable_any_whitespace": True}, max_tokens=160)
    last = server.metrics()
    assert delta(again, last, "mmserve_structured_output_cache_hits_total") == 1
    assert delta(again, last, "mmserve_structured_output_compile_seconds_count") == 0


RECORD = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 10},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["word", "n"],
}
COMPACT = {"structured_outputs": {"json": RECORD, "disable_any_whitespace": True}}


def test_constraints_work_with_the_other_request_features(server: Server) -> None:
    # seeded sampling: reproducible, and still within the schema
    seeded = [answer(server, **COMPACT, temperature=1.0, seed=7) for _ in range(2)]
    assert seeded[0]["message"] == seeded[1]["message"]
    jsonschema.validate(json.loads(seeded[0]["message"]["content"]), RECORD)
    # min_tokens cannot outlast a complete grammar: the answer ends with it
    short = answer(server, **COMPACT, min_tokens=150)
    assert short["finish_reason"] == "stop"
    jsonschema.validate(json.loads(short["message"]["content"]), RECORD)
    # a stop string cuts the constrained answer like any other; its usage counts the tokens up to the
    # one that completed the stop string, though forced tokens after it came in the same output (with
    # logprobs nothing is forced: one token at a time)
    cut_whole = chat(server, **COMPACT, stop=['"n"']).json()
    cut = cut_whole["choices"][0]
    assert cut["finish_reason"] == "stop" and '"n"' not in cut["message"]["content"]
    assert short["message"]["content"].startswith(cut["message"]["content"])
    one_by_one = chat(server, **COMPACT, stop=['"n"'], logprobs=True).json()
    assert one_by_one["choices"][0]["message"] == cut["message"]
    assert cut_whole["usage"]["completion_tokens"] == one_by_one["usage"]["completion_tokens"]
    assert len(one_by_one["choices"][0]["logprobs"]["content"]) == one_by_one["usage"]["completion_tokens"]
    # logprobs are those of the raw logits: the sampled token's, and alternatives the grammar refused
    with_logprobs = answer(server, **COMPACT, logprobs=True, top_logprobs=3)
    entries = with_logprobs["logprobs"]["content"]
    assert "".join(entry["token"] for entry in entries) == with_logprobs["message"]["content"]
    assert all(len(entry["top_logprobs"]) == 3 and entry["logprob"] <= 0 for entry in entries)
    # max_tokens first: "length", with the truncated text
    truncated = answer(server, **COMPACT, max_tokens=3)
    assert truncated["finish_reason"] == "length" and short["message"]["content"].startswith(
        truncated["message"]["content"]
    )


def test_formats_and_patterns_answer_valid_values_however_the_model_leans(server: Server) -> None:
    """A model pushed to write digits still answers an IPv4 address, a date and a date-time that
    Python's parsers take, and a string its pattern fully matches. xgrammar's own grammars would let it
    write 000.000.000.000, the year 0000, and ABC1 for ``^[A-Z]{3}( [0-9]{1,4})?$`` (engine/structured/
    formats.py, patterns.py)."""

    def token_ids(text: str) -> list[int]:
        body = {"prompt": text, "add_special_tokens": False}
        return list(httpx.post(f"{server.base_url}/tokenize", json=body, timeout=30).json()["tokens"])

    code = "^[A-Z]{3}( [0-9]{1,4})?$"
    schema = {
        "type": "object",
        "properties": {
            "ip": {"type": "string", "format": "ipv4"},
            "day": {"type": "string", "format": "date"},
            "at": {"type": "string", "format": "date-time"},
            "code": {"type": "string", "pattern": code},
        },
        "required": ["ip", "day", "at", "code"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "when", "schema": schema}}
    for digit in "01":
        bias = {str(token): 100 for token in token_ids(digit)}
        content = answer(server, response_format=response_format, logit_bias=bias)["message"]["content"]
        found = json.loads(content)
        ipaddress.IPv4Address(found["ip"])
        datetime.date.fromisoformat(found["day"])
        datetime.datetime.fromisoformat(found["at"])
        assert re.fullmatch(code, found["code"]), found
        leaning = found["day"].startswith("000" if digit == "0" else "1")
        assert found["ip"].startswith(digit) and leaning, found


def test_media_ids_and_cache_salts_keep_their_answers(server: Server) -> None:
    image = make_image(975)
    parts = user_message("Record the picture.", image)["content"]
    parts[0]["uuid"] = "structured-975"
    first = answer(server, messages=[{"role": "user", "content": parts}], **COMPACT)
    parts[0]["image_url"] = None  # the media id alone
    by_id = answer(server, messages=[{"role": "user", "content": parts}], **COMPACT)
    assert by_id["message"] == first["message"]
    salted = answer(
        server, messages=[user_message("Record the picture.", image)], cache_salt="other", **COMPACT
    )
    assert salted["message"] == first["message"]
    jsonschema.validate(json.loads(first["message"]["content"]), RECORD)


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"structured_outputs": {"json": {"type": "strnig"}}}, "structured_outputs.json.type", None),
        (
            {"structured_outputs": {"json": {"type": "string", "pattern": "(unclosed"}}},
            "structured_outputs.json.pattern",
            None,
        ),
        (
            {"structured_outputs": {"json": {"type": "string", "pattern": "(a)\\1"}}},
            "structured_outputs.json",
            "invalid_constraint",
        ),
        ({"structured_outputs": {"regex": "a(?=b)b"}}, "structured_outputs.regex", None),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"minLength": "3"}},
                }
            },
            "response_format.json_schema.schema.minLength",
            None,
        ),
        (
            {"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}},
            "structured_outputs.json.uniqueItems",
            None,
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "invalid_constraint"),
        (
            {"structured_outputs": {"grammar": 'root ::= "a" |'}},
            "structured_outputs.grammar",
            "invalid_constraint",
        ),
        (
            {"structured_outputs": {"grammar": "start ::= [a-z]"}},
            "structured_outputs.grammar",
            "invalid_constraint",
        ),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", None),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "missing",
        ),
        ({"structured_outputs": {"regex": "a" * 70000}}, "structured_outputs.regex", None),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", None),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs.regex",
            None,
        ),
        (
            {"structured_outputs": {"whitespace_pattern": "[ ]"}},
            "structured_outputs.whitespace_pattern",
            "invalid_value",
        ),
        ({"guided_json": {"type": "object"}}, "guided_json", "invalid_value"),
    ],
)
def test_each_bad_constraint_is_a_400_naming_its_field(
    server: Server, fields: dict[str, Any], param: str, code: str | None
) -> None:
    resp = chat(server, **fields)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error"), error
    if code is not None:
        assert error["code"] == code, error


def test_hostile_but_bounded_schemas_compile_and_answer(server: Server) -> None:
    """Deep nesting up to the bound, a large enum and a pathological pattern are served; one level deeper
    is refused."""
    deep: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": 9}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    enum = {"enum": [f"item-{i}" for i in range(4000)]}
    pattern = {"type": "string", "pattern": "^(a|aa|aaa)*(b|bb){1,40}$"}
    for schema in (deep, enum, pattern):
        choice = answer(
            server, structured_outputs={"json": schema, "disable_any_whitespace": True}, max_tokens=300
        )
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    for _ in range(30):
        deep = {"type": "object", "properties": {"a": deep}}
    resp = chat(server, structured_outputs={"json": deep})
    assert resp.status_code == 400 and "deeper than" in resp.json()["error"]["message"]


def test_a_compile_does_not_hold_up_free_text(server: Server) -> None:
    """While a hostile schema compiles (seconds), a free-text request is answered: the compile runs off
    the step loop and its request holds no batch slot."""
    hostile = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    compact = {"json": hostile, "disable_any_whitespace": True}  # (2,000 optional properties: seconds)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(chat, server, structured_outputs=compact, max_tokens=5)
        deadline = time.monotonic() + 60
        while server.metrics()["mmserve_num_requests_awaiting_grammar"] == 0:
            assert time.monotonic() < deadline and not slow.done(), "it never waited for its grammar"
            time.sleep(0.02)
        free = chat(server, max_tokens=4, ignore_eos=True)
        assert free.status_code == 200, free.text
        assert server.metrics()["mmserve_num_requests_awaiting_grammar"] == 1, "the compile ended first"
        assert slow.result().status_code == 200
