"""GET /v1/models."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.api.json_body import StrictJSONRoute
from app.api.state import State

router = APIRouter(route_class=StrictJSONRoute)


@router.get("/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    name = state.settings.model_name
    card = {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "mmserve",
        "root": state.settings.model,
        "max_model_len": state.max_model_len,
    }
    return {"object": "list", "data": [card]}
