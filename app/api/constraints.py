"""From a request's constraint fields to the one ``Constraint`` the engine compiles (docs/api.md,
"Structured outputs"): at most one per request, each checked here as far as the HTTP edge can (shape,
size, JSON-schema keywords xgrammar would not enforce); what only a compile finds (a regex or grammar
that does not parse) comes back from the engine as a 400 naming the same field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from app.api.constraint_schemas import ResponseFormat, StructuredOutputs
from app.api.json_schema_support import check_json_schema, check_regex
from app.errors import InvalidRequestError
from wire.protocol import MAX_CONSTRAINT_CHARS, Constraint, ConstraintKind


@dataclass(frozen=True)
class RequestedConstraint:
    """A request's constraint and the request field it came from (which errors about it name)."""

    constraint: Constraint
    param: str


def requested_constraint(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputs | None,
    response_format_whitespace: bool = False,
) -> RequestedConstraint | None:
    """The request's constraint, or None; ``InvalidRequestError`` when it is malformed, unsupported, too
    large, or one of several. JSON from ``response_format`` allows free whitespace where
    ``response_format_whitespace`` says so (the server's default, ``--response-format-whitespace``),
    from ``structured_outputs`` unless it disables it (vLLM's default); a request's
    ``disable_any_whitespace``, where it sets it, rules both (docs/api.md, "Structured outputs")."""
    found: list[tuple[str, ConstraintKind, Any]] = []
    if response_format is not None and response_format.type == "json_object":
        found.append(("response_format", ConstraintKind.JSON_OBJECT, None))
    elif response_format is not None and response_format.json_schema is not None:
        found.append(
            (
                "response_format.json_schema.schema",
                ConstraintKind.JSON_SCHEMA,
                response_format.json_schema.json_schema,
            )
        )
    any_whitespace = response_format_whitespace
    if structured_outputs is not None:
        fields = structured_outputs
        # vLLM's default for its own constraints; with response_format, only where the request says
        if not found or "disable_any_whitespace" in fields.model_fields_set:
            any_whitespace = not fields.disable_any_whitespace
        candidates = [
            ("json", ConstraintKind.JSON_SCHEMA, fields.json_schema),
            ("json_object", ConstraintKind.JSON_OBJECT, True if fields.json_object else None),
            ("regex", ConstraintKind.REGEX, fields.regex),
            ("choice", ConstraintKind.CHOICE, fields.choice),
            ("grammar", ConstraintKind.GRAMMAR, fields.grammar),
        ]
        found += [
            (f"structured_outputs.{name}", kind, value)
            for name, kind, value in candidates
            if value is not None
        ]
    if not found:
        return None
    if len(found) > 1:
        names = " and ".join(param for param, _, _ in found)
        raise InvalidRequestError(
            f"a request may carry one output constraint, not {names}", param=found[1][0]
        )
    param, kind, value = found[0]
    return RequestedConstraint(Constraint(kind, _spec(kind, value, param), any_whitespace), param)


def _spec(kind: ConstraintKind, value: Any, param: str) -> str:
    match kind:
        case ConstraintKind.JSON_OBJECT:
            return ""
        case ConstraintKind.JSON_SCHEMA:
            if isinstance(value, str):  # vLLM takes the schema as JSON text too
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise InvalidRequestError(f"the schema is not valid JSON: {exc}", param=param) from exc
                except RecursionError as exc:
                    raise InvalidRequestError("the schema is nested too deeply", param=param) from exc
            spec = check_json_schema(value, param)
        case ConstraintKind.CHOICE:
            if not value:
                raise InvalidRequestError("choice needs at least one string", param=param)
            spec = json.dumps(list(dict.fromkeys(value)), ensure_ascii=False)
        case _:
            if not value:
                raise InvalidRequestError(f"the {kind.value} must not be empty", param=param)
            if kind is ConstraintKind.REGEX:
                check_regex(value, param)
            spec = value
    if len(spec) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequestError(
            f"the constraint is {len(spec)} characters long; at most {MAX_CONSTRAINT_CHARS} are accepted",
            param=param,
        )
    return spec
