"""A request's engine outputs as the API consumes them: outputs that queued up while it was busy come out
merged (tokens and logprobs in order, the last one's finish reason); a failure is never merged away."""

from __future__ import annotations

import asyncio

import pytest

from app.api.outputs import request_outputs
from app.errors import EngineUnavailableError, MMServeError
from app.inputs.engine_client import EngineGone
from wire.protocol import ErrorInfo, Logprob, RequestOutput, TokenLogprobs


def out(*tokens: int, finish: str | None = None, logprobs: bool = False) -> RequestOutput:
    lps = [TokenLogprobs(Logprob(t, -float(t)), []) for t in tokens] if logprobs else None
    return RequestOutput("r", list(tokens), lps, finish_reason=finish)


async def consume(first: RequestOutput, queued: list, after: list | None = None) -> list:
    """What ``request_outputs`` yields with ``queued`` waiting from the start and ``after`` coming later."""
    queue: asyncio.Queue = asyncio.Queue()
    for item in queued:
        queue.put_nowait(item)
    got = []

    async def late() -> None:
        await asyncio.sleep(0.01)
        for item in after or []:
            queue.put_nowait(item)

    feeder = asyncio.create_task(late())
    async for item in request_outputs(first, queue):
        got.append(item)
    await feeder
    return got


def test_queued_outputs_come_out_as_one():
    got = asyncio.run(consume(out(1), [out(2), out(3), out(4)], [out(5, finish="length")]))
    assert [o.new_token_ids for o in got] == [[1], [2, 3, 4], [5]]
    assert got[-1].finish_reason == "length"


def test_merged_outputs_keep_logprobs_in_order_and_the_finish_reason():
    got = asyncio.run(consume(out(1), [out(2, logprobs=True), out(3, 4, logprobs=True, finish="stop")]))
    assert got[1].new_token_ids == [2, 3, 4]
    assert [lp.sampled.token_id for lp in got[1].logprobs] == [2, 3, 4]
    assert got[1].finish_reason == "stop"


def test_nothing_is_read_past_the_finish():
    got = asyncio.run(consume(out(1), [out(2, finish="length"), out(99)]))
    assert [o.new_token_ids for o in got] == [[1], [2]]


def test_a_failure_after_queued_outputs_is_raised_after_them():
    failure = RequestOutput("r", error=ErrorInfo("the worker failed", "internal_error", 500))
    got: list = []

    async def run() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        for item in (out(2), out(3), failure):
            queue.put_nowait(item)
        async for item in request_outputs(out(1), queue):
            got.append(item)

    with pytest.raises(MMServeError):
        asyncio.run(run())
    assert [o.new_token_ids for o in got] == [[1], [2, 3]]


def test_the_engine_going_away_is_raised_after_queued_outputs():
    got: list = []

    async def run() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        for item in (out(2), EngineGone("the engine stopped")):
            queue.put_nowait(item)
        async for item in request_outputs(out(1), queue):
            got.append(item)

    with pytest.raises(EngineUnavailableError):
        asyncio.run(run())
    assert [o.new_token_ids for o in got] == [[1], [2]]
