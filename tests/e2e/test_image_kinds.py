"""Unusual images through the real server: each is answered as README "Images" says.

An image that decodes is compared with a plain RGB PNG of the pixels it should decode to: the two
have different bytes (so different mm_hashes, each processed and encoded on its own), and greedy
decoding must give the same tokens for both. Refused kinds get their 400 and code.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib
from typing import Any

import httpx
import numpy as np
import PIL.Image
import pytest

from tests.e2e.conftest import greedy_body, make_image, png_bytes
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

PARAM = "messages[0].content[0].image_url.url"


def encode(image: PIL.Image.Image, fmt: str, **options: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def ask(server: Server, data: bytes, mime: str) -> httpx.Response:
    url = f"data:{mime};base64," + base64.b64encode(data).decode()
    message = {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}],
    }
    body = greedy_body([message], max_tokens=2, logprobs=True, top_logprobs=3)
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)


def tokens(response: httpx.Response) -> list[Any]:
    """The generated tokens with their top alternatives (names only)."""
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    return [(t["token"], [alt["token"] for alt in t["top_logprobs"]]) for t in content]


def animated_gif() -> tuple[bytes, PIL.Image.Image]:
    frames = [make_image(seed) for seed in (701, 702, 703)]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    return data, PIL.Image.open(io.BytesIO(data)).convert("RGB")  # the first frame, as GIF quantized it


def cmyk_jpeg() -> tuple[bytes, PIL.Image.Image]:
    data = encode(make_image(704).convert("CMYK"), "JPEG", quality=90)
    return data, PIL.Image.open(io.BytesIO(data)).convert("RGB")


def rgba_png() -> tuple[bytes, PIL.Image.Image]:
    rgb = np.asarray(make_image(705))
    alpha = np.tile(np.linspace(0, 255, rgb.shape[1]).astype(np.uint8), (rgb.shape[0], 1))
    data = encode(PIL.Image.fromarray(np.dstack([rgb, alpha])), "PNG")
    # composited on white, rounded as PIL's alpha_composite rounds
    white = PIL.Image.new("RGBA", (rgb.shape[1], rgb.shape[0]), (255, 255, 255, 255))
    expected = PIL.Image.alpha_composite(white, PIL.Image.open(io.BytesIO(data)).convert("RGBA"))
    return data, expected.convert("RGB")


def png_16_bit() -> tuple[bytes, PIL.Image.Image]:
    gray = np.asarray(make_image(706).convert("L"))
    data = encode(PIL.Image.fromarray(gray.astype(np.uint16) * 257), "PNG")  # mode I;16
    return data, PIL.Image.fromarray(gray).convert("RGB")  # the high byte is the 8-bit value


def exif_rotated_jpeg() -> tuple[bytes, PIL.Image.Image]:
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # shown rotated 90 degrees clockwise
    data = encode(make_image(707), "JPEG", exif=exif.tobytes(), quality=90)
    stored = PIL.Image.open(io.BytesIO(data)).convert("RGB")
    return data, stored.transpose(PIL.Image.Transpose.ROTATE_270)


@pytest.mark.parametrize(
    ("build", "mime"),
    [
        (animated_gif, "image/gif"),
        (cmyk_jpeg, "image/jpeg"),
        (rgba_png, "image/png"),
        (png_16_bit, "image/png"),
        (exif_rotated_jpeg, "image/jpeg"),
    ],
    ids=["animated-gif", "cmyk-jpeg", "rgba-png", "16-bit-png", "exif-rotated-jpeg"],
)
def test_decoded_as_documented(server: Server, build: Any, mime: str) -> None:
    data, expected = build()
    assert tokens(ask(server, data, mime)) == tokens(ask(server, png_bytes(expected), "image/png"))


def png_claiming(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


SVG = b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="8" height="8"><rect/></svg>'


@pytest.mark.parametrize(
    ("data", "mime", "code"),
    [
        (SVG, "image/svg+xml", "unsupported_image_format"),
        (png_claiming(100_000, 100_000), "image/png", "image_too_large"),
        (encode(make_image(708), "PNG")[:2000], "image/png", "invalid_image"),  # truncated
    ],
    ids=["svg", "png-bomb", "truncated-png"],
)
def test_refused_with_its_code(server: Server, data: bytes, mime: str, code: str) -> None:
    response = ask(server, data, mime)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (code, PARAM, "invalid_request_error")
