"""Fetching one image URL under the media policy (``app.media.url_policy``), hop by hop::

    url ─▶ check_url ─▶ resolve host ─▶ check_addresses ─▶ GET http(s)://<validated address>/path
     ▲     (scheme,     (injectable     (ALL answers         Host: <name>, TLS SNI + cert: <name>
     │      domains)     resolver)       must be public)          │
     └──────────── 301/302/303/307/308 Location, at most max_redirects ◀┘

The connection goes to the address that was checked, never to a second DNS answer (no rebinding). The
whole fetch, redirects and a slow drip included, has one deadline (``timeout_s``); the body is counted
while it streams, against the image's cap and the request's shared ``RequestImageBudget``.

The fetch runs in a task of its own that is never cancelled: httpcore (1.0.9, its issue #1093) leaves a
connection cancelled before it was established in its pool for good, and enough of them (URLs that never
answer, fetches cancelled when a sibling failed) fill the pool, after which every fetch of the process
times out. At the deadline, or when the request is cancelled, the caller goes on at once and the task is
told to stop: it ends at its next chunk, or by httpx's own timeouts (``timeout_s`` a step), and its
connection goes back to the pool or is closed as httpx does after any error.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import stat
import zlib
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import httpx

from app.errors import MediaError
from app.media.kinds import MediaKind
from app.media.url_policy import IPAddress, MediaPolicy, Target, forbidden

# async resolve(host, port) -> every address the name has; tests inject a fake one.
Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]

REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


async def system_resolver(host: str, port: int) -> list[IPAddress]:
    """The event loop's ``getaddrinfo``: every address, in the resolver's order, without duplicates."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found = (ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos)
    return list(dict.fromkeys(found))


class RequestImageBudget:
    """Encoded image bytes of one request, all images together; shared by its concurrent fetches, which
    add every chunk as it arrives so the request is refused as soon as the sum passes the cap."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0

    def add(self, num_bytes: int) -> None:
        self.num_bytes += num_bytes
        if self.num_bytes > self.max_bytes:
            raise MediaError(
                f"The request's images exceed {self.max_bytes} encoded bytes in all "
                "(--max-request-image-bytes).",
                param="messages",
                code="request_images_too_large",
            )


class MediaFetcher:
    """Fetches http(s) and allowed ``file://`` image URLs; one per API process, built by the lifespan
    with a client that does not follow redirects itself."""

    def __init__(
        self, policy: MediaPolicy, client: httpx.AsyncClient, resolver: Resolver = system_resolver
    ) -> None:
        self.policy = policy
        self.client = client
        self.resolver = resolver

    async def fetch_http(
        self,
        url: str,
        *,
        param: str,
        budget: RequestImageBudget | None = None,
        kind: MediaKind = MediaKind.IMAGE,
    ) -> bytes:
        """The body behind an http(s) URL, after every hop passed the policy; a ``MediaError`` else."""
        timeout_s = self.policy.timeout_s
        stop = asyncio.Event()
        fetching = asyncio.ensure_future(self._follow(url, param, budget, kind, stop))
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(fetching)
        except MediaError:
            raise
        except TimeoutError as exc:
            message = f"Fetching {kind} {url!r} timed out after {timeout_s:g} s."
            raise fetch_failed(message, param, kind) from exc
        except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError, OSError, ValueError) as exc:
            message = f"Fetching {kind} {url!r} failed: {type(exc).__name__}: {exc}"
            raise fetch_failed(message, param, kind) from exc
        finally:
            if not fetching.done():  # (the deadline, or the request cancelled): it stops by itself
                stop.set()
                fetching.add_done_callback(_retrieved)

    async def read_file(
        self,
        url: str,
        *,
        param: str,
        budget: RequestImageBudget | None = None,
        kind: MediaKind = MediaKind.IMAGE,
    ) -> bytes:
        """The bytes of a ``file://`` URL inside the allowed folder (path checks and the read run in a
        thread: both touch the file system)."""
        try:
            async with asyncio.timeout(self.policy.timeout_s):
                data = await asyncio.to_thread(self._read_local, url, param, kind)
        except TimeoutError as exc:
            raise fetch_failed(f"Reading the {kind} file timed out.", param, kind) from exc
        if budget is not None:
            budget.add(len(data))
        return data

    async def _follow(
        self, url: str, param: str, budget: RequestImageBudget | None, kind: MediaKind, stop: asyncio.Event
    ) -> bytes:
        """The fetch, hop by hop; it ends with ``FetchAbandoned`` at its next step once ``stop`` is set."""
        policy = self.policy
        num_redirects = 0
        while True:
            target = policy.check_url(url, param=param, kind=kind)
            addresses = [target.ip] if target.ip is not None else await self._resolve(target, param, kind)
            policy.check_addresses(target, addresses, param=param, kind=kind)
            request = self._request(target, addresses[0])
            _unless_stopped(stop)
            try:
                response = await self.client.send(request, stream=True, follow_redirects=False)
            except httpx.InvalidURL as exc:  # (httpx reads a redirect's Location even when not following it)
                message = f"{kind.noun} URL {url!r} redirected to a URL that is not http(s) ({exc})."
                raise forbidden(message, param, kind) from exc
            try:
                _unless_stopped(stop)
                location = response.headers.get("location")
                if response.status_code not in REDIRECT_STATUSES or location is None:
                    return await self._read_body(response, url, param, budget, kind, stop)
            finally:
                await response.aclose()
            if num_redirects >= policy.max_redirects:
                raise MediaError(
                    f"{kind.noun} URL {url!r} redirected more than {policy.max_redirects} times "
                    "(--max-media-redirects).",
                    param=param,
                    code="too_many_redirects",
                )
            num_redirects += 1
            url = urljoin(url, location)  # relative to the URL as named, never to the address

    async def _resolve(self, target: Target, param: str, kind: MediaKind) -> list[IPAddress]:
        try:
            addresses = await self.resolver(target.host, target.port)
        except OSError as exc:  # socket.gaierror: no such name
            message = f"{kind.noun} URL host {target.host!r} could not be resolved."
            raise fetch_failed(message, param, kind) from exc
        if not addresses:
            raise fetch_failed(f"{kind.noun} URL host {target.host!r} has no addresses.", param, kind)
        return addresses

    def _request(self, target: Target, address: IPAddress) -> httpx.Request:
        """A GET to ``address`` that names the host as the URL did: ``Host`` header and, for https to a
        name, TLS SNI and certificate check (httpcore's ``sni_hostname``)."""
        headers = {"Host": target.host_header, "Accept-Encoding": "identity"}  # bytes as stored
        extensions = {}
        if target.scheme == "https" and target.ip is None:
            extensions["sni_hostname"] = target.host
            # Pooled connections are keyed by address, not name: never reuse one verified for a name.
            headers["Connection"] = "close"
        return self.client.build_request(
            "GET",
            target.url_to(address),
            headers=headers,
            extensions=extensions,
            timeout=self.policy.timeout_s,
        )

    async def _read_body(
        self,
        response: httpx.Response,
        url: str,
        param: str,
        budget: RequestImageBudget | None,
        kind: MediaKind,
        stop: asyncio.Event,
    ) -> bytes:
        if not response.is_success:
            message = f"Fetching {kind} {url!r} failed with HTTP status {response.status_code}."
            raise fetch_failed(message, param, kind)
        max_bytes = self.policy.max_bytes(kind)
        declared = response.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
            raise too_large(f"{kind.noun} at {url!r}", max_bytes, param, kind)
        decoder = _decoder(response.headers.get("content-encoding", ""), url, param, kind)
        chunks: list[bytes] = []
        num_bytes = 0
        async for raw in response.aiter_raw():
            _unless_stopped(stop)
            for chunk in _decoded(decoder, raw, max_bytes + 1 - num_bytes, url, param, kind):
                num_bytes += len(chunk)
                if num_bytes > max_bytes:
                    raise too_large(f"{kind.noun} at {url!r}", max_bytes, param, kind)
                if budget is not None:
                    budget.add(len(chunk))
                chunks.append(chunk)
        if not num_bytes:
            raise MediaError(f"{kind.noun} at {url!r} is empty.", param=param, code=kind.invalid_code)
        return b"".join(chunks)

    def _read_local(self, url: str, param: str, kind: MediaKind) -> bytes:
        path = self.policy.local_file(url, param=param, kind=kind)
        max_bytes = self.policy.max_bytes(kind)
        try:
            data = read_regular_file(path, max_bytes + 1)
        except OSError as exc:
            raise fetch_failed(f"{kind.noun} file could not be read: {exc.strerror}.", param, kind) from exc
        if data is None:
            raise MediaError(
                f"{kind.noun} file refused: not a regular file.", param=param, code=kind.forbidden_code
            )
        if len(data) > max_bytes:
            raise too_large(f"{kind.noun} file", max_bytes, param, kind)
        if not data:
            raise MediaError(f"{kind.noun} file is empty.", param=param, code=kind.invalid_code)
        return data


class FetchAbandoned(Exception):
    """A fetch nobody waits for any more stopped (``MediaFetcher.fetch_http``)."""


def _unless_stopped(stop: asyncio.Event) -> None:
    if stop.is_set():
        raise FetchAbandoned


def _retrieved(task: asyncio.Future[Any]) -> None:
    """An abandoned fetch's outcome, read so that asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


def read_regular_file(path: Path, max_bytes: int) -> bytes | None:
    """At most ``max_bytes`` of ``path``, or None unless it is a regular file when opened (a symlink
    or FIFO swapped in after the path was checked is refused, without blocking)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return file.read(max_bytes)


def _decoder(encoding: str, url: str, param: str, kind: MediaKind) -> Any:
    """A zlib decompressor for a body sent gzip- or deflate-encoded (though asked for ``identity``, as a
    store may send what it holds compressed); None for one sent as is."""
    name = encoding.strip().lower()
    if name in ("", "identity"):
        return None
    if name in ("gzip", "x-gzip"):
        return zlib.decompressobj(zlib.MAX_WBITS | 16)
    if name == "deflate":
        return _Deflate()
    message = f"{kind.noun} at {url!r} was sent with Content-Encoding {encoding!r} (gzip, deflate are read)."
    raise fetch_failed(message, param, kind)


class _Deflate:
    """``deflate`` as curl and browsers read it: zlib-wrapped (as HTTP defines it) or raw deflate (as some
    servers send it), told apart by a zlib header's first two bytes."""

    def __init__(self) -> None:
        self._inner: Any = None
        self._head = b""

    @property
    def unconsumed_tail(self) -> bytes:
        return b"" if self._inner is None else bytes(self._inner.unconsumed_tail)

    def decompress(self, data: bytes, max_length: int) -> bytes:
        if self._inner is None:
            self._head += data
            if len(self._head) < 2:
                return b""
            first, second = self._head[0], self._head[1]
            wrapped = first & 0x0F == 8 and ((first << 8) | second) % 31 == 0  # (RFC 1950's check)
            self._inner = zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
            data, self._head = self._head, b""
        return bytes(self._inner.decompress(data, max_length))


def _decoded(decoder: Any, raw: bytes, room: int, url: str, param: str, kind: MediaKind) -> Iterator[bytes]:
    """``raw`` decoded, a piece at a time and never more than ``room`` bytes past the reader's cap (a
    small body that would decompress to gigabytes stops at the cap)."""
    if decoder is None:
        yield raw
        return
    pending = raw
    try:
        while pending:
            piece = decoder.decompress(pending, max(room, 1))
            pending = decoder.unconsumed_tail
            room -= len(piece)
            yield piece
    except zlib.error as exc:
        raise MediaError(
            f"{kind.noun} at {url!r} is not valid compressed data (Content-Encoding): {exc}.",
            param=param,
            code=kind.invalid_code,
        ) from exc


def fetch_failed(message: str, param: str, kind: MediaKind = MediaKind.IMAGE) -> MediaError:
    return MediaError(message, param=param, code=kind.fetch_failed_code)


def too_large(subject: str, max_bytes: int, param: str, kind: MediaKind = MediaKind.IMAGE) -> MediaError:
    return MediaError(
        f"{subject} exceeds the limit of {max_bytes} bytes.", param=param, code=kind.too_large_code
    )
