"""Request bodies are strict JSON (app/api/json_body.py): what the standard library lets through and no
later step can handle is the same 400 ``invalid_json`` as a syntax error, through a real route."""

from __future__ import annotations

import json

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from app.api.error_handlers import install_error_handlers
from app.api.json_body import StrictJSONRoute, decode_json
from app.api.schemas import ChatCompletionRequest

JSON = {"content-type": "application/json"}
LONE = b"\\ud800"


def test_strict_json_decodes_what_json_decodes() -> None:
    body = '{"a": [1, 2.5, "\\ud83d\\ude00 \\u00e9", {"b": null}], "c": true, "big": 18446744073709551616}'
    assert decode_json(body.encode()) == json.loads(body)  # a surrogate pair is one character


@pytest.mark.parametrize(
    ("body", "reason", "position"),
    [
        (b'{"t": "a\\ud800b"}', "lone UTF-16 surrogate", 8),  # a high surrogate without its low half
        (b'{"t": "\\udc00"}', "surrogate", None),  # a low one alone
        (b'{"t": NaN}', "invalid character", 6),
        (b'{"t": Infinity}', "invalid character", 6),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply", 0),
        (b'{"t": "\xff"}', "not UTF-8", 7),
        (b'{"t": 1} x', "trailing characters", 10),
        # a pair is no lone surrogate, whatever else is wrong in the body
        (b'{"t": "\\ud83d\\ude00", "n": 1e400}', "out of range", 27),
        (b'{"t": "1e99 -2", "n": [0, -1.5e309]}', "out of range", 26),  # (a number that fits is passed by)
        (b'{"t": "\\ud83d\\ude00", "u": "\\ud83d"}', "lone UTF-16 surrogate", 28),
        (b'{"t": "\\ud83d\\ude00", "u": [', "truncated", 0),
    ],
)
def test_what_strict_json_refuses(body: bytes, reason: str, position: int | None) -> None:
    with pytest.raises(json.JSONDecodeError) as refused:
        decode_json(body)
    assert reason in refused.value.msg
    if position is not None:
        assert refused.value.pos == position


def test_a_route_answers_the_400_envelope_naming_the_byte() -> None:
    app = FastAPI()
    install_error_handlers(app)
    router = APIRouter(route_class=StrictJSONRoute)

    @router.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> dict[str, str]:
        return {"content": str(body.messages[0].content)}

    app.include_router(router)
    client = TestClient(app)
    good = b'{"model": "m", "messages": [{"role": "user", "content": "\\u00e9\\ud83d\\ude00"}]}'
    assert client.post("/v1/chat/completions", content=good, headers=JSON).json() == {"content": "é😀"}
    bad = good.replace(b"\\ud83d\\ude00", LONE)  # tokenizers and answers could not encode it
    answer = client.post("/v1/chat/completions", content=bad, headers=JSON)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "invalid_json" and error["type"] == "invalid_request_error"
    assert "surrogate" in error["message"] and f"position {bad.index(LONE)}" in error["message"]


def test_every_route_of_the_api_reads_strict_json() -> None:
    """A router added without ``StrictJSONRoute`` would read bodies with the standard library again."""
    from fastapi.routing import APIRoute

    from app.api.server import ROUTERS

    routes = [route for router in ROUTERS for route in router.routes]
    assert routes and all(
        isinstance(route, StrictJSONRoute) for route in routes if isinstance(route, APIRoute)
    )
