"""A JSON Schema's subschemas, each with its path from the root and its depth: what the HTTP edge checks
(app/api/json_schema_support.py) and what the engine rewrites before xgrammar compiles it
(engine/structured/formats.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = (
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "items",
    "unevaluatedItems",
)
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")


def subschemas(schema: dict[str, Any], param: str = "") -> Iterator[tuple[dict[str, Any], str, int]]:
    """Every schema object in ``schema``, itself included, with its path (``param`` and the keywords to
    it: ``.properties.a.items``) and depth; iteratively, so a deep schema cannot exhaust Python's
    recursion. Values of ``const``, ``enum`` or ``default`` are data, never visited."""
    stack = [(schema, param, 0)]
    while stack:
        node, path, depth = stack.pop()
        yield node, path, depth
        children: list[tuple[Any, str]] = []
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                children += [(sub, f"{path}.{key}.{name}") for name, sub in node[key].items()]
        children += [(node[key], f"{path}.{key}") for key in _SCHEMA_VALUES if key in node]
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                children += [(sub, f"{path}.{key}[{i}]") for i, sub in enumerate(node[key])]
        stack += [(sub, sub_path, depth + 1) for sub, sub_path in children if isinstance(sub, dict)]
