"""Decode the images of a request (their bytes come from ``app.media.urls``).

``decode_image`` turns an image's encoded bytes into an RGB ``PIL.Image``. Every failure is a
``MediaError`` (HTTP 400) naming the offending message part in ``param``; nothing here lets a client's
bad input become a 500.
"""

from __future__ import annotations

import io
import re
import struct

import numpy as np
from PIL import Image, ImageOps

from app.errors import MediaError

# Decoded pixels allowed per image (a 8192 x 8192 image); guards against decompression bombs, where a
# few KB of PNG claim gigabytes of pixels.
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192

# Formats decoded: what the common VLM APIs take, plus BMP and TIFF. PIL's other decoders (and
# Ghostscript behind EPS) are never tried on client bytes, and the pixel check above holds for each of
# these (tests/unit/test_image_decoding.py).
# (JPEG covers MPO, the multi-picture JPEG of phone cameras: PIL opens both with one factory.)
SUPPORTED_IMAGE_FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF")
_FORMAT_NAMES = "JPEG, PNG, GIF, WebP, BMP or TIFF"
_HIGH_DEPTH_GRAY_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})
_WHITE = (255, 255, 255, 255)
# An SVG is XML text: a byte-order mark, whitespace, then a tag, a prolog, a comment or a doctype.
_MARKUP_START = re.compile(rb"\A(?:\xef\xbb\xbf)?\s*<")
_HEIF_BRANDS = frozenset(
    {b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1", b"avif", b"avis"}
)


def decode_image(data: bytes, *, param: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode encoded image bytes into an RGB image, upright as its EXIF orientation says.

    Called in a thread for each image the processor cache misses. The cache keys on the encoded
    bytes, so the same bytes must always give the same pixels. Each kind of image (README, "Images"):

    - animated GIF, APNG and WebP, multi-page TIFF and MPO give their first frame;
    - alpha (RGBA, LA, palette or grayscale with transparency) is composited on white, as vLLM's image
      loader and transformers' ``convert_to_rgb`` do; ``convert("RGB")`` alone would show whatever colour
      hides under transparent pixels;
    - 16-bit grayscale (``I;16``, and ``I``) keeps the high byte, as PIL does for 16-bit RGB; PIL's own
      ``convert`` clips at 255, which turns nearly every pixel white;
    - CMYK, palette, 1-bit, YCbCr and LAB convert as PIL converts them; ICC profiles are ignored.

    Refusals, each a ``MediaError``: ``image_too_large`` (pixel count from the header, before anything is
    decoded), ``unsupported_image_format`` (SVG, HEIC/AVIF), ``invalid_image`` (anything else that does
    not decode completely: truncated, corrupt, another format).
    """
    _refuse_unsupported(data, param=param)
    claimed_size = _webp_canvas_size(data) or _gif_first_frame_size(data)
    if claimed_size is not None:
        _check_pixels(claimed_size, max_pixels=max_pixels, param=param)
    try:
        # The pixel count is checked from the header, before anything is decoded. (PIL's own bomb guard
        # is a process-global setting plus warnings, neither of which is safe to change per call.)
        with Image.open(io.BytesIO(data), formats=SUPPORTED_IMAGE_FORMATS) as probe:
            _check_pixels(probe.size, max_pixels=max_pixels, param=param)
            probe.verify()
        # verify() leaves the image unusable, so decode from a fresh handle.
        with Image.open(io.BytesIO(data), formats=SUPPORTED_IMAGE_FORMATS) as encoded:
            encoded.load()  # the first frame only
            return _to_rgb(ImageOps.exif_transpose(encoded))
    except MediaError:
        raise
    except Image.DecompressionBombError as exc:  # PIL's own limit, far above ours, caught at open
        raise MediaError(
            f"Image has more pixels than the limit of {max_pixels}.", param=param, code="image_too_large"
        ) from exc
    except Exception as exc:
        # PIL reports corrupt input with a zoo of exceptions: OSError, SyntaxError, ValueError, EOFError,
        # struct.error, IndexError... Every one of them is the client's bytes, never a server fault.
        raise MediaError(
            f"The image could not be decoded: the bytes are not a complete {_FORMAT_NAMES} image.",
            param=param,
            code="invalid_image",
        ) from exc


def _check_pixels(size: tuple[int, int], *, max_pixels: int, param: str) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise MediaError("The image has no pixels.", param=param, code="invalid_image")
    if width * height > max_pixels:
        raise MediaError(
            f"Image of {width}x{height} pixels exceeds the limit of {max_pixels} pixels.",
            param=param,
            code="image_too_large",
        )


def _refuse_unsupported(data: bytes, *, param: str) -> None:
    """Vector and HEIF-family images get their own message; PIL would only say "cannot identify"."""
    head = data[:4096]
    if _MARKUP_START.match(head) and b"<svg" in head.lower():
        raise MediaError(
            f"SVG images are not supported: send a raster image ({_FORMAT_NAMES}).",
            param=param,
            code="unsupported_image_format",
        )
    if head[4:8] == b"ftyp" and head[8:12] in _HEIF_BRANDS:
        raise MediaError(
            f"HEIC/HEIF and AVIF images are not supported: send {_FORMAT_NAMES}.",
            param=param,
            code="unsupported_image_format",
        )


# WebP and GIF are checked before PIL opens them: their plugins allocate inside Image.open (libwebp the
# canvas, twice; PIL a GIF's first-frame disposal area), bounded there only by PIL's global limit.


def _webp_canvas_size(data: bytes) -> tuple[int, int] | None:
    """The canvas size a WebP header claims (the same fields PIL reads), or None if not a WebP."""
    if not (data.startswith(b"RIFF") and data[8:12] == b"WEBP") or len(data) < 30:
        return None
    chunk = data[12:16]
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack_from("<HH", data, 26)
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8X":
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    if chunk == b"VP8L" and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


def _gif_first_frame_size(data: bytes) -> tuple[int, int] | None:
    """The size PIL gives a GIF when it opens it: the logical screen, grown to hold the first frame's
    extent. None if not a GIF, or if the blocks before the first frame are cut short (PIL refuses it)."""
    if data[:6] not in (b"GIF87a", b"GIF89a") or len(data) < 13:
        return None
    width, height, flags = struct.unpack_from("<HHB", data, 6)
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    while pos < len(data):
        if data[pos] == 0x2C and pos + 9 <= len(data):  # image descriptor: x, y, width, height
            x0, y0, frame_width, frame_height = struct.unpack_from("<HHHH", data, pos + 1)
            return max(width, x0 + frame_width), max(height, y0 + frame_height)
        if data[pos] != 0x21 or pos + 2 >= len(data):  # neither a frame nor an extension
            break
        pos += 2  # extension introducer and label, then data sub-blocks up to an empty one
        while pos < len(data) and data[pos]:
            pos += data[pos] + 1
        pos += 1
    return width, height


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in _HIGH_DEPTH_GRAY_MODES:
        image = _high_depth_to_8bit(image)
    if image.has_transparency_data:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, _WHITE), rgba).convert("RGB")
    return image.convert("RGB")


def _high_depth_to_8bit(image: Image.Image) -> Image.Image:
    """``I;16*`` (or ``I``, read as 16-bit and clipped) to ``L`` by the high byte; a tRNS key colour,
    given in 16-bit units, becomes an alpha channel (``LA``)."""
    values = np.asarray(image)
    if image.mode == "I":
        values = np.clip(values, 0, 0xFFFF)
    gray = Image.fromarray((values >> 8).astype(np.uint8))
    transparency = image.info.get("transparency")
    if isinstance(transparency, int):
        alpha = Image.fromarray(np.where(values == transparency, 0, 255).astype(np.uint8))
        return Image.merge("LA", (gray, alpha))
    return gray
