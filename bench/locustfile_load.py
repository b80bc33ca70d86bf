"""Locust load for ``bench/bench_load.py`` ("Load without loss"): normal requests that must each get
exactly one complete answer, mixed with hostile ones (every 20th request: 5 %) that must each get their
own 4xx.

Normal kinds (streamed or not, at random; ``max_tokens`` 8-16 with ``ignore_eos``):

  text            a text-only prompt
  repeated-image  one PNG of a small fixed pool (the caches hit)
  unique-image    a freshly generated PNG every request (the caches miss, then evict)

One complete answer: streamed, status 200, every event JSON of one completion id until a single
``[DONE]`` that is the last event, exactly one chunk with a ``finish_reason`` (``length``), content, and
``usage.completion_tokens == max_tokens``; not streamed, one choice with ``finish_reason`` ``length``,
content, and the same usage. Hostile kinds, each with the status and error code it must get, are in
``HOSTILE``.

Per kind, the users tally sent / ok / expected 4xx / unexpected and latencies; at test stop the tally
goes as JSON to ``MMSERVE_LOAD_RESULTS`` (if set), with the first unexpected answers verbatim.

Environment (read once, at import):
  MMSERVE_MODEL_NAME       model name sent in requests (default tiny-llava)
  MMSERVE_LOAD_RESULTS     where to write the tally (default: not written)
  MMSERVE_LOAD_BODY_CAP_MB the server's --max-request-body-mb, for the oversized body (default 1)

  locust -f bench/locustfile_load.py --headless -u 32 -r 8 -t 60s --stop-timeout 60 \
      --host http://127.0.0.1:8000
"""

from __future__ import annotations

import base64
import contextlib
import functools
import itertools
import json
import os
import random
import struct
import time
import zlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import gevent
from gevent import GreenletExit
from locust import HttpUser, constant, events, task
from locustfile import CHAT_PATH, IMAGE_PROMPTS, TEXT_PROMPTS, chat_payload, image_pool, unique_image_url
from requests import RequestException

MODEL_NAME = os.environ.get("MMSERVE_MODEL_NAME", "tiny-llava")
RESULTS_PATH = os.environ.get("MMSERVE_LOAD_RESULTS")
BODY_CAP_BYTES = int(float(os.environ.get("MMSERVE_LOAD_BODY_CAP_MB", "1")) * (1 << 20))

IMAGE_SIZE_PX = 336
POOL_SIZE = 4
REQUEST_TIMEOUT_S = 120.0  # an answer slower than this counts as a hang
NUM_KEPT_EXAMPLES = 5


# --- hostile requests: body builder and the (status, code) each must get -------------------------


def pixel_bomb_png(width_px: int = 50_000, height_px: int = 50_000) -> bytes:
    """A PNG whose header declares ``width_px`` x ``height_px`` pixels, with one tiny IDAT: 2.5 Gpx
    promised in 69 bytes. The server must refuse it from the header, before decoding."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width_px, height_px, 8, 2, 0, 0, 0)  # 8-bit RGB
    idat = zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _b64_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _image_body(url: str, **overrides: Any) -> dict[str, Any]:
    body = chat_payload(MODEL_NAME, "Describe this image.", url, max_tokens=8)
    return {**body, **overrides}


def _text_body(**overrides: Any) -> dict[str, Any]:
    return {**chat_payload(MODEL_NAME, "Hello?", max_tokens=8), **overrides}


@functools.cache
def _oversized_body() -> bytes:
    """Valid JSON with an image data URL, a few KiB over the body cap: refused from its Content-Length."""
    return json.dumps(_image_body(_b64_url(bytes(BODY_CAP_BYTES // 4 * 3 + 4096)))).encode()


@dataclass(frozen=True)
class Hostile:
    status: int
    code: str
    body: Any  # () -> dict (sent as JSON) or bytes (sent as is)


HOSTILE: dict[str, Hostile] = {
    "hostile bad-base64": Hostile(
        400, "invalid_image_url", lambda: _image_body("data:image/png;base64,@@@!")
    ),
    "hostile undecodable": Hostile(400, "invalid_image", lambda: _image_body(_b64_url(b"no image here" * 8))),
    "hostile pixel-bomb": Hostile(400, "image_too_large", lambda: _image_body(_b64_url(pixel_bomb_png()))),
    "hostile temperature": Hostile(400, "invalid_value", lambda: _text_body(temperature=5)),
    "hostile n=2": Hostile(400, "invalid_value", lambda: _text_body(n=2)),
    "hostile unknown-model": Hostile(404, "model_not_found", lambda: _text_body(model="no-such-model")),
    "hostile oversized-body": Hostile(413, "request_too_large", _oversized_body),
    # Literal non-public addresses: refused by the URL policy before any connection is made.
    "hostile private-url": Hostile(
        400,
        "image_url_forbidden",
        lambda: _image_body(
            random.choice(("http://10.0.0.1/x.png", "http://169.254.169.254/latest/meta-data/"))
        ),
    ),
}
HOSTILE_KINDS = tuple(HOSTILE)
HOSTILE_EVERY = 20  # 5 %
NORMAL_KINDS = ("text", "repeated-image", "unique-image")
TURNS = itertools.count()  # requests of this locust process, across its users (greenlets)


# --- answer checks (plain functions, no locust) -------------------------------------------------


def check_stream(lines: list[str], max_tokens: int) -> str | None:
    """None if the SSE lines (the whole response, read to its end) are exactly one complete answer."""
    events = [line[len("data:") :].strip() for line in lines if line.startswith("data:")]
    if events.count("[DONE]") != 1 or events[-1] != "[DONE]":
        return f"{events.count('[DONE]')} [DONE] events, last event {events[-1:]!r}"
    chunks = []
    for data in events[:-1]:
        try:
            chunks.append(json.loads(data))
        except json.JSONDecodeError:
            return f"malformed event {data[:200]!r}"
    errors = [c["error"] for c in chunks if c.get("error") is not None]
    if errors:
        return f"error event: {errors[0]}"
    ids = {c.get("id") for c in chunks}
    choices = [choice for c in chunks for choice in c.get("choices") or ()]
    finishes = [choice["finish_reason"] for choice in choices if choice.get("finish_reason")]
    usages = [c["usage"] for c in chunks if c.get("usage")]
    content = "".join((choice.get("delta") or {}).get("content") or "" for choice in choices)
    if len(ids) != 1:
        return f"{len(ids)} completion ids in one stream"
    if finishes != ["length"]:
        return f"finish_reasons {finishes}, expected exactly one 'length'"
    if len(usages) != 1 or usages[0].get("completion_tokens") != max_tokens:
        return f"usage {usages}, expected one with completion_tokens={max_tokens}"
    if not content:
        return "no content"
    return None


def check_completion(answer: dict[str, Any], max_tokens: int) -> str | None:
    """None if a non-streamed answer is exactly one complete choice of ``max_tokens`` tokens."""
    choices = answer.get("choices") or []
    if answer.get("object") != "chat.completion" or len(choices) != 1:
        return f"object {answer.get('object')!r} with {len(choices)} choices"
    if choices[0].get("finish_reason") != "length":
        return f"finish_reason {choices[0].get('finish_reason')!r}, expected 'length'"
    if not (choices[0].get("message") or {}).get("content"):
        return "no content"
    completion_tokens = (answer.get("usage") or {}).get("completion_tokens")
    if completion_tokens != max_tokens:
        return f"usage.completion_tokens {completion_tokens}, expected {max_tokens}"
    return None


# --- tally ----------------------------------------------------------------------------------------


@dataclass
class KindTally:
    sent: int = 0
    ok: int = 0
    expected_4xx: int = 0
    unexpected: int = 0
    cut_off: int = 0  # killed by locust mid-request (must stay 0: users get --stop-timeout to finish)
    completion_tokens: int = 0
    latencies_ms: list[float] = field(default_factory=list)


TALLY: dict[str, KindTally] = defaultdict(KindTally)
UNEXPECTED_EXAMPLES: list[dict[str, Any]] = []


def _unexpected(kind: str, reason: str, status: int | None, text: str) -> str:
    TALLY[kind].unexpected += 1
    if len(UNEXPECTED_EXAMPLES) < NUM_KEPT_EXAMPLES:
        UNEXPECTED_EXAMPLES.append(
            {"kind": kind, "reason": reason, "status": status, "response": text[:2000]}
        )
    return reason


@contextlib.contextmanager
def _sending(kind: str) -> Iterator[None]:
    """Counts a request as sent; one that locust kills before it is settled counts as cut off."""
    TALLY[kind].sent += 1
    t_start_s = time.perf_counter()
    try:
        yield
    except GreenletExit:
        TALLY[kind].cut_off += 1
        elapsed_s = time.perf_counter() - t_start_s
        UNEXPECTED_EXAMPLES.append({"kind": kind, "reason": f"cut off by locust after {elapsed_s:.1f} s"})
        raise


@events.test_stop.add_listener
def _write_results(**_kwargs: Any) -> None:
    if RESULTS_PATH:
        tally = {kind: asdict(t) for kind, t in sorted(TALLY.items())}
        with open(RESULTS_PATH, "w") as f:
            json.dump({"kinds": tally, "unexpected_examples": UNEXPECTED_EXAMPLES}, f, indent=1)


# --- locust ---------------------------------------------------------------------------------------


class LoadUser(HttpUser):
    # The think time is slept inside the task, not as locust's wait_time: a user stopped while in
    # wait_time is killed at once, and that kill can land just after the sleep ended, in the next
    # request (locust 2.47). In the task the user counts as running, so at the stop it finishes the
    # request it is on (--stop-timeout) and a kill can only land in the think time.
    wait_time = constant(0)

    @task
    def one_request(self) -> None:
        """Every ``HOSTILE_EVERY``-th request of the run is hostile (the kinds in turn); the others are
        text, a repeated image or a unique image, at random."""
        gevent.sleep(random.uniform(0.0, 1.0))
        turn = next(TURNS)
        if turn % HOSTILE_EVERY == HOSTILE_EVERY - 1:
            self._hostile(HOSTILE_KINDS[turn // HOSTILE_EVERY % len(HOSTILE_KINDS)])
            return
        kind = random.choice(NORMAL_KINDS)
        if kind == "text":
            self._normal(kind, None, random.choice(TEXT_PROMPTS))
        elif kind == "repeated-image":
            url = random.choice(image_pool(IMAGE_SIZE_PX, POOL_SIZE))
            self._normal(kind, url, random.choice(IMAGE_PROMPTS))
        else:
            self._normal(kind, unique_image_url(IMAGE_SIZE_PX), random.choice(IMAGE_PROMPTS))

    def _hostile(self, kind: str) -> None:
        expected = HOSTILE[kind]
        body = expected.body()
        payload = {"data": body, "headers": {"Content-Type": "application/json"}}
        if not isinstance(body, bytes):
            payload = {"json": body}
        t_start_s = time.perf_counter()
        with (
            _sending(kind),
            self.client.post(
                CHAT_PATH, **payload, catch_response=True, name=kind, timeout=REQUEST_TIMEOUT_S
            ) as resp,
        ):
            TALLY[kind].latencies_ms.append(1e3 * (time.perf_counter() - t_start_s))
            try:
                code = resp.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = None
            if resp.status_code == expected.status and code == expected.code:
                TALLY[kind].expected_4xx += 1
                resp.success()
                return
            reason = f"HTTP {resp.status_code} code {code!r}, expected {expected.status} {expected.code!r}"
            resp.failure(_unexpected(kind, reason, resp.status_code, resp.text))

    def _normal(self, kind: str, image_url: str | None, prompt: str) -> None:
        max_tokens = random.randint(8, 16)
        body = chat_payload(MODEL_NAME, prompt, image_url, max_tokens)
        stream = random.random() < 0.5
        if not stream:
            body = {**body, "stream": False}
            del body["stream_options"]
        name = f"{kind} {'stream' if stream else 'json'}"
        t_start_s = time.perf_counter()
        with (
            _sending(kind),
            self.client.post(
                CHAT_PATH, json=body, stream=stream, catch_response=True, name=name, timeout=REQUEST_TIMEOUT_S
            ) as resp,
        ):
            try:
                text = resp.text  # the whole response: a stream is read to its end
            except RequestException as exc:
                resp.failure(_unexpected(kind, f"reading the answer: {exc!r}", resp.status_code, ""))
                return
            TALLY[kind].latencies_ms.append(1e3 * (time.perf_counter() - t_start_s))
            if resp.error is not None:
                resp.failure(_unexpected(kind, f"no answer: {resp.error!r}", None, ""))
                return
            if resp.status_code != 200:
                resp.failure(_unexpected(kind, f"HTTP {resp.status_code}", resp.status_code, text))
                return
            try:
                problem = (
                    check_stream(text.splitlines(), max_tokens)
                    if stream
                    else check_completion(json.loads(text), max_tokens)
                )
            except ValueError as exc:
                problem = f"unparsable answer: {exc}"
            if problem is not None:
                resp.failure(_unexpected(kind, problem, resp.status_code, text))
                return
            TALLY[kind].ok += 1
            TALLY[kind].completion_tokens += max_tokens
            resp.success()
