"""What a client does with a stored response by its id (docs/api.md, "Stored responses" and "Background
responses"): ``GET`` it (or, a streamed background one, its events again), list its input items,
``DELETE`` it, cancel it; and the store's figures on /metrics."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from app.api.request_guards import request_tenant
from app.api.response_items import IMAGE_URLS, input_items, page
from app.api.response_store import ResponseStore, StoredResponse
from app.api.responses_api_schemas import INCLUDABLE, LOGPROBS
from app.api.responses_background import BackgroundResponses
from app.errors import InvalidRequestError, NotFoundError
from app.metrics import ApiMetrics


class StoredResponses:
    def __init__(self, store: ResponseStore, background: BackgroundResponses, metrics: ApiMetrics) -> None:
        self.store = store
        self.background = background
        self.metrics = metrics

    async def retrieve(self, response_id: str, raw: Request) -> dict[str, Any]:
        return (await self.stored(response_id, raw)).response

    async def list_input_items(
        self, response_id: str, raw: Request, after: str | None, limit: int, order: Literal["asc", "desc"]
    ) -> dict[str, Any]:
        """``GET /v1/responses/{id}/input_items``: the items the response was made from, a page of them."""
        stored = await self.stored(response_id, raw)
        include = [*raw.query_params.getlist("include"), *raw.query_params.getlist("include[]")]
        for value in include:
            if value not in INCLUDABLE:  # (the others name what a stored item never has)
                msg = f"include {value!r} is not one of {sorted(INCLUDABLE)}"
                raise InvalidRequestError(msg, param="include")
        listed = input_items(stored.items, stored.response)
        return page(listed, after, limit, order, IMAGE_URLS in include, LOGPROBS in include)

    async def cancel(self, response_id: str, raw: Request) -> dict[str, Any]:
        """``POST /v1/responses/{id}/cancel``: a background response still running ends ``cancelled``
        (its request aborted in the engine); one that ended is returned as it is, as OpenAI's. Any other
        response finished before it was returned: nothing to cancel."""
        key = (request_tenant(raw.scope), response_id)
        stored = await self.stored(response_id, raw)
        if not stored.response.get("background"):
            raise InvalidRequestError(
                "Only a background response can be cancelled: this one finished before it was returned.",
                param="response_id",
            )
        response = await asyncio.to_thread(self._counted, self.store.set_status, *key, "cancelled")
        if response is None:  # deleted or evicted meanwhile
            raise not_found(response_id)
        self.background.forget(key)
        return response

    async def stream_again(self, response_id: str, raw: Request, starting_after: int | None) -> Response:
        """``GET /v1/responses/{id}?stream=true``: a streamed background response's events numbered past
        ``starting_after`` (all without), then each as it comes, until it ends."""
        key = (request_tenant(raw.scope), response_id)
        await self.stored(response_id, raw)
        if not await asyncio.to_thread(self.store.has_event_log, *key):
            raise InvalidRequestError(
                "Only a background response created with stream true can be streamed again; this one is "
                "retrieved whole.",
                param="stream",
            )
        after = -1 if starting_after is None else starting_after
        return StreamingResponse(self.background.events(key, after), media_type="text/event-stream")

    async def delete(self, response_id: str, raw: Request) -> dict[str, Any]:
        key = (request_tenant(raw.scope), response_id)
        if not await asyncio.to_thread(self._counted, self.store.delete, *key):
            raise not_found(response_id)
        self.background.forget(key)  # a background response still running stops
        return {"id": response_id, "object": "response", "deleted": True}

    async def stored(self, response_id: str, raw: Request) -> StoredResponse:
        stored = await asyncio.to_thread(self.store.get, request_tenant(raw.scope), response_id)
        if stored is None:
            raise not_found(response_id)
        return stored

    def count(self, num_evicted: int) -> None:
        """The store's figures on /metrics; called on the store's thread (``totals`` takes its lock)."""
        self.metrics.responses_evicted.inc(num_evicted)
        num_responses, num_bytes = self.store.totals()
        self.metrics.responses_stored.set(num_responses)
        self.metrics.responses_stored_bytes.set(num_bytes)

    def _counted(self, change: Any, *args: Any) -> Any:
        """On a thread: ``change`` the store, then count what that left."""
        result = change(*args)
        self.count(0)
        return result


def not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"No response found with id '{response_id}'.", param="response_id")
