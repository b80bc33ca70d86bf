"""``decode_image`` on hostile and unusual images, every one generated in memory with PIL.

Each kind either decodes to the same RGB array every time (the processor cache keys on the encoded
bytes, so it must) and to the pixels README "Images" promises, or is refused with a 400 and its own
code. Decompression bombs: tests/unit/test_image_bombs.py.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from app.errors import MediaError
from app.media.images import decode_image
from tests.unit.image_support import FRAMES, PARAM, encode, refusal

WHITE = (255, 255, 255)


def decode(data: bytes) -> np.ndarray:
    """The decoded pixels, after checking that a second decode of the same bytes gives the same."""
    first = decode_image(data, param=PARAM)
    assert first.mode == "RGB"
    pixels = np.asarray(first)
    assert np.array_equal(pixels, np.asarray(decode_image(data, param=PARAM)))
    return pixels


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
