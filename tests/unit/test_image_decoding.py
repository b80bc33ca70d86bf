"""``decode_image`` on hostile and unusual images, every one generated in memory with PIL.

Each kind either decodes to the same RGB array every time (the processor cache keys on the encoded
bytes, so it must) and to the pixels README "Images" promises, or is refused with a 400 and its own
code. Decompression bombs are refused from the header: nothing is decoded, no canvas allocated.
"""

from __future__ import annotations

import io
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile, ImageOps

from app.errors import MediaError
from app.media.images import DEFAULT_MAX_IMAGE_PIXELS, decode_image

PARAM = "messages[0].content[0].image_url.url"
WHITE = (255, 255, 255)


def encode(image: Image.Image, fmt: str, **options: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def decode(data: bytes) -> np.ndarray:
    """The decoded pixels, after checking that a second decode of the same bytes gives the same."""
    first = decode_image(data, param=PARAM)
    assert first.mode == "RGB"
    pixels = np.asarray(first)
    assert np.array_equal(pixels, np.asarray(decode_image(data, param=PARAM)))
    return pixels


def refusal(data: bytes, **kwargs: Any) -> MediaError:
    with pytest.raises(MediaError) as info:
        decode_image(data, param=PARAM, **kwargs)
    err = info.value
    assert (err.http_status, err.err_type, err.param) == (400, "invalid_request_error", PARAM)
    return err


def noise(size: tuple[int, int] = (24, 16), seed: int = 0) -> Image.Image:
    width, height = size
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))


SOURCE = noise()
RGB = np.asarray(SOURCE)


# -- plain images --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "options"),
    [
        ("PNG", {}),
        ("BMP", {}),
        ("TIFF", {}),
        ("TIFF", {"compression": "tiff_deflate"}),
        ("WEBP", {"lossless": True}),
    ],
)
def test_lossless_formats_give_the_source_pixels(fmt: str, options: dict[str, Any]) -> None:
    assert np.array_equal(decode(encode(SOURCE, fmt, **options)), RGB)


def test_jpeg_gives_what_pil_decodes() -> None:
    data = encode(SOURCE, "JPEG", quality=90)
    assert np.array_equal(decode(data), np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


def test_palette_png_without_transparency() -> None:
    palette_image = SOURCE.quantize(16)
    expected = np.asarray(palette_image.convert("RGB"))
    assert np.array_equal(decode(encode(palette_image, "PNG")), expected)
    assert np.array_equal(decode(encode(palette_image, "GIF")), expected)


def test_bilevel_and_grayscale() -> None:
    gray = SOURCE.convert("L")
    assert np.array_equal(decode(encode(gray, "PNG")), np.stack([np.asarray(gray)] * 3, axis=-1))
    bilevel = decode(encode(SOURCE.convert("1"), "PNG"))
    assert set(np.unique(bilevel)) <= {0, 255}


@pytest.mark.parametrize("fmt", ["JPEG", "TIFF"])
def test_cmyk(fmt: str) -> None:
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # no cyan, full magenta and yellow: red
    pixels = decode(encode(cmyk, fmt))
    if fmt == "TIFF":
        assert (pixels == (255, 0, 0)).all()
    else:  # lossy, but still red
        assert (pixels[..., 0] > 200).all() and (pixels[..., 1:] < 60).all()


# -- alpha: composited on white ------------------------------------------------------------------


def alpha_ramp() -> Image.Image:
    """RGBA with alpha 0 (over black or red), 128 and 255 in columns."""
    rgba = np.zeros((4, 8, 4), dtype=np.uint8)
    rgba[:, :2] = (0, 0, 0, 0)
    rgba[:, 2:4] = (255, 0, 0, 0)
    rgba[:, 4:6] = (0, 0, 200, 128)
    rgba[:, 6:] = (10, 20, 30, 255)
    return Image.fromarray(rgba)


@pytest.mark.parametrize(("fmt", "options"), [("PNG", {}), ("WEBP", {"lossless": True}), ("TIFF", {})])
def test_rgba_is_composited_on_white(fmt: str, options: dict[str, Any]) -> None:
    pixels = decode(encode(alpha_ramp(), fmt, **options))
    assert (pixels[:, :4] == WHITE).all()  # fully transparent: white, whatever colour hid there
    half = pixels[:, 4:6].astype(int)
    assert np.abs(half - (127, 127, 227)).max() <= 1  # 128/255 of the colour, the rest white
    assert (pixels[:, 6:] == (10, 20, 30)).all()


def test_opaque_alpha_changes_nothing() -> None:
    assert np.array_equal(decode(encode(SOURCE.convert("RGBA"), "PNG")), RGB)


def test_gray_alpha() -> None:
    la = Image.merge("LA", (Image.new("L", (4, 2), 40), Image.frombytes("L", (4, 2), bytes([0, 255] * 4))))
    pixels = decode(encode(la, "PNG"))
    assert (pixels[:, ::2] == WHITE).all() and (pixels[:, 1::2] == (40, 40, 40)).all()


def palette_image() -> Image.Image:
    image = Image.new("P", (4, 2))
    image.putpalette([10, 20, 30, 200, 100, 0, 0, 0, 0])
    image.putdata([0, 1, 2, 0, 1, 2, 0, 1])
    return image


@pytest.mark.parametrize("fmt", ["PNG", "GIF"])
def test_palette_with_transparent_index(fmt: str) -> None:
    pixels = decode(encode(palette_image(), fmt, transparency=2))
    assert (pixels[0, 0] == (10, 20, 30)).all() and (pixels[0, 1] == (200, 100, 0)).all()
    assert (pixels[0, 2] == WHITE).all()  # index 2 is black, but transparent


def test_palette_with_alpha_table() -> None:
    pixels = decode(encode(palette_image(), "PNG", transparency=bytes([255, 0, 255])))
    assert (pixels[0, 0] == (10, 20, 30)).all() and (pixels[0, 1] == WHITE).all()


@pytest.mark.parametrize(("mode", "key"), [("L", 40), ("RGB", (10, 20, 30))])
def test_transparency_key_colour(mode: str, key: Any) -> None:
    image = Image.new(mode, (2, 1), key)
    image.putpixel((1, 0), 90 if mode == "L" else (90, 90, 90))
    pixels = decode(encode(image, "PNG", transparency=key))
    assert (pixels[0, 0] == WHITE).all() and (pixels[0, 1] == (90, 90, 90)).all()


# -- 16-bit grayscale: the high byte -------------------------------------------------------------


def ramp16() -> np.ndarray:
    return (np.arange(16 * 16, dtype=np.uint32) * 257).astype(np.uint16).reshape(16, 16)


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_16_bit_gray_keeps_the_high_byte(fmt: str) -> None:
    image = Image.fromarray(ramp16())
    assert image.mode == "I;16"
    assert Image.open(io.BytesIO(encode(image, fmt))).convert("RGB").getpixel((0, 8)) == WHITE  # PIL clips
    pixels = decode(encode(image, fmt))
    assert np.array_equal(pixels, np.stack([ramp16() >> 8] * 3, axis=-1))


def test_32_bit_integer_gray_is_read_as_16_bit_and_clipped() -> None:
    values = np.array([[-5, 0, 0x1234, 0xFFFF, 0x12345]], dtype=np.int32)
    pixels = decode(encode(Image.fromarray(values), "TIFF"))
    assert list(pixels[0, :, 0]) == [0, 0, 0x12, 0xFF, 0xFF]


def test_16_bit_gray_with_transparency_key() -> None:
    data = encode(Image.fromarray(ramp16()), "PNG", transparency=257)
    pixels = decode(data)
    assert (pixels[0, 1] == WHITE).all()  # the pixel of value 257
    assert (pixels[0, 2] == (2, 2, 2)).all() and (pixels[0, 0] == (0, 0, 0)).all()


# -- animation: the first frame ------------------------------------------------------------------

FRAMES = [Image.new("RGB", (8, 6), colour) for colour in [(255, 0, 0), (0, 255, 0), (0, 0, 255)]]


@pytest.mark.parametrize(
    ("fmt", "options"),
    [("GIF", {}), ("PNG", {}), ("WEBP", {"lossless": True}), ("MPO", {})],
)
def test_animated_images_give_their_first_frame(fmt: str, options: dict[str, Any]) -> None:
    data = encode(FRAMES[0], fmt, save_all=True, append_images=FRAMES[1:], **options)
    with Image.open(io.BytesIO(data)) as encoded:
        assert getattr(encoded, "n_frames", 1) == 3
    pixels = decode(data)
    assert pixels.shape == (6, 8, 3)
    if fmt == "MPO":  # JPEG-compressed frames
        assert (pixels[..., 0] > 240).all() and (pixels[..., 1:] < 15).all()
    else:
        assert (pixels == (255, 0, 0)).all()


# -- EXIF orientation: upright -------------------------------------------------------------------


def with_orientation(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize(("fmt", "options"), [("PNG", {}), ("WEBP", {"lossless": True}), ("TIFF", {})])
def test_exif_orientation_gives_the_upright_image(
    fmt: str, options: dict[str, Any], orientation: int
) -> None:
    # A camera stores the sensor's pixels and the orientation in which to show them: the upright image
    # is the stored one transposed. Lossless formats, so the result can be compared exactly.
    upright = ImageOps.exif_transpose(
        Image.open(io.BytesIO(encode(SOURCE, "PNG", exif=with_orientation(orientation))))
    )
    data = encode(SOURCE, fmt, exif=with_orientation(orientation), **options)
    assert np.array_equal(decode(data), np.asarray(upright.convert("RGB")))
    if orientation in (5, 6, 7, 8):
        assert upright.size == SOURCE.size[::-1]


def test_exif_rotated_jpeg_equals_the_pre_rotated_pixels() -> None:
    data = encode(SOURCE, "JPEG", exif=with_orientation(6), quality=95)  # 90 degrees clockwise on display
    stored = Image.open(io.BytesIO(data)).convert("RGB")
    expected = stored.transpose(Image.Transpose.ROTATE_270)
    assert np.array_equal(decode(data), np.asarray(expected))


# -- refusals ------------------------------------------------------------------------------------


def all_formats() -> dict[str, bytes]:
    return {
        "PNG": encode(SOURCE, "PNG"),
        "JPEG": encode(SOURCE, "JPEG"),
        "GIF": encode(SOURCE, "GIF"),
        "WEBP": encode(SOURCE, "WEBP", lossless=True),
        "WEBP-lossy": encode(SOURCE, "WEBP"),
        "BMP": encode(SOURCE, "BMP"),
        "TIFF": encode(SOURCE, "TIFF"),
    }


@pytest.mark.parametrize(("name", "data"), all_formats().items())
def test_truncated_files_are_invalid(name: str, data: bytes) -> None:
    for cut in (len(data) // 2, len(data) - 12, 20):
        assert refusal(data[:cut]).code == "invalid_image", (name, cut)


@pytest.mark.parametrize(
    "data",
    [b"", b"\0" * 64, b"definitely not an image", b"%PDF-1.7\n", b"<html><body>hi</body></html>", b"GIF89a"],
)
def test_non_image_bytes_are_invalid(data: bytes) -> None:
    err = refusal(data)
    assert err.code == "invalid_image" and "JPEG, PNG" in err.message


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'


@pytest.mark.parametrize(
    "data",
    [
        SVG,
        b'<?xml version="1.0" encoding="UTF-8"?>\n' + SVG,
        b"\xef\xbb\xbf  \n<!-- drawn by hand -->\n" + SVG,
        b'<?xml version="1.0"?><!DOCTYPE svg PUBLIC "-//W3C//DTD SVG 1.1//EN" "x.dtd">\n<SVG></SVG>',
    ],
)
def test_svg_is_refused_by_name(data: bytes) -> None:
    err = refusal(data)
    assert err.code == "unsupported_image_format" and "SVG" in err.message


def test_heif_family_is_refused_by_name() -> None:
    avif = encode(SOURCE, "AVIF")  # PIL could decode it, but AVIF is not a supported format
    err = refusal(avif)
    assert err.code == "unsupported_image_format" and "AVIF" in err.message
    heic = b"\0\0\0\x18ftypheic\0\0\0\0mif1heic" + b"\0" * 64
    assert refusal(heic).code == "unsupported_image_format"


@pytest.mark.parametrize("fmt", ["ICO", "PPM", "TGA", "PCX", "JPEG2000", "QOI", "SGI", "DDS"])
def test_formats_outside_the_allow_list_are_not_tried(fmt: str) -> None:
    data = encode(SOURCE.convert("RGBA") if fmt == "DDS" else SOURCE, fmt)
    assert Image.open(io.BytesIO(data)).format  # PIL itself would open it
    assert refusal(data).code == "invalid_image"


# -- decompression bombs -------------------------------------------------------------------------


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
        assert time.perf_counter() - start < 0.5
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


# -- fuzzing -------------------------------------------------------------------------------------

SEEDS = list(all_formats().values()) + [encode(FRAMES[0], "GIF", save_all=True, append_images=FRAMES[1:])]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.sampled_from(SEEDS),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
    cut=st.none() | st.integers(0, 10_000),
)
def test_mutated_images_decode_consistently_or_are_refused(
    seed: bytes, edits: list[tuple[int, int]], cut: int | None
) -> None:
    data = bytearray(seed)
    for offset, value in edits:
        data[offset % len(data)] = value
    data = data[:cut] if cut is not None else data
    try:
        first = decode_image(bytes(data), param=PARAM)
    except MediaError as err:
        assert err.code in ("invalid_image", "image_too_large", "unsupported_image_format")
        return
    assert first.mode == "RGB"
    assert first.tobytes() == decode_image(bytes(data), param=PARAM).tobytes()
