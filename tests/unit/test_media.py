"""Image fetch and decode: data URLs, a real HTTP server on 127.0.0.1, and every failure as a 400."""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from PIL import Image

from app.errors import MediaError
from app.media.fetch import MediaFetcher
from app.media.images import decode_image
from app.media.kinds import MediaKind
from app.media.url_policy import MediaPolicy
from app.media.urls import load_media_bytes
from wire.hashing import mm_hash

PARAM = "messages[0].content[1].image_url"
MAX_BYTES = 64 * 1024


def make_png(size: tuple[int, int] = (40, 30), mode: str = "RGB") -> bytes:
    width, height = size
    pixels = bytes(v % 256 for y in range(height) for x in range(width) for v in (x * 7, y * 11, x + y))
    image = Image.frombytes("RGB", size, pixels).convert(mode)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


PNG = make_png()


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:  # keep test output quiet
        pass

    def _send(self, status: int, body: bytes, length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        try:
            if self.path == "/img.png":
                self._send(200, PNG)
            elif self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", "/img.png")
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/slow":  # far past any timeout a test sets, so no busy machine blurs them
                time.sleep(10)
                self._send(200, PNG)
            elif self.path == "/drip":  # each chunk in time, the whole body too late
                self.send_response(200)
                self.send_header("Content-Length", str(200 * 64))
                self.end_headers()
                for _ in range(200):  # 10 s in all
                    self.wfile.write(b"\0" * 64)
                    self.wfile.flush()
                    time.sleep(0.05)
            elif self.path == "/big":  # honest Content-Length over the cap
                self._send(200, b"\0" * (MAX_BYTES + 1))
            elif self.path == "/big-unannounced":  # no Content-Length: the cap must hold while streaming
                self.send_response(200)
                self.end_headers()
                for _ in range(MAX_BYTES // 4096 + 8):
                    self.wfile.write(b"\0" * 4096)
                self.close_connection = True
            elif self.path == "/empty":
                self._send(200, b"")
            else:
                self._send(404, b"not found")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up first, as the timeout tests intend


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.block_on_close = False
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def load(url: str, *, timeout_s: float = 5.0, max_bytes: int = MAX_BYTES) -> bytes:
    # The test server is on loopback, so private addresses are allowed here (tests/unit/test_media_fetch.py
    # covers the policy itself).
    policy = MediaPolicy(allow_private_addresses=True, timeout_s=timeout_s, max_image_bytes=max_bytes)

    async def main() -> bytes:
        async with httpx.AsyncClient(trust_env=False) as client:
            return await load_media_bytes(
                url, kind=MediaKind.IMAGE, fetcher=MediaFetcher(policy, client), param=PARAM
            )

    return asyncio.run(main())


def load_error(url: str, **kwargs: float) -> MediaError:
    with pytest.raises(MediaError) as info:
        load(url, **kwargs)  # type: ignore[arg-type]
    err = info.value
    assert (err.http_status, err.err_type, err.param) == (400, "invalid_request_error", PARAM)
    return err


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


# -- data URLs -------------------------------------------------------------------------------------


def test_data_url_returns_the_encoded_bytes() -> None:
    assert load(data_url(PNG)) == PNG
    assert load(data_url(PNG, "image/jpeg")) == PNG  # the bytes decide, not the declared format


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64,not*base64!",
        "data:image/png;base64,iVBORw0KGgo",  # bad padding
        "data:image/png;base64,iVBORw0KGgo=-_-",
        "data:image/png;base64,",
    ],
)
def test_bad_base64_is_a_media_error_naming_the_part(url: str) -> None:
    assert load_error(url).code == "invalid_image_url"


@pytest.mark.parametrize(
    "url",
    [
        data_url(PNG, "text/plain"),
        data_url(PNG, "image/"),
        "data:image/png," + PNG.hex(),  # not base64-encoded
        "data:image/png;base64" + base64.b64encode(PNG).decode(),  # no comma
        "ftp://127.0.0.1/img.png",
        "img.png",
    ],
)
def test_unsupported_urls_are_rejected(url: str) -> None:
    assert load_error(url).code == "invalid_image_url"


def test_file_urls_are_refused_by_default() -> None:
    assert load_error("file:///etc/passwd").code == "image_url_forbidden"


def test_whitespace_in_a_data_url_payload_is_ignored() -> None:
    encoded = base64.b64encode(PNG).decode()
    spaced = " \t".join(encoded[i : i + 7] for i in range(0, len(encoded), 7)) + "\r\n\x0b\x0c"
    assert load("data:image/png;base64," + spaced) == PNG
    # exactly the bytes a bytes regex's \s matches; other control characters are not base64
    assert (
        load_error("data:image/png;base64," + encoded[:8] + "\x1c" + encoded[8:]).code == "invalid_image_url"
    )
    assert (
        load_error("data:image/png;base64," + encoded[:8] + "\u00a0" + encoded[8:]).code
        == "invalid_image_url"
    )


def test_data_url_over_the_byte_cap() -> None:
    assert load_error(data_url(PNG), max_bytes=len(PNG) - 1).code == "image_too_large"
    assert load(data_url(PNG), max_bytes=len(PNG)) == PNG


# -- http(s) ---------------------------------------------------------------------------------------


def test_http_fetch_returns_the_same_bytes_and_hash_as_the_data_url(image_server: str) -> None:
    by_url = load(f"{image_server}/img.png")
    by_data_url = load(data_url(PNG))
    assert by_url == by_data_url == PNG
    digests = {
        mm_hash(model_id="m", modality="image", data=data, options={}) for data in (by_url, by_data_url)
    }
    assert len(digests) == 1


def test_http_follows_redirects(image_server: str) -> None:
    assert load(f"{image_server}/redirect") == PNG


def test_http_404_is_a_fetch_failure(image_server: str) -> None:
    err = load_error(f"{image_server}/missing.png")
    assert err.code == "image_fetch_failed" and "404" in err.message


def test_closed_port_is_a_fetch_failure() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert load_error(f"http://127.0.0.1:{port}/img.png").code == "image_fetch_failed"


def test_slow_server_times_out(image_server: str) -> None:
    started = time.monotonic()
    assert load_error(f"{image_server}/slow", timeout_s=0.2).code == "image_fetch_failed"
    assert time.monotonic() - started < 5.0  # not the 10 s answer


def test_slow_drip_is_bounded_by_the_total_timeout(image_server: str) -> None:
    started = time.monotonic()
    assert load_error(f"{image_server}/drip", timeout_s=0.3).code == "image_fetch_failed"
    assert time.monotonic() - started < 5.0  # not the 10 s body


@pytest.mark.parametrize("path", ["/big", "/big-unannounced"])
def test_too_large_response(image_server: str, path: str) -> None:
    assert load_error(f"{image_server}{path}").code == "image_too_large"


def test_empty_response(image_server: str) -> None:
    assert load_error(f"{image_server}/empty").code == "invalid_image"


# -- decode ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_decode_gives_rgb(mode: str) -> None:
    image = decode_image(make_png((40, 30), mode), param=PARAM)
    assert image.mode == "RGB" and image.size == (40, 30)


def test_decode_matches_pil() -> None:
    image = decode_image(PNG, param=PARAM)
    assert image.tobytes() == Image.open(io.BytesIO(PNG)).convert("RGB").tobytes()


@pytest.mark.parametrize("data", [b"", b"definitely not an image", PNG[: len(PNG) // 2], PNG[:40]])
def test_undecodable_bytes(data: bytes) -> None:
    with pytest.raises(MediaError) as info:
        decode_image(data, param=PARAM)
    assert (info.value.code, info.value.param, info.value.http_status) == ("invalid_image", PARAM, 400)


def test_decompression_bomb_is_refused_before_decoding() -> None:
    with pytest.raises(MediaError) as info:
        decode_image(make_png((100, 100)), param=PARAM, max_pixels=100 * 99)
    assert info.value.code == "image_too_large"
    assert decode_image(make_png((100, 100)), param=PARAM, max_pixels=100 * 100).size == (100, 100)


def test_exif_orientation_is_applied() -> None:
    image = Image.new("RGB", (40, 20), (200, 10, 10))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise on display
    buf = io.BytesIO()
    image.save(buf, format="JPEG", exif=exif.tobytes())
    assert decode_image(buf.getvalue(), param=PARAM).size == (20, 40)
