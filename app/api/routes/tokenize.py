"""POST /tokenize and POST /detokenize (vLLM's paths and shapes)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from app.api.json_body import StrictJSONRoute
from app.api.state import State
from app.api.tokenize_schemas import DetokenizeRequest, TokenizeRequest

router = APIRouter(route_class=StrictJSONRoute)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request, state: State) -> dict[str, Any]:
    return await state.tokenize.tokenize(body, request)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: State) -> dict[str, Any]:
    return await state.tokenize.detokenize(body)
