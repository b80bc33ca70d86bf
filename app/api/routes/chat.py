"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.api.json_body import StrictJSONRoute
from app.api.schemas import ChatCompletionRequest
from app.api.state import State

router = APIRouter(route_class=StrictJSONRoute)


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: State) -> Response:
    return await state.chat.create(body, request)
