"""The loads of bench/bench_engine.py: request bodies, a client that keeps N streamed completions in flight
for a bounded time, and each load's figures (requests/s, output tokens/s, TTFT quantiles, the worker's busy
time from ``/metrics`` deltas)."""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from bench_throughput import chat_body

POOL_SIZE = 8  # images that reused-image requests draw from
AB_CONCURRENCY, AB_MAX_TOKENS = 16, 16  # parts a) and b)
C_LEVELS, C_MAX_TOKENS = (1, 16, 64), 64  # part c)
USAGE = re.compile(r'"usage":\s*\{')
BUSY_COUNTER = "mmserve_worker_busy_seconds_total"
ENCODER_SUM = "mmserve_encoder_seconds_sum"


@dataclass(frozen=True)
class Load:
    key: str  # "a", "b-image", "c-text-64", ...
    kind: str  # "reuse90" | "reuse100" | "text"
    concurrency: int
    max_tokens: int
    busy: bool = False  # part d) reads the worker's busy time around it


def loads_of(parts: set[str]) -> list[Load]:
    loads = []
    if "a" in parts:
        loads.append(Load("a", "reuse90", AB_CONCURRENCY, AB_MAX_TOKENS, busy=True))
    if "b" in parts:
        loads += [
            Load("b-image", "reuse100", AB_CONCURRENCY, AB_MAX_TOKENS),
            Load("b-text", "text", AB_CONCURRENCY, AB_MAX_TOKENS),
        ]
    if "c" in parts:
        for c in C_LEVELS:
            for kind, name in (("text", "text"), ("reuse100", "image")):
                loads.append(Load(f"c-{name}-{c}", kind, c, C_MAX_TOKENS, busy=c == max(C_LEVELS)))
    return loads


@dataclass
class Answer:
    new_image: bool
    ttft_s: float | None = None
    completion_tokens: int = 0
    error: str | None = None
    e2e_s: float | None = None  # request sent -> stream ended

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


async def one_request(client: httpx.AsyncClient, url: str, body: bytes, answer: Answer) -> None:
    """Streams one completion into ``answer``; any failure becomes ``answer.error``."""
    start = time.perf_counter()
    async with client.stream("POST", url, content=body, headers={"content-type": "application/json"}) as r:
        if r.status_code != 200:
            await r.aread()
            answer.error = f"HTTP {r.status_code}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: {") or (answer.ttft_s is not None and not USAGE.search(line)):
                continue  # after the first content, only the usage chunk is parsed
            chunk = json.loads(line[6:])
            if answer.ttft_s is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                answer.ttft_s = time.perf_counter() - start
            if chunk.get("usage"):
                answer.completion_tokens = chunk["usage"]["completion_tokens"]
    answer.e2e_s = time.perf_counter() - start
    if answer.ttft_s is None:
        answer.error = "no content"


@dataclass
class Result:
    """One load on one server."""

    wall_s: float
    answers: list[Answer]
    max_tokens: int
    busy_s: float | None = None
    busy_source: str = "n/a: /metrics has neither the busy counter nor a forward-time histogram"
    encoder_s: float | None = None

    def __post_init__(self) -> None:
        for a in self.answers:  # ignore_eos: anything shorter is wrong
            if a.error is None and a.completion_tokens != self.max_tokens:
                a.error = f"{a.completion_tokens} tokens"

    @property
    def ok(self) -> list[Answer]:
        return [a for a in self.answers if a.error is None]

    @property
    def req_per_s(self) -> float:
        return len(self.ok) / self.wall_s

    @property
    def tok_per_s(self) -> float:
        return sum(a.completion_tokens for a in self.ok) / self.wall_s

    def ttft_ms(self, quantile: int, new_image: bool | None = None) -> float | None:
        values = [
            1e3 * a.ttft_s for a in self.ok if a.ttft_s is not None and new_image in (None, a.new_image)
        ]
        if len(values) < 2:
            return values[0] if values else None
        return statistics.quantiles(values, n=100, method="inclusive")[quantile - 1]

    def busy_fraction(self) -> float | None:
        return None if self.busy_s is None else self.busy_s / self.wall_s

    def failures(self) -> str:
        bad = Counter(a.error for a in self.answers if a.error is not None)
        return ", ".join(f"{n}x {what}" for what, n in bad.most_common()) or "0"

    def to_json(self) -> dict[str, object]:
        return {
            "wall_s": self.wall_s,
            "num_requests": len(self.answers),
            "num_ok": len(self.ok),
            "num_new_images": sum(a.new_image for a in self.ok),
            "failures": self.failures(),
            "max_tokens": self.max_tokens,
            "req_per_s": self.req_per_s,
            "output_tok_per_s": self.tok_per_s,
            "ttft_ms": {f"p{q}": self.ttft_ms(q) for q in (50, 90)},
            "ttft_ms_new_image_p50": self.ttft_ms(50, True),
            "ttft_ms_pool_image_p50": self.ttft_ms(50, False),
            "worker_busy_fraction": self.busy_fraction(),
            "worker_busy_source": self.busy_source,
            "encoder_seconds": self.encoder_s,
        }


class Requests:
    """The request bodies of every load: the same for every server (``reset`` before each)."""

    def __init__(self, model: str, pool: list[str], new: list[str], warmup: list[str]) -> None:
        self.model, self.pool, self.new, self.warmup = model, pool, new, warmup
        self.reset()

    def reset(self) -> None:
        self.serial = 0  # texts are numbered through a server's whole run: no two prompts are equal

    def body(self, load: Load, i: int, warmup: bool = False) -> tuple[bytes, bool]:
        """Request ``i`` of ``load`` (or of its warm-up): (JSON body, whether its image is never-seen)."""
        self.serial += 1
        text = f"{'Warm-up' if warmup else 'Request'} {self.serial}: what does this picture show?"
        image, is_new = None, False
        if load.kind == "reuse90" and i % 10 == 5:
            source = self.warmup if warmup else self.new
            image, is_new = source[i // 10 % len(source)], True
        elif load.kind != "text":  # a pool image, drawn the same way on every server
            image = self.pool[random.Random(f"{load.key} {warmup} {i}").randrange(len(self.pool))]
        return json.dumps(chat_body(self.model, text, image, load.max_tokens)).encode(), is_new

    def pool_bodies(self) -> Iterator[tuple[bytes, bool]]:
        """Every pool image once: sent before the first load."""
        for url in self.pool:
            yield json.dumps(chat_body(self.model, "Describe it.", url, AB_MAX_TOKENS)).encode(), False


async def send(
    base_url: str, bodies: Iterator[tuple[bytes, bool]], concurrency: int, duration_s: float
) -> tuple[float, list[Answer]]:
    """Sends ``bodies``, ``concurrency`` in flight, none started after ``duration_s``; (wall s, answers)."""
    url, answers = f"{base_url}/v1/chat/completions", []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0), limits=limits) as client:
        start = time.perf_counter()
        deadline = start + duration_s

        async def lane() -> None:
            for body, is_new in bodies:
                answers.append(answer := Answer(is_new))
                try:
                    await one_request(client, url, body, answer)
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    answer.error = type(exc).__name__
                if time.perf_counter() >= deadline:
                    return

        await asyncio.gather(*(lane() for _ in range(concurrency)))
        return time.perf_counter() - start, answers


def histogram_delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def worker_busy(before: dict[str, float], after: dict[str, float], result: Result) -> None:
    """Part d): the busy counter where the server has it, else encoder + forward histograms, else n/a."""
    if ENCODER_SUM in after:
        result.encoder_s = histogram_delta(before, after, ENCODER_SUM)
    forward = [n for n in after if n.startswith("mmserve_") and "forward" in n and n.endswith("_seconds_sum")]
    if BUSY_COUNTER in after:
        result.busy_s, result.busy_source = histogram_delta(before, after, BUSY_COUNTER), BUSY_COUNTER
    elif result.encoder_s is not None and forward:
        result.busy_s = result.encoder_s + histogram_delta(before, after, forward[0])
        result.busy_source = f"mmserve_encoder_seconds + {forward[0].removesuffix('_sum')}"
