"""Every error leaves the API as an OpenAI envelope with the right status."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from app.api.error_handlers import error_response, format_loc, install_error_handlers, sse_error_event
from app.api.openapi_errors import document_error_envelope
from app.api.schemas import ChatCompletionRequest
from app.errors import ContextLengthError, EngineUnavailableError, MediaError, ModelNotFoundError
from tests.e2e.server import free_port
from wire.protocol import ErrorInfo

JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> dict[str, str]:
        errors = {
            "missing": ModelNotFoundError("The model `missing` does not exist."),
            "long": ContextLengthError("too long"),
            "badimg": MediaError("The image could not be decoded.", param="messages[0].content[0]"),
            "down": EngineUnavailableError("The engine is not ready."),
        }
        if body.model in errors:
            raise errors[body.model]
        if body.model == "boom":
            raise RuntimeError("secret internals")
        return {"ok": body.model}

    # Starlette re-raises unhandled errors after answering; the client must not turn them into exceptions.
    return TestClient(app, raise_server_exceptions=False)


def _envelope(response: Any) -> dict[str, object]:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _post(client: TestClient, body: object) -> Any:
    return client.post("/v1/chat/completions", content=json.dumps(body), headers=JSON)


def test_valid_request_passes(client: TestClient) -> None:
    response = _post(client, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200 and response.json() == {"ok": "tiny"}


def test_malformed_json_is_400(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [', headers=JSON)
    assert response.status_code == 400
    error = _envelope(response)
    assert "is not valid JSON" in str(error["message"])
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json"


def test_schema_error_is_400_with_param(client: TestClient) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    response = _post(client, body)
    assert response.status_code == 400
    error = _envelope(response)
    assert error["param"] == "messages[0].content[0].image_url"
    assert error["type"] == "invalid_request_error" and error["code"] == "missing"


def test_invalid_value_names_the_field(client: TestClient) -> None:
    response = _post(client, {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 17})
    assert response.status_code == 400
    error = _envelope(response)
    assert error["param"] == "n" and error["code"] == "invalid_value"
    assert "less than or equal to 16" in str(error["message"])


def test_a_refused_field_is_named(client: TestClient) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "use_beam_search": True}
    response = _post(client, body)
    assert response.status_code == 400
    error = _envelope(response)
    assert error["param"] == "use_beam_search" and error["code"] == "invalid_value"
    assert "beam search is not supported" in str(error["message"])


@pytest.mark.parametrize(
    ("tool_choice", "param", "code"),
    [
        ({"type": "function"}, "tool_choice.function", "missing"),
        ({"type": "function", "function": {}}, "tool_choice.function.name", "missing"),
        (
            {"type": "allowed_tools", "allowed_tools": {"mode": "auto"}},
            "tool_choice.allowed_tools.tools",
            "missing",
        ),
        ({"type": "web_search"}, "tool_choice", "invalid_value"),
        ("sometimes", "tool_choice", "invalid_value"),
    ],
)
def test_a_tool_choice_error_names_the_field_of_the_kind_it_was_meant_as(
    client: TestClient, tool_choice: object, param: str, code: str
) -> None:
    """Only the member a value is meant as validates it (an object by its ``type``), so a named function
    without its name is not told to be one of the modes."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": tools}
    response = _post(client, {**body, "tool_choice": tool_choice})
    assert response.status_code == 400
    error = _envelope(response)
    assert (error["param"], error["code"]) == (param, code), error


@pytest.mark.parametrize("body", [[1, 2], "text"])
def test_non_object_body_is_400(client: TestClient, body: object) -> None:
    response = _post(client, body)
    assert response.status_code == 400
    assert _envelope(response)["param"] is None


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_not_sent_as_json_says_so(client: TestClient, content_type: str | None) -> None:
    """A JSON object sent with another content type (curl -d sends a form): the message names the
    content type, not the body, which is fine."""
    headers = {"Content-Type": content_type} if content_type else {}
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}'
    response = client.post("/v1/chat/completions", content=body, headers=headers)
    assert response.status_code == 400
    error = _envelope(response)
    assert error["code"] == "invalid_content_type" and error["param"] is None
    assert "Content-Type: application/json" in str(error["message"])
    assert _post(client, [1, 2]).json()["error"]["code"] != "invalid_content_type"  # JSON, not an object


@pytest.mark.parametrize(
    ("model", "status", "code", "err_type"),
    [
        ("missing", 404, "model_not_found", "invalid_request_error"),
        ("long", 400, "context_length_exceeded", "invalid_request_error"),
        ("badimg", 400, "invalid_image", "invalid_request_error"),
        ("down", 503, "engine_unavailable", "server_error"),
    ],
)
def test_mmserve_errors_keep_their_status(
    client: TestClient, model: str, status: int, code: str | None, err_type: str
) -> None:
    response = _post(client, {"model": model, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == status
    error = _envelope(response)
    assert (error["code"], error["type"]) == (code, err_type)


def test_unknown_route_and_method(client: TestClient) -> None:
    response = client.get("/v1/nope")
    assert response.status_code == 404
    assert "/v1/nope" in str(_envelope(response)["message"])
    response = client.get("/v1/chat/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    _envelope(response)


def test_unhandled_error_is_500_envelope(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="mmserve.api"):
        response = _post(client, {"model": "boom", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 500
    error = _envelope(response)
    assert error["type"] == "server_error"
    assert "secret internals" not in str(error["message"])
    assert any(record.exc_info for record in caplog.records)


def test_error_response_from_engine_error_info() -> None:
    response = error_response(ErrorInfo(message="prompt too long", code="context_length_exceeded"))
    assert response.status_code == 400
    assert json.loads(bytes(response.body))["error"]["code"] == "context_length_exceeded"


def test_sse_error_event() -> None:
    event = sse_error_event(EngineUnavailableError("The engine died."))
    assert event.startswith("data: ") and event.endswith("\n\n")
    error = json.loads(event.removeprefix("data: "))["error"]
    assert error == {
        "message": "The engine died.",
        "type": "server_error",
        "param": None,
        "code": "engine_unavailable",
    }


def test_format_loc() -> None:
    assert format_loc(("body", "messages", 0, "content", 1, "image_url", "url")) == (
        "messages[0].content[1].image_url.url"
    )
    assert format_loc(("body",)) is None
    assert format_loc(("query", "limit")) == "limit"  # a query or path parameter by its name, as OpenAI
    assert format_loc(("path", "response_id")) == "response_id"
    # pydantic's tags for a union's members are no fields
    assert format_loc(("body", "tool_choice", "literal['none','auto','required']")) == "tool_choice"
    assert format_loc(("body", "tool_choice", "NamedToolChoice", "function")) == "tool_choice.function"
    assert format_loc(("body", "structured_outputs", "json", "dict[str,any]")) == "structured_outputs.json"
    assert format_loc(("body", "input", 0, "content", "str")) == "input[0].content"


def test_openapi_documents_validation_errors_as_the_400_envelope(client: TestClient) -> None:
    app = client.app
    assert isinstance(app, FastAPI)
    document_error_envelope(app)
    schema = client.get("/openapi.json").json()
    responses = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in responses
    ref = responses["400"]["content"]["application/json"]["schema"]["$ref"]
    envelope = schema["components"]["schemas"][ref.rsplit("/", 1)[-1]]
    detail_ref = envelope["properties"]["error"]["$ref"]
    detail = schema["components"]["schemas"][detail_ref.rsplit("/", 1)[-1]]
    assert set(detail["properties"]) == {"message", "type", "param", "code"}
    # and that is what the server answers
    body = client.post("/v1/chat/completions", content=b"{}", headers=JSON)
    assert body.status_code == 400 and set(body.json()["error"]) == set(detail["properties"])


def test_after_an_unexpected_500_the_connection_serves_the_next_request() -> None:
    """Answered inside the app, the 500 leaves the server nothing to re-raise: it keeps the keep-alive
    connection, and the client's next request on it is served (Starlette's own 500 would be followed
    by the connection's close, and that request lost)."""
    app = FastAPI()
    install_error_handlers(app)
    peers: list[object] = []

    @app.post("/work")
    async def work(request: Request) -> dict[str, str]:
        peers.append(request.client)
        if (await request.body()) == b"boom":
            raise RuntimeError("secret internals")
        return {"ok": "yes"}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            for _ in range(100):
                with contextlib.suppress(httpx.TransportError):
                    if http.post("/work", content=b"hello").status_code == 200:
                        break
                time.sleep(0.05)
            failed = http.post("/work", content=b"boom")
            assert failed.status_code == 500
            assert _envelope(failed)["message"] == "Internal server error (RuntimeError)."
            assert http.post("/work", content=b"again").json() == {"ok": "yes"}
        assert len(set(map(str, peers[-3:]))) == 1  # one connection carried all three
    finally:
        server.should_exit = True
        thread.join(10)
