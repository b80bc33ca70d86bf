"""An image URL on loopback that answers only when the test says so."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator

from tests.e2e.conftest import send_png


@contextlib.contextmanager
def held_image(body: bytes, hold_s: float) -> Iterator[tuple[str, threading.Event, threading.Event]]:
    """A loopback URL for a PNG (``body``) whose answer waits until ``release`` is set (at most
    ``hold_s``); ``asked`` is set when a fetch of it arrives. A request holding it stays under way for as
    long as the test wants, however fast or slow the machine."""
    asked, release = threading.Event(), threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            asked.set()
            release.wait(hold_s)
            send_png(self, body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/held.png", asked, release
    finally:
        release.set()
        httpd.shutdown()
        httpd.server_close()
