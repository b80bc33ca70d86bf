"""POST /v1/responses; GET and DELETE /v1/responses/{response_id} (stored responses)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import Response

from app.api.json_body import StrictJSONRoute
from app.api.responses_api_schemas import ResponsesRequest
from app.api.state import State
from app.errors import InvalidRequestError

router = APIRouter(route_class=StrictJSONRoute)
ResponseId = Annotated[str, Path(min_length=1, max_length=128)]  # as previous_response_id


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request, state: State) -> Response:
    return await state.responses.create(body, request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(
    response_id: ResponseId,
    request: Request,
    state: State,
    stream: bool = False,
    starting_after: int | None = None,
    include_obfuscation: bool = True,  # (no stream here to pad)
) -> dict[str, Any]:
    """The stored response. OpenAI's query parameters for streaming a background response again, and
    ``include`` (``include[]=`` as the openai SDK sends it), do something mmserve does not: a 400 naming
    them, not an answer that ignores them."""
    if stream or starting_after is not None:
        raise InvalidRequestError(
            "A stored response is retrieved whole: streaming it again (stream, starting_after) is for "
            "background responses, which mmserve does not run.",
            param="stream" if stream else "starting_after",
        )
    if any(request.query_params.getlist(name) for name in ("include", "include[]")):
        raise InvalidRequestError("include is not supported.", param="include")
    return await state.responses.retrieve(response_id, request)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: ResponseId, request: Request, state: State) -> dict[str, Any]:
    return await state.responses.delete(response_id, request)
