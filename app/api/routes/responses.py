"""POST /v1/responses and /v1/responses/input_tokens; GET and DELETE /v1/responses/{response_id}, its
input items and its cancellation (stored responses)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response

from app.api.json_body import StrictJSONRoute
from app.api.responses_api_schemas import ResponsesInput, ResponsesRequest
from app.api.state import State
from app.errors import InvalidRequestError

router = APIRouter(route_class=StrictJSONRoute)
ResponseId = Annotated[str, Path(min_length=1, max_length=128)]  # as previous_response_id


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request, state: State) -> Response:
    return await state.responses.create(body, request)


@router.post("/v1/responses/input_tokens")
async def count_input_tokens(body: ResponsesInput, request: Request, state: State) -> dict[str, Any]:
    return await state.responses.count_input_tokens(body, request)


@router.get("/v1/responses/{response_id}", response_model=None)
async def retrieve_response(
    response_id: ResponseId,
    request: Request,
    state: State,
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=-1)] = None,
    include_obfuscation: bool = True,  # (mmserve pads no events)
) -> dict[str, Any] | Response:
    """The stored response; with ``stream``, a streamed background response's events (those past
    ``starting_after``) until it ends. ``include`` (``include[]=`` as the openai SDK sends it) does
    something mmserve does not: a 400 naming it, not an answer that ignores it."""
    if any(request.query_params.getlist(name) for name in ("include", "include[]")):
        raise InvalidRequestError("include is not supported.", param="include")
    if stream:
        return await state.responses.stored.stream_again(response_id, request, starting_after)
    if starting_after is not None:
        msg = "starting_after is a cursor into a streamed response's events: it needs stream true."
        raise InvalidRequestError(msg, param="starting_after")
    return await state.responses.stored.retrieve(response_id, request)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: ResponseId, request: Request, state: State) -> dict[str, Any]:
    return await state.responses.stored.delete(response_id, request)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: ResponseId,
    request: Request,
    state: State,
    after: Annotated[str | None, Query(min_length=1)] = None,
    before: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    """OpenAI's query parameters (``include`` read by the service); ``before``, which older SDKs had, is
    a 400 naming it rather than a page that ignores it."""
    if before is not None:
        raise InvalidRequestError("before is not supported: page with after and order.", param="before")
    return await state.responses.stored.list_input_items(response_id, request, after, limit, order)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: ResponseId, request: Request, state: State) -> dict[str, Any]:
    return await state.responses.stored.cancel(response_id, request)
