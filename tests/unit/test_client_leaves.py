"""``unless_client_leaves`` (app/api/disconnect.py) cancelled from outside, as a drain's deadline
cancels a request's task, just after its work failed: the work's error is retrieved, not logged by
asyncio as "never retrieved"."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from app.api.disconnect import unless_client_leaves
from app.errors import EngineUnavailableError


class StayingClient:
    """A request whose client never leaves (``receive`` waits forever)."""

    async def receive(self) -> dict[str, Any]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}


def test_an_error_of_work_that_ended_as_its_caller_was_cancelled_is_retrieved() -> None:
    unretrieved: list[dict[str, Any]] = []

    async def failing() -> None:
        raise EngineUnavailableError("shut down", code="server_shutting_down")

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, context: unretrieved.append(context))
        outer = asyncio.ensure_future(unless_client_leaves(StayingClient(), failing()))  # type: ignore[arg-type]
        await asyncio.sleep(0)  # it starts the work and waits
        await asyncio.sleep(0)  # the work fails; its caller has not resumed yet
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        del outer
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(scenario())
    gc.collect()
    assert not [c for c in unretrieved if "never retrieved" in str(c.get("message"))], unretrieved
