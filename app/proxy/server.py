"""``mmserve proxy``: the HTTP front of an encoder / LM split ("EPD"). Encoder instances
(``serve --encoder-only --ec-role producer``) encode a request's images and videos and save the outputs
to the shared store; LM instances (``serve --ec-role consumer``) load them instead of encoding. The proxy
sends each distinct image or video to an encoder first, then the original request to an LM instance, and
relays the answer (app/proxy/forward.py has the diagram).

Routes: ``POST /v1/chat/completions``; ``POST /v1/completions`` (a prompt has no media: straight to an
LM); ``POST /v1/responses`` and what reads a stored response (app/proxy/
responses.py); ``GET /v1/models`` and ``/v1/models/{model}`` (an LM's answer),
``GET /health`` (every upstream's ``/health``), ``GET /metrics`` (the proxy's own figures). Errors use the
OpenAI envelope.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from app.api.disconnect import CLIENT_CLOSED_REQUEST, ClientLeft, unless_client_leaves
from app.api.error_handlers import install_error_handlers
from app.api.json_body import decode_json
from app.api.request_guards import RequestGuards
from app.api.response_ids import followed_responses
from app.api.responses_api_schemas import ResponsesRequest
from app.api.schemas import ChatCompletionRequest
from app.errors import MMServeError
from app.proxy.cli import ProxyConfig
from app.proxy.forward import (
    RoundRobin,
    describe,
    encode_media,
    forwarded_headers,
    media_parts,
    open_upstream,
    relay,
)
from app.proxy.responses import ResponseHolders, responses_media_parts

log = logging.getLogger("mmserve.proxy")

ENCODER_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# A body this large is parsed on a thread, so the streams relayed meanwhile do not stall.
PARSE_IN_THREAD_BYTES = 1 << 20


class ProxyMetrics:
    """The proxy's own figures, in a registry of its own (one per app, so tests can build several)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "mmserve_proxy_requests", "Chat-completion and Responses requests received.", registry=r
        )
        self.encoder_requests = Counter(
            "mmserve_proxy_encoder_requests",
            "Requests sent to encoder instances (one per image or video).",
            registry=r,
        )
        self.encoder_failures = Counter(
            "mmserve_proxy_encoder_failures",
            "Encoder requests that failed (connection error, timeout, non-2xx); the LM then encodes.",
            registry=r,
        )
        self.upstream_errors = Counter(
            "mmserve_proxy_upstream_errors",
            "LM-instance requests that failed: unreachable, timed out, or cut off mid-answer.",
            registry=r,
        )
        self.encoder_seconds = Histogram(
            "mmserve_proxy_encoder_seconds",
            "Encoder round trip of one request's images and videos (requests with media only).",
            buckets=ENCODER_SECONDS_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


def create_proxy_app(config: ProxyConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The proxy's app; its lifespan owns the one ``httpx.AsyncClient`` every upstream call shares.
    ``transport``: where that client sends (tests pass fake upstreams; None: the network)."""
    metrics = ProxyMetrics()
    encoders, lms = RoundRobin(config.encoder_urls), RoundRobin(config.lm_urls)
    holders = ResponseHolders()
    clients: list[httpx.AsyncClient] = []  # the lifespan's one client: nothing opens before the app starts

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Connect fails fast so a down LM is a quick 503; reads may wait as long as a generation does.
        timeout = httpx.Timeout(config.timeout_s, connect=min(config.timeout_s, 10.0))
        # No pool cap: each relayed stream holds a connection for its whole answer. No proxies from
        # the environment: upstreams are addressed directly.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=100)
        client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False, transport=transport)
        async with client:
            clients.append(client)
            try:
                yield
            finally:
                clients.clear()

    app = FastAPI(title="mmserve proxy", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(RequestGuards, api_key=None, max_body_bytes=config.max_request_body_bytes)

    def upstream_failed(exc: BaseException) -> None:
        metrics.upstream_errors.inc()
        log.warning("LM instance failed mid-stream: %s", describe(exc))

    async def encode(body: dict[str, Any], parts: list[dict[str, Any]], headers: dict[str, str]) -> None:
        """Each of ``parts`` (a valid request's distinct images and videos) to an encoder instance."""
        metrics.encoder_requests.inc(len(parts))
        start = time.perf_counter()
        outcomes = await encode_media(clients[0], encoders, body, parts, headers, config.timeout_s)
        metrics.encoder_seconds.observe(time.perf_counter() - start)
        for outcome in outcomes:
            if outcome.error is not None:
                metrics.encoder_failures.inc()
                log.warning("encoder %s failed; the LM will encode: %s", outcome.encoder_url, outcome.error)

    async def forward(
        method: str,
        lm_url: str,
        path: str,
        raw: bytes | None,
        headers: dict[str, str],
        learn_id: Callable[[str], None] | None = None,
    ) -> Response:
        try:
            upstream = await open_upstream(
                clients[0], method, f"{lm_url}{path}", content=raw, headers=headers
            )
            return await relay(upstream, upstream_failed, learn_id)
        except Exception:
            metrics.upstream_errors.inc()
            raise

    async def holder(response_ids: list[str], headers: dict[str, str]) -> str:
        """The LM instance holding the first of ``response_ids`` it finds, else the next in turn."""
        for response_id in response_ids:
            found = await holders.find(clients[0], lms.urls, response_id, headers, config.health_timeout_s)
            if found is not None:
                return found
        return lms.next()

    async def encoded(
        raw: bytes,
        headers: dict[str, str],
        parts_of: Callable[[dict[str, Any]], list[dict[str, Any]]],
        schema: type[BaseModel],
    ) -> dict[str, Any] | None:
        """The body, once its distinct images and videos (``parts_of``) went to encoder instances:
        checked (``schema``) only where there are some, so a text-only request goes on as it is."""
        body = await _parse(raw)
        parts = parts_of(body) if body is not None else []
        if body is not None and parts and await _valid(schema, body, len(raw)):
            await encode(body, parts, headers)
        return body

    async def chat(raw: bytes, headers: dict[str, str]) -> Response:
        await encoded(raw, headers, media_parts, ChatCompletionRequest)
        return await forward("POST", lms.next(), "/v1/chat/completions", raw, headers)

    async def respond(raw: bytes, headers: dict[str, str]) -> Response:
        body = await encoded(raw, headers, responses_media_parts, ResponsesRequest)
        lm_url = await holder(followed_responses(body), headers)
        return await forward(
            "POST", lm_url, "/v1/responses", raw, headers, lambda made: holders.learn(made, lm_url)
        )

    async def body_of(request: Request) -> bytes | Response:
        try:
            return await request.body()  # RequestGuards refuses it with 413 past the cap
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def complete(raw: bytes, headers: dict[str, str]) -> Response:
        return await forward("POST", lms.next(), "/v1/completions", raw, headers)  # (no media to encode)

    works = {"/v1/chat/completions": chat, "/v1/completions": complete, "/v1/responses": respond}

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    @app.post("/v1/responses")
    async def generate(request: Request) -> Response:
        metrics.requests.inc()
        raw = await body_of(request)
        if isinstance(raw, Response):
            return raw
        work = works[request.url.path]
        return await _unless_client_leaves(request, work(raw, forwarded_headers(request.headers)))

    @app.post("/v1/responses/input_tokens")
    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    @app.get("/v1/responses/{response_id}/input_items")
    @app.post("/v1/responses/{response_id}/cancel")
    async def stored_responses(request: Request) -> Response:
        """What reads a stored response goes to the LM instance that holds it (its id in the path, or
        the responses an ``input_tokens`` body follows)."""
        raw = await body_of(request)
        if isinstance(raw, Response):
            return raw
        headers = forwarded_headers(request.headers)
        response_id = request.path_params.get("response_id")
        followed = [response_id] if response_id is not None else followed_responses(await _parse(raw))
        path = request.scope["raw_path"].decode() + (f"?{request.url.query}" if request.url.query else "")
        work = forward(request.method, await holder(followed, headers), path, raw or None, headers)
        return await _unless_client_leaves(request, work)

    @app.get("/v1/models")
    @app.get("/v1/models/{model:path}")
    async def models(request: Request) -> Response:
        """An LM instance's answer: the list, or one model's card (``models.retrieve``)."""
        path = request.scope["raw_path"].decode()
        return await forward("GET", lms.next(), path, None, forwarded_headers(request.headers))

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    async def health() -> JSONResponse:
        """200 when every LM and encoder instance answers its own ``/health`` with 200; else 503 with
        the ones that did not, so an orchestrator knows which to look at."""
        roles = [("lm", url) for url in lms.urls] + [("encoder", url) for url in encoders.urls]
        reasons = await asyncio.gather(
            *(_probe(clients[0], url, config.health_timeout_s) for _, url in roles)
        )
        down = [
            {"role": role, "url": url, "reason": reason}
            for (role, url), reason in zip(roles, reasons, strict=True)
            if reason is not None
        ]
        if down:
            return JSONResponse({"status": "upstream down", "down": down}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _valid(schema: type[BaseModel], body: dict[str, Any], size: int) -> bool:
    """Whether the body is a request as the LM's API reads it (``schema``). One it refuses goes to the
    LM unencoded: its media would be encoded for nothing, and the LM's 400 is the answer either way."""
    try:
        if size > PARSE_IN_THREAD_BYTES:
            await asyncio.to_thread(schema.model_validate, body)
        else:
            schema.model_validate(body)
    except (ValidationError, ValueError, MMServeError):
        return False
    return True


async def _parse(raw: bytes) -> dict[str, Any] | None:
    """The body as a JSON object (strict JSON, as the API process reads it: app/api/json_body.py), or
    None: what is not one goes to the LM as it is, and the LM answers it with the proper OpenAI error."""
    try:
        body = (
            await asyncio.to_thread(decode_json, raw)
            if len(raw) > PARSE_IN_THREAD_BYTES
            else decode_json(raw)
        )
    except ValueError:  # json.JSONDecodeError
        return None
    return body if isinstance(body, dict) else None


async def _probe(client: httpx.AsyncClient, url: str, timeout_s: float) -> str | None:
    """Why ``url``'s ``/health`` is not a 200, or None when it is."""
    try:
        resp = await client.get(f"{url}/health", timeout=timeout_s)
    except httpx.HTTPError as exc:
        return describe(exc)
    return None if resp.status_code == 200 else f"HTTP {resp.status_code}"


async def _unless_client_leaves(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Runs ``work`` (encoders, then the LM until its answer starts, or until all of it for a non-SSE
    answer), cancelled if the client disconnects meanwhile: the encoder and LM connections close, and the
    LM aborts the request (``ClientLeft``: a 499). Once an SSE answer is being relayed, Starlette's
    StreamingResponse watches."""
    try:
        return await unless_client_leaves(request, work)
    except ClientLeft:
        log.info("client left before the answer; the request was abandoned upstream")
        raise
