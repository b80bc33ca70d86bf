"""``mmserve_http_requests_total{route,status}``: the outermost middleware counts every response, the
request guards' refusals and unexpected exceptions included, a route with parameters under its template
and unknown paths under one label value, a stream whose client left under 499; the chat route's
statuses are exported at 0 before the first request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.responses import StreamingResponse
from starlette.routing import Route

from app.api.asgi_types import Message, Receive, Scope, Send
from app.api.http_metrics import OTHER_ROUTE, HttpMetrics
from app.api.request_guards import RequestGuards
from app.metrics import CHAT_ROUTE, CHAT_STATUSES, ApiMetrics
from tests.e2e.metrics import parse_metrics


def _app(metrics: ApiMetrics) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def listing() -> dict[str, str]:
        return {"object": "list"}

    @app.get("/v1/models/{model}")
    async def card(model: str) -> dict[str, str]:
        return {"id": model}

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    app.add_middleware(RequestGuards, api_key="k", max_body_bytes=10)
    app.add_middleware(HttpMetrics, routes=[route for route in app.routes if isinstance(route, Route)])
    app.state.mmserve = SimpleNamespace(metrics=metrics)
    return app


def test_every_response_is_counted_by_route_and_status() -> None:
    metrics = ApiMetrics()
    client = TestClient(_app(metrics), raise_server_exceptions=False)
    auth = {"Authorization": "Bearer k"}
    assert client.get("/v1/models", headers=auth).status_code == 200
    assert client.get("/v1/models", headers=auth).status_code == 200
    assert client.get("/v1/models").status_code == 401  # refused by the guard, before any route
    assert client.get("/boom").status_code == 500
    assert client.get("/v1/models/a", headers=auth).status_code == 200  # counted by the template
    assert client.get("/v1/models/b", headers=auth).status_code == 200
    assert client.delete("/v1/models/b", headers=auth).status_code == 405
    assert client.get("/nowhere/1").status_code == 404
    assert client.get("/nowhere/2").status_code == 404

    samples = parse_metrics(metrics.render().decode())
    counted = {
        name: value for name, value in samples.items() if name.startswith("mmserve_http_requests") and value
    }
    assert counted == {
        'mmserve_http_requests_total{route="/v1/models",status="200"}': 2.0,
        'mmserve_http_requests_total{route="/v1/models",status="401"}': 1.0,
        'mmserve_http_requests_total{route="/boom",status="500"}': 1.0,
        'mmserve_http_requests_total{route="/v1/models/{model}",status="200"}': 2.0,
        'mmserve_http_requests_total{route="/v1/models/{model}",status="405"}': 1.0,
        f'mmserve_http_requests_total{{route="{OTHER_ROUTE}",status="404"}}': 2.0,
    }


def test_the_chat_routes_statuses_start_at_zero() -> None:
    """A series born with its first increment shows no rate() for it: each status is there before."""
    samples = parse_metrics(ApiMetrics().render().decode())
    for status in CHAT_STATUSES:
        assert samples[f'mmserve_http_requests_total{{route="{CHAT_ROUTE}",status="{status}"}}'] == 0.0
    assert samples['mmserve_request_success_total{finish_reason="length"}'] == 0.0


def _streamed(metrics: ApiMetrics, client_leaves: bool) -> str:
    """The status a streamed answer counts under, its client leaving after the first event or not."""
    first = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        await asyncio.sleep(0.2)
        yield b"data: 2\n\n"

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await StreamingResponse(events(), media_type="text/event-stream")(scope, receive, send)

    async def receive() -> Message:
        await first.wait()
        if not client_leaves:
            await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message.get("body"):
            first.set()

    app_state = SimpleNamespace(state=SimpleNamespace(mmserve=SimpleNamespace(metrics=metrics)))
    scope = {"type": "http", "path": "/s", "method": "GET", "headers": [], "app": app_state}
    asyncio.run(HttpMetrics(app, routes=[Route("/s", endpoint=lambda _: None)])(scope, receive, send))
    counted = parse_metrics(metrics.render().decode())
    return next(name for name, value in counted.items() if 'route="/s"' in name and value)


def test_a_stream_its_client_left_counts_as_a_499() -> None:
    assert _streamed(ApiMetrics(), client_leaves=True).endswith('status="499"}')
    assert _streamed(ApiMetrics(), client_leaves=False).endswith('status="200"}')
