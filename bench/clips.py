"""Video clips the benchmarks send, made with PyAV: a bright disc moving over a colour gradient that
depends on ``seed`` (different seeds, different bytes and pictures), H.264 in MP4."""

from __future__ import annotations

import io
from functools import cache

import av
import numpy as np


@cache
def moving_clip(*, seed: int, seconds: int = 10, width: int = 640, height: int = 360, fps: int = 30) -> bytes:
    rng = np.random.default_rng(seed)
    base = np.zeros((height, width, 3), np.uint8)
    base[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    base[..., 1] = np.linspace(0, 255, height, dtype=np.uint8)[:, None]
    base[..., 2] = rng.integers(0, 256)
    ys, xs = np.ogrid[:height, :width]
    speed = rng.uniform(2, 6, size=2)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps, options={"preset": "ultrafast", "g": str(fps)})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(seconds * fps):
            frame = base.copy()
            cx, cy = (speed[0] * i) % width, (speed[1] * i) % height
            frame[(xs - cx) ** 2 + (ys - cy) ** 2 < 40**2] = 255
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode(None))
    return buf.getvalue()
