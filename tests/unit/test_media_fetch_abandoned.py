"""Fetches that never end do not use up the connection pool (app/media/fetch.py): URLs of a loopback
"tarpit" that accepts connections and never answers, fetched many at once past a small pool and given
up at the deadline or cancelled (as ``gather_or_cancel`` cancels a request's other fetches when one
fails), leave the pool able to fetch from a healthy server; the abandoned fetches end by themselves."""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from app.errors import MediaError
from app.inputs.input_processor import gather_or_cancel
from app.media.fetch import MediaFetcher
from app.media.url_policy import MediaPolicy

POOL = 4  # connections of the fetcher's client: the fetches below are 3x that at once
TIMEOUT_S = 0.3
# abandoned fetches end by httpx's own timeouts (a pool wait, a connect, a read: each TIMEOUT_S), with room
SETTLE_S = 5 * TIMEOUT_S


@pytest.fixture(scope="module")
def tarpit() -> Iterator[int]:
    """A port that accepts every connection and never sends a byte."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()
    for conn in held:
        conn.close()


@pytest.fixture(scope="module")
def healthy() -> Iterator[int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            status = 404 if self.path == "/missing" else 200
            self.send_response(status)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"\x89PNG")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


async def rounds_then_healthy_fetch(tarpit: int, healthy: int) -> bytes:
    limits = httpx.Limits(max_connections=POOL)
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False, limits=limits) as client:
        fetcher = MediaFetcher(MediaPolicy(allow_private_addresses=True, timeout_s=TIMEOUT_S), client)
        # the healthy server's fetches, on the same pool: a deadline no loaded machine misses, which a
        # pool left full (as it was) still runs out of
        patient = MediaFetcher(MediaPolicy(allow_private_addresses=True, timeout_s=10), client)
        hang = f"http://127.0.0.1:{tarpit}/hang"
        for _ in range(2):  # past the deadline, all of them
            outcomes = await asyncio.gather(
                *(fetcher.fetch_http(hang, param="p") for _ in range(3 * POOL)), return_exceptions=True
            )
            assert all(isinstance(outcome, MediaError) for outcome in outcomes)
            await asyncio.sleep(SETTLE_S)
        for _ in range(2):  # cancelled as a sibling failed (the 404, or a deadline if that comes first)
            missing = patient.fetch_http(f"http://127.0.0.1:{healthy}/missing", param="p")
            hanging = [fetcher.fetch_http(hang, param="p") for _ in range(3 * POOL)]
            with pytest.raises(MediaError):
                await gather_or_cancel([missing, *hanging])
            await asyncio.sleep(SETTLE_S)
        return await patient.fetch_http(f"http://127.0.0.1:{healthy}/ok.png", param="p")


def test_fetches_given_up_leave_the_pool_usable(tarpit: int, healthy: int) -> None:
    assert asyncio.run(rounds_then_healthy_fetch(tarpit, healthy)) == b"\x89PNG"
