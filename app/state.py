"""What the API process holds while it runs, built by the lifespan and reached through dependencies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import httpx
from fastapi import Depends, Request

from app.chat_service import ChatService
from app.drain import Drain
from app.engine_client import EngineClient
from app.metrics import ApiMetrics
from app.settings import Settings


@dataclass
class ApiState:
    settings: Settings
    max_model_len: int
    metrics: ApiMetrics
    engine: EngineClient
    chat: ChatService
    http: httpx.AsyncClient
    drain: Drain


def get_state(request: Request) -> ApiState:
    return request.app.state.mmserve  # type: ignore[no-any-return]


State = Annotated[ApiState, Depends(get_state)]
