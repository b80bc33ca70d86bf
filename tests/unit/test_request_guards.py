"""RequestGuards (API key, body cap) on a minimal app with mmserve's error handlers: refusals come in the
OpenAI envelope before any route runs; open routes stay open; bodies are capped declared or streamed."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI, Request

from app.api.error_handlers import install_error_handlers
from app.api.request_guards import RequestGuards, request_tenant, tenant_of
from app.settings import Settings

KEY = "sk-test-123"
CAP = 1000


def make_app(api_key: str | None) -> tuple[FastAPI, list[int]]:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(RequestGuards, api_key=api_key, max_body_bytes=CAP)
    seen: list[int] = []  # body sizes the route got to read

    @app.post("/v1/echo")
    async def echo(request: Request) -> dict[str, int]:
        body = await request.body()
        seen.append(len(body))
        return {"num_bytes": len(body)}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/reset_mm_cache")
    async def reset() -> dict[str, str]:
        return {"status": "ok"}

    return app, seen


def call(app: FastAPI, method: str, path: str, **kwargs: object) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)  # type: ignore[arg-type]

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, "Missing API key"),
        ({"Authorization": "Bearer wrong"}, "Incorrect"),
        ({"Authorization": KEY}, "Incorrect"),
    ],
)
def test_guarded_routes_need_the_key(headers: dict[str, str], message: str) -> None:
    app, seen = make_app(KEY)
    for path in ("/v1/echo", "/reset_mm_cache"):
        resp = call(app, "POST", path, content=b"{}", headers=headers)
        assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
        error = resp.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert message in error["message"] and KEY not in error["message"]
    assert seen == []  # refused before the route read anything


def test_the_right_key_passes_and_open_routes_stay_open() -> None:
    app, seen = make_app(KEY)
    ok = call(app, "POST", "/v1/echo", content=b"abc", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json() == {"num_bytes": 3}
    assert call(app, "GET", "/health").status_code == 200
    assert call(app, "GET", "/nope").status_code == 404  # unknown paths outside /v1 are just 404


def test_without_a_key_nothing_is_guarded() -> None:
    app, _ = make_app(None)
    assert call(app, "POST", "/v1/echo", content=b"abc").status_code == 200


def test_declared_body_over_the_cap_is_refused_unread() -> None:
    app, seen = make_app(None)
    resp = call(app, "POST", "/v1/echo", content=b"x" * (CAP + 1))
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"
    assert "--max-request-body-mb" in resp.json()["error"]["message"]
    assert seen == []
    assert call(app, "POST", "/v1/echo", content=b"x" * CAP).json() == {"num_bytes": CAP}


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate, gzip", " GZIP "])
def test_a_body_with_a_content_encoding_is_refused_unread(encoding: str) -> None:
    """Read as sent, a gzip body would be invalid JSON and a ``br`` one taken for plain bytes: a 415."""
    app, seen = make_app(None)
    resp = call(app, "POST", "/v1/echo", content=gzip.compress(b"{}"), headers={"Content-Encoding": encoding})
    assert resp.status_code == 415 and seen == []
    error = resp.json()["error"]
    assert error["code"] == "unsupported_content_encoding" and error["type"] == "invalid_request_error"
    assert encoding.strip().lower() in error["message"]
    plain = call(app, "POST", "/v1/echo", content=b"{}", headers={"Content-Encoding": "identity"})
    assert plain.json() == {"num_bytes": 2}


def test_streamed_body_over_the_cap_is_cut_off() -> None:
    app, seen = make_app(None)

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield b"x" * 400  # no Content-Length: transfer-encoding chunked

    resp = call(app, "POST", "/v1/echo", content=chunks())
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert seen == []


def test_settings() -> None:
    assert Settings(max_request_body_mb=2).max_request_body_bytes == 2 << 20
    with pytest.raises(ValueError):
        Settings(api_key="")
    with pytest.raises(ValueError):
        Settings(max_request_body_mb=0)


def test_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMSERVE_API_KEY", KEY)
    assert Settings().api_key == [KEY]
    monkeypatch.setenv("MMSERVE_API_KEY", f"{KEY}, sk-other")  # several keys: one tenant each
    assert Settings().api_key == [KEY, "sk-other"]
    monkeypatch.setenv("MMSERVE_API_KEY", f"{KEY},,sk-other")
    with pytest.raises(ValueError):
        Settings()


def test_each_key_is_a_tenant_of_its_own() -> None:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(RequestGuards, api_key=[KEY, "sk-other"], max_body_bytes=CAP)

    @app.post("/v1/tenant")
    async def tenant(request: Request) -> dict[str, str]:
        return {"tenant": request_tenant(request.scope)}

    tenants = [
        call(app, "POST", "/v1/tenant", headers={"Authorization": f"Bearer {key}"}).json()["tenant"]
        for key in (KEY, "sk-other", KEY)
    ]
    assert tenants[0] == tenants[2] == tenant_of(KEY) and tenants[1] == tenant_of("sk-other")
    assert tenants[0] != tenants[1] and KEY not in tenants[0]
    assert call(app, "POST", "/v1/tenant", headers={"Authorization": "Bearer sk-third"}).status_code == 401


def test_the_flag_repeats(tmp_path: object) -> None:
    from app.launch.cli import build_parser, settings_from_args

    args = build_parser().parse_args(["api", "--api-key", KEY, "--api-key", "sk-other"])
    assert settings_from_args(args).api_key == [KEY, "sk-other"]


def asgi_post(app: FastAPI, chunks: list[bytes], then: float) -> tuple[int, bytes, list[str]]:
    """POSTs ``chunks`` as a streamed body to /v1/echo, the last with ``more_body`` unless ``then`` is
    negative; after them the client sends nothing for ``then`` seconds (a stall), then disconnects."""

    async def go() -> tuple[int, bytes, list[str]]:
        pending = [
            {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1 or then >= 0}
            for i, chunk in enumerate(chunks)
        ]
        if then < 0:
            pending[-1]["more_body"] = False
        sent: list[dict[str, object]] = []

        async def receive() -> dict[str, object]:
            if pending:
                return pending.pop(0)
            await asyncio.sleep(abs(then))
            return {"type": "http.disconnect"}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/echo", "raw_path": b"/v1/echo", "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/octet-stream")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
        }  # fmt: skip
        await app(scope, receive, send)
        status = next(int(m["status"]) for m in sent if m["type"] == "http.response.start")  # type: ignore[call-overload]
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")  # type: ignore[misc]
        return status, body, [str(m["type"]) for m in sent]

    return asyncio.run(go())


def guarded_app(body_idle_timeout_s: float) -> FastAPI:
    """An app with the error handlers and ``RequestGuards`` (no key, the body cap ``CAP``)."""
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(
        RequestGuards, api_key=None, max_body_bytes=CAP, body_idle_timeout_s=body_idle_timeout_s
    )
    return app


def test_a_stalled_body_is_a_408_and_a_whole_one_waits_for_the_disconnect() -> None:
    app = guarded_app(0.2)
    after_body: list[str] = []

    @app.post("/v1/echo")
    async def echo(request: Request) -> dict[str, int]:
        body = await request.body()
        after_body.append(str((await request.receive())["type"]))  # as a disconnect watcher does
        return {"num_bytes": len(body)}

    status, body, _ = asgi_post(app, [b"a" * 10, b"b" * 10], then=5.0)  # 10 + 10 bytes, then a stall
    assert status == 408
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "stalled" in error["message"]
    status, body, _ = asgi_post(app, [b"a" * 10, b"b" * 10], then=-0.5)  # whole; a disconnect 0.5 s later
    assert status == 200 and json.loads(body) == {"num_bytes": 20}
    assert after_body == ["http.disconnect"]  # waited past the body timeout: no 408 once it was whole


def test_a_client_that_leaves_before_its_body_is_whole_is_a_bodiless_499() -> None:
    app = guarded_app(5.0)
    routed: list[int] = []

    @app.post("/v1/echo")
    async def echo(request: Request) -> dict[str, int]:
        routed.append(len(await request.body()))
        return {"num_bytes": routed[-1]}

    status, body, _ = asgi_post(app, [b"a" * 10, b"b" * 10], then=0.01)  # 20 bytes of more, then gone
    assert (status, body, routed) == (499, b"", [])  # not a 400 for a body that failed to parse
