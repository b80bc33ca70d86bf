"""Bad videos on a real server (tiny Qwen2.5-VL): each gets its own 400 code, naming the message part, in
a few seconds; nothing else is disturbed (the same process serves on, a good video still answers); a
model without video (LLaVA) names what it takes. How each file is made: tests/video_clips.py."""

from __future__ import annotations

import base64
import http.server
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests import video_clips as clips
from tests.e2e.server import Server
from tests.video_clips import image_bytes, make_clip

pytestmark = pytest.mark.slow

FAMILY = "qwen2_5_vl"
PARAM = "messages[0].content[0].video_url.url"
REFUSAL_S = 5.0
GOOD = make_clip(width=96, height=64, fps=10, num_frames=20, seed=5)


def clip(codec: str = "h264", container: str = "mp4", **options: Any) -> bytes:
    return make_clip(codec=codec, container=container, width=64, height=48, **options)


def chat(url: str, model: str = f"tiny-{FAMILY}", **options: Any) -> dict[str, Any]:
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
        "mm_processor_kwargs": options,
    }


def data_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def cut(data: bytes) -> bytes:
    return data[: len(data) * 6 // 10]


BAD = {
    "truncated": (lambda: cut(clip()), "video_truncated"),
    "not a video": (lambda: b"this is text, not a video " * 40, "invalid_video"),
    "an image": (lambda: image_bytes("PNG"), "video_is_an_image"),
    "another container": (lambda: clip(container="avi"), "unsupported_video_format"),
    "another codec": (lambda: clip("mpeg4", "mp4"), "unsupported_video_codec"),
    "no video stream": (lambda: clips.audio_only_mp4(), "video_stream_missing"),
    "zero frames": (lambda: clips.mp4_without_samples(clips.mp4_index_first(clip())), "video_empty"),
    "20000x20000": (
        lambda: clips.mp4_claiming_size(clips.mp4_index_first(clip("vp9", "mp4")), 20000, 20000),
        "video_dimensions_too_large",
    ),
    "a million frames": (
        lambda: clips.mp4_claiming_frames(clips.mp4_index_first(clip()), 1_000_000),
        "video_too_long",
    ),
    "variable frame rate": (
        lambda: clip(num_frames=12, pts=[0, 100, 200, 400, 500, 800, 900, 1000, 1300, 1400, 1500, 1600]),
        "video_variable_frame_rate",
    ),
    "rotated": (lambda: clip(num_frames=10, rotation_degrees=90), "video_rotated"),
    # the model's own sampling needs a temporal patch (2 frames): the clip's fault, not the request's
    "one frame": (lambda: clip(num_frames=1), "video_too_short"),
    "1000 x 4 pixels": (
        lambda: make_clip(width=1000, height=4, num_frames=4),
        "video_aspect_ratio_too_large",
    ),
}


@pytest.fixture(scope="module")
def qwen(family_server: Callable[..., Server]) -> Server:
    return family_server(FAMILY)


def refused(server: Server, payload: dict[str, Any]) -> dict[str, Any]:
    start = time.monotonic()
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=60)
    elapsed = time.monotonic() - start
    assert resp.status_code == 400, resp.text
    assert elapsed < REFUSAL_S, f"took {elapsed:.1f} s"
    return dict(resp.json()["error"])


def assert_serves_on(server: Server, pid_before: int) -> None:
    assert server.process.proc is not None and server.process.proc.pid == pid_before
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat(data_url(GOOD)), timeout=120)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_video_gets_its_own_400_in_seconds(qwen: Server, kind: str) -> None:
    make, code = BAD[kind]
    assert qwen.process.proc is not None
    pid = qwen.process.proc.pid
    error = refused(qwen, chat(data_url(make())))
    assert (error["code"], error["param"], error["type"]) == (code, PARAM, "invalid_request_error")
    assert_serves_on(qwen, pid)


def test_sampling_over_the_frame_cap_and_options_that_conflict(qwen: Server) -> None:
    long_clip = clip(num_frames=300, fps=30)  # 10 s
    error = refused(qwen, chat(data_url(long_clip), fps=30))  # 300 frames > --max-video-frames 64
    assert error["code"] == "too_many_video_frames" and "--max-video-frames" in error["message"]
    assert error["param"] == "mm_processor_kwargs"
    error = refused(qwen, chat(data_url(GOOD), fps=2, num_frames=4))
    assert error["param"] == "mm_processor_kwargs" and "exclusive" in error["message"]
    error = refused(qwen, chat(data_url(GOOD), fps="fast"))
    assert error["param"] == "mm_processor_kwargs"


@pytest.fixture(scope="module")
def huge_video_url() -> Iterator[str]:
    """A loopback URL whose response claims 300 MB (over the 256 MB --max-video-bytes) and sends none."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            self.send_response(200)
            self.send_header("Content-Type", "video/mp4")
            self.send_header("Content-Length", str(300 << 20))
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/huge.mp4"
    finally:
        httpd.shutdown()


def test_urls_that_cannot_be_a_video(qwen: Server, huge_video_url: str) -> None:
    error = refused(qwen, chat(huge_video_url))
    assert error["code"] == "video_too_large" and str(256 << 20) in error["message"]
    error = refused(qwen, chat("data:image/png;base64," + base64.b64encode(image_bytes("PNG")).decode()))
    assert error["code"] == "invalid_video_url" and "video/" in error["message"]
    error = refused(qwen, chat("ftp://example.com/a.mp4"))
    assert error["code"] == "invalid_video_url"


def test_a_model_without_video_says_what_it_takes(server: Server) -> None:
    error = refused(server, chat(data_url(GOOD), model="tiny-llava"))
    assert error["code"] == "unsupported_modality" and "text and images" in error["message"]
    assert error["param"] == "messages[0].content[0]"


def test_more_videos_than_the_limit_are_refused_before_any_is_fetched(qwen: Server) -> None:
    payload = chat(data_url(GOOD))
    video = payload["messages"][0]["content"][0]
    payload["messages"][0]["content"] = [video] * 5 + payload["messages"][0]["content"][1:]  # default 4
    error = refused(qwen, payload)
    assert error["code"] == "mm_limit_exceeded" and "video=4" in error["message"]
    assert error["param"] == "messages"
