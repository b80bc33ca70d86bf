"""Checks every HTTP request passes before any route runs, as one pure ASGI middleware (so nothing is
parsed or buffered first):

    1. auth        with --api-key: /v1/*, /tokenize, /detokenize and /reset_mm_cache need
                   ``Authorization: Bearer <key>`` (compared in constant time with every key);
                   /health, /metrics and the OpenAPI docs stay open. The key's tenant (``tenant_of``)
                   goes into the scope for the routes
    2. body size   a Content-Length over --max-request-body-mb -> 413 without reading the body; a body
                   without one (chunked) is counted as it streams and refused the moment it passes
    3. encoding    a body sent with a Content-Encoding other than identity (gzip, br, ...) -> 415: read
                   as it is, it would be invalid JSON or, worse, taken for plain bytes
    4. body pace   a body that stalls (no bytes for ``BODY_IDLE_TIMEOUT_S``, as nginx's
                   client_body_timeout) -> 408: a stalled upload holds neither its connection nor its
                   partial body for ever

Refusals use the OpenAI error envelope (``app.api.error_handlers``).
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi import HTTPException

from app.api.asgi_types import ASGIApp, Message, Receive, Scope, Send
from app.api.disconnect import CLIENT_CLOSED_REQUEST
from app.api.error_handlers import error_response
from app.errors import AuthenticationError, MMServeError, RequestTooLargeError, UnsupportedMediaTypeError
from wire.hashing import framed_digest

BODY_IDLE_TIMEOUT_S = 60.0
GUARDED_PREFIXES = ("/v1/", "/reset_mm_cache", "/tokenize", "/detokenize")
TENANT_SCOPE_KEY = "mmserve.tenant"  # the request's tenant; absent without API keys
TENANT_DOMAIN = b"mmserve.tenant.v1"


def tenant_of(api_key: str) -> str:
    """A tenant's id: a digest of its API key (the key itself never leaves the guard)."""
    return framed_digest(TENANT_DOMAIN, api_key)[:32]


def request_tenant(scope: Scope) -> str:
    """The tenant ``RequestGuards`` found for this request; "" when the server has no API keys."""
    return str(scope.get(TENANT_SCOPE_KEY, ""))


class RequestGuards:
    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | list[str] | None,
        max_body_bytes: int,
        body_idle_timeout_s: float = BODY_IDLE_TIMEOUT_S,
        guarded: tuple[str, ...] = GUARDED_PREFIXES,
    ) -> None:
        """``guarded``: the path prefixes that need a key (the Ray ingress adds its ``/replicas``)."""
        self.app = app
        self.guarded = guarded
        self.body_idle_timeout_s = body_idle_timeout_s
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        # (expected header, tenant) per key; every key is compared, so timing tells nothing of which
        self.expected = [(f"Bearer {key}".encode(), tenant_of(key)) for key in keys]
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.expected and scope["path"].startswith(self.guarded):
            given = headers.get(b"authorization", b"")
            tenant = None
            for expected, key_tenant in self.expected:
                if hmac.compare_digest(given, expected):
                    tenant = key_tenant
            if tenant is None:
                message = "Missing API key." if not given else "Incorrect API key provided."
                await refuse(
                    AuthenticationError(message + " Send 'Authorization: Bearer <key>'."), scope, send
                )
                return
            scope[TENANT_SCOPE_KEY] = tenant
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await refuse(self._too_large(), scope, send)
            return
        encoding = headers.get(b"content-encoding", b"").strip().lower()
        if encoding not in (b"", b"identity"):
            await refuse(
                UnsupportedMediaTypeError(
                    f"Request bodies are read as sent; Content-Encoding {encoding.decode('latin-1')!r} is "
                    "not supported (send the body uncompressed)."
                ),
                scope,
                send,
            )
            return
        await self.app(scope, self._counting(receive), send)

    def _too_large(self) -> RequestTooLargeError:
        return RequestTooLargeError(
            f"The request body is larger than {self.max_body_bytes} bytes (--max-request-body-mb)."
        )

    def _counting(self, receive: Receive) -> Receive:
        """``receive`` that raises a 413 once the streamed body passes the cap, a 408 when the body
        stalls, and a 499 (``CLIENT_CLOSED_REQUEST``, answered with no body) when the client leaves
        before its body is whole: FastAPI would count that as a 400 for a body it could not parse.
        FastAPI lets only an ``HTTPException`` through its body parsing (anything else becomes a 400),
        and the app's handler turns it into the envelope: the route is still reading, nothing was sent
        yet. Once the body is whole, ``receive`` waits for the disconnect, as long as it takes."""
        num_bytes = 0
        reading = True

        async def counted() -> Message:
            nonlocal num_bytes, reading
            if not reading:
                return await receive()
            try:
                async with asyncio.timeout(self.body_idle_timeout_s):
                    message = await receive()
            except TimeoutError:
                detail = f"The request body stalled: no bytes for {self.body_idle_timeout_s:g} s."
                raise HTTPException(408, detail=detail, headers={"Connection": "close"}) from None
            if message["type"] == "http.disconnect":  # the client left with its body unsent: a 499
                raise HTTPException(
                    CLIENT_CLOSED_REQUEST, detail="The client left before its body was whole."
                )
            reading = message["type"] == "http.request" and message.get("more_body", False)
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_body_bytes:
                    raise HTTPException(413, detail=self._too_large().message)
            return message

        return counted


async def refuse(
    error: MMServeError, scope: Scope, send: Send, headers: dict[str, str] | None = None
) -> None:
    response = error_response(error, headers)
    if isinstance(error, AuthenticationError):
        response.headers["WWW-Authenticate"] = "Bearer"

    async def no_body() -> Message:
        return {"type": "http.disconnect"}

    await response(scope, no_body, send)
