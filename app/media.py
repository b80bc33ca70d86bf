"""Fetch and decode the images of a request.

``load_image_bytes`` returns the image's original encoded bytes whatever the URL kind, because the
mm_hash is taken over them: the same file sent by ``https://`` or as a ``data:`` URL must hash alike.
What may be fetched, and how, is ``app.url_policy`` and ``app.media_fetch``.
``decode_image`` turns them into an RGB ``PIL.Image``. Every failure is a ``MediaError`` (HTTP 400)
naming the offending message part in ``param``; nothing here lets a client's bad input become a 500.
"""

from __future__ import annotations

import base64
import binascii
import io
import re

from PIL import Image, ImageOps, UnidentifiedImageError

from app.errors import MediaError
from app.media_fetch import MediaFetcher, RequestImageBudget

# Decoded pixels allowed per image (a 8192 x 8192 image); guards against decompression bombs, where a
# few KB of PNG claim gigabytes of pixels.
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192

_WHITESPACE = re.compile(rb"\s+")


async def load_image_bytes(
    url: str, *, fetcher: MediaFetcher, param: str, budget: RequestImageBudget | None = None
) -> bytes:
    """The encoded bytes behind an ``image_url``: ``data:image/...;base64,``, ``http(s)://`` (under the
    media policy: public addresses, allowed domains, redirects checked hop by hop) or ``file://`` (only
    under ``--allowed-local-media-path``).

    Called once per image part while a request is prepared. At most ``max_image_bytes`` are read, and
    every byte counts against ``budget``, the request's total when one is given.
    """
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _decode_data_url(url, max_bytes=fetcher.policy.max_image_bytes, param=param)
        if budget is not None:
            budget.add(len(data))
        return data
    if scheme in ("http", "https"):
        return await fetcher.fetch_http(url, param=param, budget=budget)
    if scheme == "file":
        return await fetcher.read_file(url, param=param, budget=budget)
    raise MediaError(
        "Image URLs must be http://, https:// or data:image/...;base64, URLs.",
        param=param,
        code="invalid_image_url",
    )


def decode_image(data: bytes, *, param: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode encoded image bytes into an RGB image, upright as its EXIF orientation says.

    Mirrors ``transformers.image_utils.load_image`` (EXIF transpose, then RGB), so prompts behave as
    they would with the HF processor on the same file. Animated images give their first frame.
    """
    # The pixel count is checked from the header, before anything is decoded. (PIL's own bomb guard
    # is a process-global setting plus warnings, neither of which is safe to change per call.)
    try:
        with Image.open(io.BytesIO(data)) as probe:
            _check_pixels(probe.size, max_pixels=max_pixels, param=param)
            probe.verify()
        # verify() leaves the image unusable, so decode from a fresh handle.
        with Image.open(io.BytesIO(data)) as encoded:
            _check_pixels(encoded.size, max_pixels=max_pixels, param=param)
            encoded.load()
            upright = ImageOps.exif_transpose(encoded) or encoded
            return upright.convert("RGB")
    except MediaError:
        raise
    except Image.DecompressionBombError as exc:
        raise MediaError(f"Image has too many pixels: {exc}", param=param, code="image_too_large") from exc
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, TypeError) as exc:
        # PIL reports truncated or corrupt files with any of these.
        raise MediaError("The image could not be decoded.", param=param, code="invalid_image") from exc


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


def _decode_data_url(url: str, *, max_bytes: int, param: str) -> bytes:
    header, sep, payload = url.partition(",")
    # header: "data:<mediatype>[;params];base64"
    fields = header[len("data:") :].split(";")
    media_type = fields[0].strip().lower()
    if not sep or fields[-1].strip().lower() != "base64" or len(fields) < 2:
        raise MediaError(
            "Data URLs must have the form data:image/<format>;base64,<data>.",
            param=param,
            code="invalid_image_url",
        )
    if not media_type.startswith("image/") or len(media_type) == len("image/"):
        raise MediaError(
            f"Data URL media type must be image/<format>, got {media_type or 'none'!r}.",
            param=param,
            code="invalid_image_url",
        )
    encoded = _WHITESPACE.sub(b"", payload.encode("ascii", "replace"))
    if len(encoded) // 4 * 3 > max_bytes + 2:
        raise MediaError(
            f"Image exceeds the limit of {max_bytes} bytes.", param=param, code="image_too_large"
        )
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(
            "Data URL payload is not valid base64.", param=param, code="invalid_image_url"
        ) from exc
    if not data:
        raise MediaError("Data URL carries no image data.", param=param, code="invalid_image_url")
    if len(data) > max_bytes:
        raise MediaError(
            f"Image exceeds the limit of {max_bytes} bytes.", param=param, code="image_too_large"
        )
    return data
