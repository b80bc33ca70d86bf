"""Locust load for mmserve: streaming chat completions of three kinds.

  text      a text-only prompt
  unique    a freshly generated PNG every request (cold path: processor, IPC payload, encoder run)
  repeated  one PNG of a small fixed pool, sent again and again (warm path: the caches should hit)

Every request streams (``stream: true`` with ``stream_options.include_usage``). Besides locust's own
POST row (which, for a streamed response, times only the response headers) each request records two
custom rows under the same name:

  TTFT  send -> first chunk carrying content;            response_length = completion tokens
  E2E   send -> ``[DONE]``;                              response_length = completion tokens

A request fails on a non-200 status, an error chunk in the stream, a stream without ``[DONE]`` or
without the usage chunk.

Environment (read once, at import):
  MMSERVE_MODEL_NAME        model name sent in requests (default tiny-llava, the model folder's name)
  MMSERVE_BENCH_IMAGE_SIZE  side of the generated square PNGs in pixels (default 336)
  MMSERVE_BENCH_POOL_SIZE   images in the repeated pool (default 4)
  MMSERVE_BENCH_MAX_TOKENS  max_tokens per request, sent with ignore_eos (default 32)

  locust -f bench/locustfile.py --host http://127.0.0.1:8000
  locust -f bench/locustfile.py --host http://127.0.0.1:8000 --headless -u 16 -r 4 -t 1m
"""

from __future__ import annotations

import base64
import functools
import io
import json
import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from locust import HttpUser, between, task
from PIL import Image, ImageDraw

MODEL_NAME = os.environ.get("MMSERVE_MODEL_NAME", "tiny-llava")
IMAGE_SIZE_PX = int(os.environ.get("MMSERVE_BENCH_IMAGE_SIZE", "336"))
POOL_SIZE = int(os.environ.get("MMSERVE_BENCH_POOL_SIZE", "4"))
MAX_TOKENS = int(os.environ.get("MMSERVE_BENCH_MAX_TOKENS", "32"))

CHAT_PATH = "/v1/chat/completions"
TEXT_PROMPTS = (
    "Write a haiku about caching.",
    "Explain continuous batching in one paragraph.",
    "List three uses of a vision-language model.",
    "What is the capital of France?",
)
IMAGE_PROMPTS = (
    "Describe this image.",
    "What shapes and colours do you see?",
    "Is there anything unusual in this picture?",
)


# --- payload builders (plain functions, no locust) ----------------------------------------------


def make_png(size_px: int, seed: int) -> bytes:
    """A ``size_px`` square PNG of random coloured shapes, fully determined by ``seed``.

    Shapes rather than per-pixel noise: the PNG stays small, so the benchmark measures the server,
    not base64 of incompressible bytes.
    """
    rng = random.Random(seed)
    image = Image.new("RGB", (size_px, size_px), _rand_colour(rng))
    draw = ImageDraw.Draw(image)
    for _ in range(8):
        x0, x1 = sorted(rng.randrange(size_px) for _ in range(2))
        y0, y1 = sorted(rng.randrange(size_px) for _ in range(2))
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((x0, y0, x1, y1), fill=_rand_colour(rng))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _rand_colour(rng: random.Random) -> tuple[int, int, int]:
    return (rng.randrange(256), rng.randrange(256), rng.randrange(256))


def png_data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def unique_image_url(size_px: int) -> str:
    """A data URL of an image no earlier request sent (63 random bits of seed)."""
    return png_data_url(make_png(size_px, random.getrandbits(63)))


@functools.cache
def image_pool(size_px: int, pool_size: int) -> tuple[str, ...]:
    """The fixed pool of data URLs the repeated-image task draws from (seeds 0..pool_size-1)."""
    return tuple(png_data_url(make_png(size_px, seed)) for seed in range(pool_size))


def chat_payload(model: str, text: str, image_url: str | None = None, max_tokens: int = 32) -> dict[str, Any]:
    """A streaming OpenAI chat request; the image, if any, comes before the text as in most VLM prompts."""
    content: str | list[dict[str, Any]]
    if image_url is None:
        content = text
    else:
        content = [
            {"type": "image_url", "image_url": {"url": image_url}},
            {"type": "text", "text": text},
        ]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        # Fixed output length, so the kinds differ only in their input path.
        "ignore_eos": True,
        "temperature": 0.0,
    }


# --- SSE parsing (plain function, no locust) ----------------------------------------------------


@dataclass
class StreamResult:
    ttft_s: float | None = None
    text: str = ""
    usage: dict[str, Any] | None = None
    done: bool = False
    error: str | None = None

    @property
    def completion_tokens(self) -> int:
        return int((self.usage or {}).get("completion_tokens", 0))


def read_sse(
    lines: Iterable[bytes | str], t_start_s: float, clock: Callable[[], float] = time.perf_counter
) -> StreamResult:
    """Consume an OpenAI chat-completion SSE stream line by line.

    TTFT is taken when the first chunk with non-empty ``delta.content`` arrives (the leading
    role-only chunk does not count). Stops at ``[DONE]`` or at the first error chunk.
    """
    result = StreamResult()
    for raw in lines:
        line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        if not line.startswith("data:"):
            continue  # blank event separators, ": keep-alive" comments
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            result.done = True
            break
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            result.error = f"malformed SSE data: {data[:200]!r}"
            break
        if chunk.get("error") is not None:
            error = chunk["error"]
            result.error = str(error.get("message", error)) if isinstance(error, dict) else str(error)
            break
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                if result.ttft_s is None:
                    result.ttft_s = clock() - t_start_s
                result.text += content
        if chunk.get("usage"):
            result.usage = chunk["usage"]
    if result.error is None:
        if not result.done:
            result.error = "stream ended without [DONE]"
        elif result.usage is None:
            result.error = "no usage chunk despite stream_options.include_usage"
    return result


# --- locust -------------------------------------------------------------------------------------


class ChatUser(HttpUser):
    wait_time = between(0.0, 1.0)

    @task(2)
    def text_only(self) -> None:
        self._chat("text", chat_payload(MODEL_NAME, random.choice(TEXT_PROMPTS), max_tokens=MAX_TOKENS))

    @task(1)
    def unique_image(self) -> None:
        url = unique_image_url(IMAGE_SIZE_PX)
        self._chat("unique-image", chat_payload(MODEL_NAME, random.choice(IMAGE_PROMPTS), url, MAX_TOKENS))

    @task(2)
    def repeated_image(self) -> None:
        url = random.choice(image_pool(IMAGE_SIZE_PX, POOL_SIZE))
        self._chat("repeated-image", chat_payload(MODEL_NAME, random.choice(IMAGE_PROMPTS), url, MAX_TOKENS))

    def _chat(self, kind: str, payload: dict[str, Any]) -> None:
        name = f"chat {kind}"
        t_start_s = time.perf_counter()
        with self.client.post(CHAT_PATH, json=payload, stream=True, catch_response=True, name=name) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:300]}")
                return
            result = read_sse(resp.iter_lines(), t_start_s)
            e2e_s = time.perf_counter() - t_start_s
            resp.close()  # an error chunk stops reading early; give the connection back either way
            if result.error is not None:
                resp.failure(result.error)
                return
            resp.success()
        if result.ttft_s is not None:
            self._record("TTFT", name, result.ttft_s, result.completion_tokens)
        self._record("E2E", name, e2e_s, result.completion_tokens)

    def _record(self, request_type: str, name: str, seconds: float, response_length: int) -> None:
        self.environment.events.request.fire(
            request_type=request_type,
            name=name,
            response_time=seconds * 1000.0,
            response_length=response_length,
            exception=None,
            context={},
        )
