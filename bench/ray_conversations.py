"""The load of bench/bench_ray.py: users' conversations about images of their own, each turn a streamed
chat completion that resends the whole history, through ``mmserve ray serve``'s ingress."""

from __future__ import annotations

import asyncio
import json
import random
import time
from itertools import combinations
from typing import Any

import httpx

MAX_TOKENS = 16
REPEAT_SHARE = 0.8  # of all image parts sent, those naming an image sent before
MAX_IMAGES = 4  # images in one request at most (576 tokens each on the tiny LLaVA, 4096 positions)
STAGGER_S = 0.1
REPLICA_HEADER = "x-mmserve-replica"
SAMPLING = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}


def new_image_turns(turns: int) -> tuple[int, ...]:
    """The turns (0-based; always turn 0) that add a new image, so that the share of repeats among the
    image parts sent, each turn resending every image so far, is nearest ``REPEAT_SHARE``; fewest images
    among equals."""
    best: tuple[tuple[float, int], tuple[int, ...]] | None = None
    for count in range(1, min(turns, MAX_IMAGES) + 1):
        for rest in combinations(range(1, turns), count - 1):
            starts = (0, *rest)
            refs = sum(turns - t for t in starts)
            key = (abs(1 - count / refs - REPEAT_SHARE), count)
            if best is None or key < best[0]:
                best = (key, starts)
    assert best is not None
    return best[1]


async def stream_turn(client: httpx.AsyncClient, url: str, body: bytes) -> tuple[float, str, str]:
    """(TTFT s, the answer's text, the replica that answered) of one streamed chat completion."""
    start, ttft, parts = time.perf_counter(), None, []
    async with client.stream("POST", url, content=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"request failed: {resp.status_code} {(await resp.aread())[:300]!r}")
        replica = resp.headers.get(REPLICA_HEADER, "?")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"request failed mid-stream: {chunk['error']}")
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    ttft = time.perf_counter() - start if ttft is None else ttft
                    parts.append(content)
    return ttft if ttft is not None else time.perf_counter() - start, "".join(parts), replica


def user_message(tag: str, turn: int, image: str | None) -> dict[str, Any]:
    text = f"{tag}, turn {turn + 1}: " + (
        "here is a new picture. What does it show?" if image else "look again: what else do you see?"
    )
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    return {"role": "user", "content": content}


async def conversation(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    user: int,
    images: dict[int, str],
    turns: int,
    delay_s: float,
    think_s: float,
) -> list[tuple[float, str]]:
    """One user's turns, the first after ``delay_s``: ``images`` maps a turn to the new image it adds.
    Between turns the user pauses a uniform random time in [0, 2 * ``think_s``] (seeded by ``user``).
    (TTFT s, replica) of each turn."""
    await asyncio.sleep(delay_s)
    rng = random.Random(user)
    tag = f"{rng.getrandbits(32):08x}"  # no text prefix shared with another user
    messages: list[dict[str, Any]] = []
    figures = []
    for turn in range(turns):
        if turn and think_s:
            await asyncio.sleep(rng.uniform(0.0, 2.0 * think_s))
        messages.append(user_message(tag, turn, images.get(turn)))
        body = json.dumps({"model": model, "messages": messages, **SAMPLING}).encode()
        ttft_s, answer, replica = await stream_turn(client, url, body)
        messages.append({"role": "assistant", "content": answer})
        figures.append((ttft_s, replica))
    return figures


def run_load(
    base_url: str,
    model: str,
    images: list[dict[int, str]],
    turns: int,
    think_s: float = 0.0,
    first_user: int = 0,
) -> tuple[float, list[list[tuple[float, str]]]]:
    """Every user at once (user i starting ``i * STAGGER_S`` after the first), numbered from
    ``first_user`` (which picks their text): (wall s, each user's turns)."""

    async def everyone() -> tuple[float, list[list[tuple[float, str]]]]:
        limits = httpx.Limits(max_connections=len(images), max_keepalive_connections=len(images))
        async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
            url = f"{base_url}/v1/chat/completions"
            start = time.perf_counter()
            runs = await asyncio.gather(
                *(
                    conversation(client, url, model, first_user + i, own, turns, i * STAGGER_S, think_s)
                    for i, own in enumerate(images)
                )
            )
            return time.perf_counter() - start, runs

    return asyncio.run(everyone())
