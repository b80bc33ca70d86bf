"""What the API process holds while it runs, built by the lifespan and reached through dependencies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from app.api.chat_service import ChatService
from app.api.completion_service import CompletionService
from app.api.drain import Drain
from app.api.responses_service import ResponsesService
from app.api.tokenize_service import TokenizeService
from app.inputs.engine_client import EngineClient
from app.metrics import ApiMetrics
from app.settings import Settings


@dataclass
class ApiState:
    settings: Settings
    max_model_len: int
    metrics: ApiMetrics
    engine: EngineClient
    chat: ChatService
    drain: Drain
    tokenize: TokenizeService
    responses: ResponsesService
    completions: CompletionService


def get_state(request: Request) -> ApiState:
    state: ApiState = request.app.state.mmserve  # set by the app's lifespan (app/api/server.py)
    return state


State = Annotated[ApiState, Depends(get_state)]
