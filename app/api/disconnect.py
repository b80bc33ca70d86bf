"""Work done for a request, abandoned the moment its client leaves (docs/api.md: "A client that
disconnects, streaming or not, has its request aborted in the engine").

The body was read before the route ran, so the server's next ASGI message for the request is the
disconnect, and waiting for it costs nothing: no polling. Until an answer starts, the endpoints run
their work (preparing and submitting the request, collecting a non-streamed answer) through
``unless_client_leaves``; once a streamed answer starts, Starlette's ``StreamingResponse`` watches.
``ClientLeft`` becomes a bodiless 499 (app/api/error_handlers.py), which nobody reads."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request

CLIENT_CLOSED_REQUEST = 499  # nginx's "client closed request"

T = TypeVar("T")


class ClientLeft(Exception):
    """The client disconnected before its answer started: the work for it was cancelled."""


async def unless_client_leaves(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result, or ``ClientLeft`` when the client left first: then ``work`` was cancelled and
    its cleanup has run (a request sent to the engine is aborted there). ``work``'s exceptions
    propagate."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let its cleanup run before returning
        elif not task.cancelled():
            task.exception()  # (retrieved: leaving on a cancellation of our own, its error is moot)
    if task.cancelled():
        raise ClientLeft
    return task.result()


async def until_disconnect(request: Request) -> None:
    """Returns when the client has gone (the request's body must have been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
