"""The request fields that constrain the output (docs/api.md, "Structured outputs"): OpenAI's
``response_format`` and vLLM's ``structured_outputs``, shapes only. What they mean, and the checks that
need more than a shape, are app/api/constraints.py's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``, as OpenAI has it. ``description`` and ``strict`` are accepted:
    the schema is enforced whether ``strict`` is true or not, and nothing of it is shown to the model."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema", mode="before")  # (before its own fields are checked)
    @classmethod
    def _only_with_its_type(cls, json_schema: Any, info: Any) -> Any:
        if json_schema is not None and info.data.get("type") in ("text", "json_object"):
            raise ValueError("json_schema is only allowed with type 'json_schema'")
        return json_schema

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object with a schema")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of ``json``, ``json_object``, ``regex``, ``choice``,
    ``grammar``. ``disable_fallback`` and ``disable_additional_properties`` (true) are accepted and change
    nothing: there is no fallback backend, and an object without ``additionalProperties`` gets no
    undeclared property anyway. Every other vLLM key (``whitespace_pattern``, ``structural_tag``) is
    refused by name."""

    model_config = ConfigDict(extra="forbid")

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = True

    @field_validator("disable_additional_properties")
    @classmethod
    def _always_disabled(cls, value: bool) -> bool:
        if not value:
            raise ValueError(
                "only true is accepted: undeclared properties appear only where a schema allows them"
            )
        return value
