"""POST /v1/completions (OpenAI's legacy completions: a prompt continued as it is)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.api.completion_schemas import CompletionRequest
from app.api.json_body import StrictJSONRoute
from app.api.state import State

router = APIRouter(route_class=StrictJSONRoute)


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request, state: State) -> Response:
    return await state.completions.create(body, request)
