"""POST /v1/responses."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.api.responses_api_schemas import ResponsesRequest
from app.api.state import State

router = APIRouter()


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request, state: State) -> Response:
    return await state.responses.create(body, request)
