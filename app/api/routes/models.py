"""GET /v1/models, and GET /v1/models/{model} (the openai SDK's ``models.retrieve``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.api.json_body import StrictJSONRoute
from app.api.state import State
from app.errors import ModelNotFoundError

router = APIRouter(route_class=StrictJSONRoute)


@router.get("/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    return {"object": "list", "data": [_card(state)]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, state: State) -> dict[str, Any]:
    """The served model's card; another name is a 404 ``model_not_found``, as OpenAI answers."""
    if model != state.settings.model_name:
        raise ModelNotFoundError(f"The model `{model}` does not exist.")
    return _card(state)


def _card(state: State) -> dict[str, Any]:
    return {
        "id": state.settings.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "mmserve",
        "root": state.settings.model,
        "max_model_len": state.max_model_len,
    }
