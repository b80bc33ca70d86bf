"""What ``mmserve proxy`` (app/proxy/server.py) does with one chat request: find its distinct images and
videos, have encoder instances encode them (which saves each item's encoder output to the shared store
under its content hash), then relay the original request to an LM instance and its answer back.

    client ──POST──▶ proxy ──one request per distinct image or video (concurrent, round-robin)──▶ encoders
                       │        failures are only counted: the LM encodes locally or answers 503
                       └──the original body, unchanged──▶ LM instance ──status + body / SSE──▶ client

Nothing here touches FastAPI's app or the proxy's metrics: the route decides what to count.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from app.api.error_handlers import sse_error_event
from app.api.response_ids import ResponseIdWatch
from app.errors import MMServeError

# An encoder-only instance answers once the items are saved; on an ordinary instance one token is the
# least a request may ask for.
ENCODER_MAX_TOKENS = 1
MEDIA_PART_TYPES = ("image_url", "video_url")  # {"type": t, t: {"url": str, ...}}
# encoder requests of one client request open at once: a request of a thousand images (which the LM
# refuses past its --limit-mm-per-prompt) does not open a thousand connections
MAX_OPEN_ENCODES = 8
FORWARDED_REQUEST_HEADERS = ("authorization", "content-type", "x-request-id")
RELAYED_RESPONSE_HEADERS = ("content-type", "retry-after", "www-authenticate", "x-mmserve-api-process")


class UpstreamUnavailableError(MMServeError):
    """No LM instance answered: connection refused or reset, or it went away mid-answer (503)."""

    http_status = 503
    err_type = "server_error"
    default_code = "upstream_unavailable"


class UpstreamTimeoutError(MMServeError):
    """The LM instance accepted the request but sent nothing for ``--timeout`` seconds (504)."""

    http_status = 504
    err_type = "server_error"
    default_code = "upstream_timeout"


class RoundRobin:
    """The URLs of one role, handed out in turn. Used from the event loop only, so no lock."""

    def __init__(self, urls: Sequence[str]) -> None:
        assert urls, "a role needs at least one URL"  # ProxyConfig validates the user's input
        self.urls = tuple(url.rstrip("/") for url in urls)
        self._next_index = 0

    def next(self) -> str:
        url = self.urls[self._next_index]
        self._next_index = (self._next_index + 1) % len(self.urls)
        return url


def media_parts(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The distinct image and video parts of every message, first appearance first (one per kind and
    URL). Only the shapes mmserve accepts, ``{"type": "image_url", "image_url": {"url": str, ...}}`` and
    the same with ``video_url``, are collected: anything else is the LM's to refuse with the proper 400,
    and encoding it would only fail twice."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    by_url: dict[tuple[str, str], dict[str, Any]] = {}
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):  # a plain string (or nothing) carries no media
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in MEDIA_PART_TYPES:
                continue
            media = part.get(kind)
            url = media.get("url") if isinstance(media, dict) else None
            if isinstance(url, str):
                by_url.setdefault((kind, url), part)
    return list(by_url.values())


# The request fields the content hash the LM instance looks an output up by depends on, besides the
# part itself (docs/architecture.md, "Cache salts and media ids"): the processor options and the salt.
HASHED_REQUEST_FIELDS = ("mm_processor_kwargs", "cache_salt")


def encoder_body(body: Mapping[str, Any], part: Mapping[str, Any]) -> dict[str, Any]:
    """The encoder request for one image or video part. It keeps the original ``model`` and
    ``HASHED_REQUEST_FIELDS``, which go into the content hash the LM instance looks the output up by;
    the text does not, so a bare user turn with the one image is enough."""
    request: dict[str, Any] = {
        "model": body.get("model"),
        "messages": [{"role": "user", "content": [dict(part)]}],
        "max_tokens": ENCODER_MAX_TOKENS,
    }
    for field in HASHED_REQUEST_FIELDS:
        if body.get(field) is not None:
            request[field] = body[field]
    return request


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client headers an upstream needs: its API key, the body's content type, the request's id."""
    return {name: headers[name] for name in FORWARDED_REQUEST_HEADERS if name in headers}


def describe(exc: BaseException) -> str:
    """A short reason for logs and error messages (httpx's own messages are sometimes empty)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


@dataclass(frozen=True)
class EncoderOutcome:
    """How one item's encoder request ended; ``error`` is None when the encoder answered 2xx."""

    encoder_url: str
    error: str | None


async def encode_media(
    client: httpx.AsyncClient,
    encoders: RoundRobin,
    body: Mapping[str, Any],
    parts: Sequence[Mapping[str, Any]],
    headers: Mapping[str, str],
    timeout_s: float,
) -> list[EncoderOutcome]:
    """Called before the request goes to an LM instance; returns once every encoder request ended, each
    at most ``timeout_s`` after it opened (``MAX_OPEN_ENCODES`` at once). Never raises for an encoder's
    failure (each is an outcome); cancelling the caller cancels the encoder requests still open."""
    open_slots = asyncio.Semaphore(MAX_OPEN_ENCODES)

    async def one(part: Mapping[str, Any]) -> EncoderOutcome:
        async with open_slots:
            return await _encode_one(client, encoders.next(), encoder_body(body, part), headers, timeout_s)

    return list(await asyncio.gather(*(one(part) for part in parts)))


async def _encode_one(
    client: httpx.AsyncClient,
    encoder_url: str,
    request: dict[str, Any],
    headers: Mapping[str, str],
    timeout_s: float,
) -> EncoderOutcome:
    try:
        async with asyncio.timeout(timeout_s):  # httpx's timeouts bound each read, not the whole call
            resp = await client.post(f"{encoder_url}/v1/chat/completions", json=request, headers=headers)
    except TimeoutError:
        return EncoderOutcome(encoder_url, f"no answer within {timeout_s:g}s")
    except httpx.HTTPError as exc:
        return EncoderOutcome(encoder_url, describe(exc))
    if not resp.is_success:
        return EncoderOutcome(encoder_url, f"HTTP {resp.status_code}: {resp.text[:300]}")
    return EncoderOutcome(encoder_url, None)


async def open_upstream(
    client: httpx.AsyncClient, method: str, url: str, *, content: bytes | None, headers: Mapping[str, str]
) -> httpx.Response:
    """Sends a request to an LM instance and returns once its status and headers arrived; the body is
    left to ``relay``, which closes the response. Connection failures raise ``UpstreamUnavailableError``,
    an upstream silent past the read timeout ``UpstreamTimeoutError``."""
    request = client.build_request(method, url, content=content, headers=headers)
    try:
        return await client.send(request, stream=True)
    except (httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        raise UpstreamUnavailableError(f"The LM instance {url} is unreachable ({describe(exc)}).") from exc
    except httpx.TimeoutException as exc:
        raise UpstreamTimeoutError(f"The LM instance {url} did not answer in time.") from exc
    except httpx.ConnectError as exc:
        raise UpstreamUnavailableError(f"The LM instance {url} is unreachable ({describe(exc)}).") from exc
    except httpx.HTTPError as exc:  # connected, then the connection closed (the instance went away)
        raise UpstreamUnavailableError(
            f"The LM instance {url} closed the connection without answering ({describe(exc)})."
        ) from exc


async def relay(
    upstream: httpx.Response,
    on_stream_error: Callable[[BaseException], None],
    learn_id: Callable[[str], None] | None = None,
) -> Response:
    """The client's response for an opened upstream response: same status and body. An SSE answer is
    passed through chunk by chunk as it arrives; anything else is read whole first. Either way the
    upstream response is closed: closing it mid-stream drops the connection, which makes the LM
    instance abort the request. ``on_stream_error``: called when the upstream fails after the
    client's response started (the status was sent; an SSE error event ends the stream). ``learn_id``:
    told the response id of a Responses API answer that succeeded, streamed or not."""
    if not 100 <= upstream.status_code < 600:  # uvicorn cannot send it: the client would get no answer
        await upstream.aclose()
        raise UpstreamUnavailableError(f"The LM instance answered with HTTP status {upstream.status_code}.")
    headers = {name: upstream.headers[name] for name in RELAYED_RESPONSE_HEADERS if name in upstream.headers}
    streamed = upstream.headers.get("content-type", "").startswith("text/event-stream")
    watch = ResponseIdWatch(learn_id, streamed) if learn_id is not None and upstream.is_success else None
    if streamed:
        return StreamingResponse(
            _pass_through(upstream, on_stream_error, watch),
            status_code=upstream.status_code,
            headers=headers,
            # the generator's own ``finally`` does not run when the client left while a chunk was
            # being sent (Starlette cancels the send, not the generator); this does
            background=BackgroundTask(upstream.aclose),
        )
    try:
        content = await upstream.aread()
    except httpx.TimeoutException as exc:
        raise UpstreamTimeoutError(f"The LM instance {upstream.url} did not answer in time.") from exc
    except httpx.HTTPError as exc:
        raise UpstreamUnavailableError(f"The LM instance failed mid-answer ({describe(exc)}).") from exc
    finally:
        await upstream.aclose()
    if watch is not None:
        watch.feed(content)
        watch.finish()
    return Response(content, status_code=upstream.status_code, headers=headers)


async def _pass_through(
    upstream: httpx.Response, on_error: Callable[[BaseException], None], watch: ResponseIdWatch | None
) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.aiter_bytes():  # decoded: Content-Encoding is not relayed
            if watch is not None:
                watch.feed(chunk)
            yield chunk
    except httpx.HTTPError as exc:
        on_error(exc)
        error = UpstreamUnavailableError(f"The LM instance failed mid-stream ({describe(exc)}).")
        yield sse_error_event(error).encode()
    finally:
        # Cancelled by a client disconnect, the close must still run to its end.
        with anyio.CancelScope(shield=True):
            await upstream.aclose()
