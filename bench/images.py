"""Test images for the benchmarks: smooth, deterministic, JPEG-encoded like a photo."""

from __future__ import annotations

import base64
import io

import numpy as np
import PIL.Image


def jpeg_data_url(size: int | tuple[int, int], seed: int) -> str:
    """A JPEG data URL of ``size`` pixels (a square side, or (width, height))."""
    width, height = (size, size) if isinstance(size, int) else size
    rng = np.random.default_rng(seed)
    low = rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8)
    image = PIL.Image.fromarray(low).resize((width, height), PIL.Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
