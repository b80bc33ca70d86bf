"""The OpenAPI schema as the server answers: FastAPI documents request-validation failures as 422 with
its own body, but mmserve answers them 400 in the OpenAI error envelope (``app.api.error_handlers``)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from app.api.error_handlers import ErrorResponse

ENVELOPE_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def document_error_envelope(app: FastAPI) -> None:
    """Makes ``app.openapi()`` list 400 + ``ErrorResponse`` wherever FastAPI would list 422."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            envelope = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(envelope.pop("$defs", {}))
            components["ErrorResponse"] = envelope
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    responses = operation.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses["400"] = {
                            "description": "Invalid request (OpenAI error envelope)",
                            "content": {"application/json": {"schema": ENVELOPE_REF}},
                        }
            for unused in ("HTTPValidationError", "ValidationError"):
                components.pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
