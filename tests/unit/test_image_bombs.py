"""Decompression bombs for ``decode_image``, every one a header of a few hundred bytes made in memory:
refused from the header with 400 ``image_too_large``, nothing decoded and no canvas allocated."""

from __future__ import annotations

import struct
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from PIL import Image, ImageFile

from app.errors import MediaError
from app.media.images import DEFAULT_MAX_IMAGE_PIXELS, decode_image
from tests.unit.image_support import FRAMES, PARAM, encode, refusal


def png_claiming(width: int, height: int) -> bytes:
    """A complete PNG of a few dozen bytes whose header claims ``width`` x ``height`` RGB pixels."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def patch(data: bytes, offset: int, fmt: str, *values: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, *values)
    return bytes(out)


def gif_claiming(width: int, height: int) -> bytes:
    return patch(encode(Image.new("P", (1, 1)), "GIF"), 6, "<HH", width, height)  # logical screen


def bmp_claiming(width: int, height: int) -> bytes:
    return patch(encode(Image.new("RGB", (1, 1)), "BMP"), 18, "<ii", width, height)


def jpeg_claiming(width: int, height: int) -> bytes:
    data = encode(Image.new("RGB", (8, 8)), "JPEG")
    sof = data.index(b"\xff\xc0")
    return patch(data, sof + 5, ">HH", height, width)


def tiff_claiming(width: int, height: int) -> bytes:
    """A 1x1 TIFF whose ImageWidth and ImageLength tags are rewritten as LONGs."""
    data = bytearray(encode(Image.new("L", (1, 1)), "TIFF"))
    assert data[:4] == b"II*\0"
    (ifd,) = struct.unpack_from("<I", data, 4)
    (count,) = struct.unpack_from("<H", data, ifd)
    for entry in range(ifd + 2, ifd + 2 + 12 * count, 12):
        (tag,) = struct.unpack_from("<H", data, entry)
        if tag in (256, 257):
            struct.pack_into("<HII", data, entry + 2, 4, 1, width if tag == 256 else height)  # LONG, 1 value
    return bytes(data)


def webp_lossless_claiming(width: int, height: int) -> bytes:
    data = encode(Image.new("RGB", (1, 1)), "WEBP", lossless=True)
    assert data[12:16] == b"VP8L" and data[20] == 0x2F
    (bits,) = struct.unpack_from("<I", data, 21)
    bits = (bits & ~((1 << 28) - 1)) | (width - 1) | ((height - 1) << 14)
    return patch(data, 21, "<I", bits)


def webp_lossy_claiming(width: int, height: int) -> bytes:
    data = encode(Image.new("RGB", (16, 16)), "WEBP")
    assert data[12:16] == b"VP8 " and data[23:26] == b"\x9d\x01\x2a"
    return patch(data, 26, "<HH", width, height)


def webp_extended_claiming(width: int, height: int) -> bytes:
    data = encode(FRAMES[0], "WEBP", save_all=True, append_images=FRAMES[1:])  # animated: VP8X
    assert data[12:16] == b"VP8X"
    out = bytearray(data)
    out[24:27] = (width - 1).to_bytes(3, "little")
    out[27:30] = (height - 1).to_bytes(3, "little")
    return bytes(out)


BOMBS: dict[str, Callable[[int, int], bytes]] = {
    "PNG": png_claiming,
    "GIF": gif_claiming,
    "BMP": bmp_claiming,
    "JPEG": jpeg_claiming,
    "TIFF": tiff_claiming,
    "WEBP-lossless": webp_lossless_claiming,
    "WEBP-lossy": webp_lossy_claiming,
    "WEBP-animated": webp_extended_claiming,
}
# Just over the cap (below PIL's own limit, so only mmserve's check stands in the way), and the most
# each format's header can claim (far over PIL's limit too).
JUST_OVER = (8193, 8192)
FORMAT_MAX = {
    "GIF": 65535,
    "JPEG": 65535,
    "WEBP-lossless": 16384,
    "WEBP-lossy": 16383,
    "WEBP-animated": 1 << 24,
}


@pytest.fixture
def no_decoding(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Records any pixel decoding or canvas allocation (PIL's load, its image memory, libwebp's decoder)."""
    calls: list[str] = []

    def spy(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)

        return wrapper

    from PIL import _webp

    monkeypatch.setattr(ImageFile.ImageFile, "load", spy("load", ImageFile.ImageFile.load))
    monkeypatch.setattr(Image.core, "new", spy("core.new", Image.core.new))
    monkeypatch.setattr(Image.core, "fill", spy("core.fill", Image.core.fill))
    monkeypatch.setattr(_webp, "WebPAnimDecoder", spy("WebPAnimDecoder", _webp.WebPAnimDecoder))
    yield calls


@pytest.mark.parametrize("name", BOMBS)
def test_bombs_are_refused_from_the_header(name: str, no_decoding: list[str]) -> None:
    side = FORMAT_MAX.get(name, 100_000)
    bombs = [BOMBS[name](width, height) for width, height in (JUST_OVER, (side, side))]
    no_decoding.clear()  # building them used PIL
    for data in bombs:
        assert len(data) < 1000
        start = time.perf_counter()
        err = refusal(data)
        assert err.code == "image_too_large", (name, err)
        assert time.perf_counter() - start < 5.0  # a loose bound: `no_decoding` proves nothing was decoded
    assert no_decoding == []


def test_a_png_claiming_100000_squared_in_a_few_dozen_bytes(no_decoding: list[str]) -> None:
    data = png_claiming(100_000, 100_000)
    assert len(data) < 100
    assert refusal(data).code == "image_too_large"
    assert no_decoding == []


def test_a_gif_whose_first_frame_outgrows_its_screen(no_decoding: list[str]) -> None:
    # PIL grows the canvas to the frame and allocates the frame's disposal area while opening.
    data = bytearray(encode(Image.new("P", (1, 1)), "GIF", disposal=2))
    descriptor = data.index(b"\x2c\x00\x00\x00\x00")
    struct.pack_into("<HH", data, descriptor + 5, 8193, 8192)
    no_decoding.clear()
    assert refusal(bytes(data)).code == "image_too_large"
    assert no_decoding == []


@pytest.mark.parametrize("name", BOMBS)
def test_the_bomb_builders_make_real_headers(name: str) -> None:
    # The same builders at an allowed size get past the pixel check (and then decode or fail as the
    # garbage pixel data they carry deserves), so the refusals above are the pixel check's doing.
    data = BOMBS[name](64, 64)
    try:
        assert decode_image(data, param=PARAM).size == (64, 64)
    except MediaError as err:
        assert err.code == "invalid_image", err


def test_the_cap_is_inclusive() -> None:
    data = encode(Image.new("RGB", (100, 100)), "PNG")
    assert refusal(data, max_pixels=100 * 99).code == "image_too_large"
    assert decode_image(data, param=PARAM, max_pixels=100 * 100).size == (100, 100)
    assert DEFAULT_MAX_IMAGE_PIXELS == 8192 * 8192


@pytest.mark.parametrize("size", [(0, 10), (10, 0)])
def test_a_header_claiming_no_pixels_is_invalid(size: tuple[int, int]) -> None:
    assert refusal(png_claiming(*size)).code == "invalid_image"
