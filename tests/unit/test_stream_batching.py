"""A replica's SSE answer on Ray's hops (app/ray_serve/stream_batching.py): the first chunks go as they
come, later ones at most one item per interval, joined; the bytes and their order are the source's, an
error comes after what preceded it, and closing the items early stops the source. Real asyncio time,
bounded from below only (a sleep never ends early), so a loaded machine cannot fail these."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator

import pytest

from app.ray_serve.stream_batching import batched

SOON_S = 5.0  # "at once": well before this (an upper bound for a busy machine)


class Fed:
    """A source the test feeds chunk by chunk."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | Exception | None] = asyncio.Queue()
        self.closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            while (item := await self.queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.closed = True


async def next_within(items: AsyncIterator[bytes], timeout_s: float) -> bytes:
    return await asyncio.wait_for(items.__anext__(), timeout_s)


def test_the_first_chunks_go_at_once_and_later_ones_once_per_interval_joined() -> None:
    interval_s = 0.5

    async def scenario() -> None:
        fed = Fed()
        items = batched(fed.chunks(), interval_s, at_once=2)
        fed.queue.put_nowait(b"role ")
        assert await next_within(items, SOON_S) == b"role "
        fed.queue.put_nowait(b"first ")
        assert await next_within(items, SOON_S) == b"first "
        second_sent = time.monotonic()
        fed.queue.put_nowait(b"x ")
        await asyncio.sleep(0.1)
        fed.queue.put_nowait(b"y ")
        assert await next_within(items, interval_s + SOON_S) == b"x y "  # held for the interval, joined
        assert time.monotonic() - second_sent >= interval_s * 0.99
        fed.queue.put_nowait(None)
        with pytest.raises(StopAsyncIteration):
            await next_within(items, SOON_S)

    asyncio.run(scenario())


def test_the_bytes_and_their_order_are_the_sources_in_fewer_items() -> None:
    rng = random.Random(7)
    chunks = [rng.randbytes(rng.randint(1, 300)) for _ in range(60)]

    async def source() -> AsyncIterator[bytes]:
        for chunk in chunks:
            await asyncio.sleep(0.001)
            yield chunk

    async def scenario() -> list[bytes]:
        return [item async for item in batched(source(), 0.02)]

    items = asyncio.run(scenario())
    assert b"".join(items) == b"".join(chunks)
    assert len(items) < len(chunks) // 2  # 60 chunks over at least 60 ms, at most one item per 20 ms after 2


def test_an_interval_of_zero_relays_every_chunk_as_it_is() -> None:
    chunks = [b"a", b"bc", b"", b"d"]

    async def source() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    async def scenario() -> list[bytes]:
        return [item async for item in batched(source(), 0)]

    assert asyncio.run(scenario()) == chunks


def test_an_error_comes_after_the_chunks_before_it() -> None:
    async def scenario() -> None:
        fed = Fed()
        items = batched(fed.chunks(), 10.0, at_once=1)
        fed.queue.put_nowait(b"a")
        assert await next_within(items, SOON_S) == b"a"
        for item in (b"b", b"c", ConnectionResetError("gone")):
            fed.queue.put_nowait(item)
        started = time.monotonic()
        assert await next_within(items, SOON_S) == b"bc"  # the end does not wait for the interval
        assert time.monotonic() - started < SOON_S
        with pytest.raises(ConnectionResetError, match="gone"):
            await next_within(items, SOON_S)

    asyncio.run(scenario())


def test_closing_the_items_early_stops_the_source() -> None:
    async def scenario() -> None:
        fed = Fed()
        items = batched(fed.chunks(), 10.0)
        fed.queue.put_nowait(b"head")
        assert await next_within(items, SOON_S) == b"head"
        fed.queue.put_nowait(b"held")  # waits for an item the client will not take
        await items.aclose()
        assert fed.closed  # the reader was cancelled and awaited: the source's own cleanup ran

    asyncio.run(scenario())
