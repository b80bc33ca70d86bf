"""Fewer, larger items on a streamed answer's Ray hops (docs/architecture.md, "Replicas on Ray Serve").

Each item a replica yields crosses two Ray hops (replica → ingress → Ray's HTTP proxy), and each costs
Ray CPU there, whatever its size: about a millisecond a hop on the 2-core development machine, where
streamed answers of 16 tokens cost the ingress and proxy twice what the same answers cost unstreamed.
So a replica relays an SSE stream's first ``AT_ONCE`` chunks as they come, and after them at most one
item per interval, holding what arrives in between and sending it joined. Five cover either stream's
opening and its first token (chat: the role chunk, then the first delta; the Responses API:
``response.created``, ``response.in_progress``, ``output_item.added`` and ``content_part.added``, then the
first delta), so time to first token is untouched. Ray Serve LLM batches its streams the same way (every 50 ms
by default, its ``stream_batching_interval_ms``), from the first token on. The bytes are the
instance's, in order, unchanged; only where one item ends moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

AT_ONCE = 5  # chunks relayed as they come before the interval applies
DEFAULT_INTERVAL_S = 0.05  # Ray Serve LLM's default


@dataclass(frozen=True)
class _End:
    error: Exception | None = None  # what ended the source, re-raised after the chunks before it


async def batched(
    chunks: AsyncIterator[bytes], interval_s: float, at_once: int = AT_ONCE
) -> AsyncGenerator[bytes, None]:
    """``chunks``, the first ``at_once`` of them as they come and then at most one item per
    ``interval_s`` (each what arrived since the last, joined); a chunk that arrives after a quiet
    interval goes at once, and so does the rest once ``chunks`` ends. An error from ``chunks`` is raised
    after the chunks that came before it. ``interval_s`` 0: every chunk as it comes."""
    if interval_s <= 0:
        async for chunk in chunks:
            yield chunk
        return
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes | _End] = asyncio.Queue()
    ended = asyncio.Event()
    reader = asyncio.create_task(_read(chunks, queue, ended))
    try:
        sent, last_sent = 0, -math.inf
        while True:
            item = await queue.get()
            wait_s = last_sent + interval_s - loop.time()
            if sent >= at_once and wait_s > 0 and not ended.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ended.wait(), wait_s)  # the interval, or the source's end
            parts = []
            while not isinstance(item, _End):
                parts.append(item)
                if queue.empty():
                    break
                item = queue.get_nowait()
            if parts:
                yield b"".join(parts)
                sent, last_sent = sent + 1, loop.time()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def _read(
    chunks: AsyncIterator[bytes], queue: asyncio.Queue[bytes | _End], ended: asyncio.Event
) -> None:
    end = _End()
    try:
        async for chunk in chunks:
            queue.put_nowait(chunk)
    except Exception as exc:
        end = _End(exc)
    queue.put_nowait(end)
    ended.set()
