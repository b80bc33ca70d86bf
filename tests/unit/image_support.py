"""What the image decoding tests share: encoding an image in memory, and a refusal checked for its
OpenAI envelope."""

from __future__ import annotations

import io
from typing import Any

import pytest
from PIL import Image

from app.errors import MediaError
from app.media.images import decode_image

PARAM = "messages[0].content[0].image_url.url"
# Three frames of solid colour, for animated images.
FRAMES = [Image.new("RGB", (8, 6), colour) for colour in [(255, 0, 0), (0, 255, 0), (0, 0, 255)]]


def encode(image: Image.Image, fmt: str, **options: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def refusal(data: bytes, **kwargs: Any) -> MediaError:
    with pytest.raises(MediaError) as info:
        decode_image(data, param=PARAM, **kwargs)
    err = info.value
    assert (err.http_status, err.err_type, err.param) == (400, "invalid_request_error", PARAM)
    return err
