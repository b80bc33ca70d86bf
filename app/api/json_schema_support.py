"""Which JSON Schemas mmserve enforces exactly, checked at the HTTP edge (docs/api.md, "Structured outputs").

xgrammar compiles most of JSON Schema into its grammar, but it skips a few keywords with only a log line,
which would relax the schema: a request whose answer should satisfy ``uniqueItems`` would get one that
need not. Such a schema is refused by name (400, ``param`` pointing at the keyword), never served a looser
answer. tests/unit/test_constraints.py shows, for each refusal, the installed xgrammar accepting
an instance the keyword forbids.
"""

from __future__ import annotations

import functools
import json
import re
import re._constants as sre_constants  # the stdlib's own regex parser: what a pattern can match
import re._parser as sre_parse
from collections.abc import Iterator
from typing import Any

import jsonschema

from app.errors import InvalidRequestError
from engine.structured.json_schemas import subschemas

MAX_SCHEMA_DEPTH = 64  # nested subschemas; deeper is refused (a compile thread's stack is finite)

# Keywords xgrammar reads past without enforcing.
UNENFORCED = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "contains",
    "minContains",
    "maxContains",
    "$dynamicRef",
    "$recursiveRef",
)
# string formats xgrammar enforces; any other is ignored by it
FORMATS = ("date", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "time", "uri", "uuid")
# keywords that constrain nothing ("discriminator": OpenAPI's, which pydantic writes beside a oneOf whose
# branches its const values already keep apart)
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment"}
    | {"$schema", "$id", "$anchor", "$defs", "definitions", "discriminator"}
)
# xgrammar reads the first of these a schema has and nothing else beside it but annotations (and
# "type" beside const or enum, which their values already satisfy or contradict)
EXCLUSIVE = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")


def check_json_schema(schema: Any, param: str) -> str:
    """Raises ``InvalidRequestError`` (param: ``param`` plus the path to the keyword) unless ``schema`` is
    a valid JSON Schema (its ``$schema`` draft, else 2020-12, by the ``jsonschema`` package's metaschema
    check) every part of which is enforced exactly. Returns the schema as compact JSON text, its property
    order kept: what the constraint carries, and what the checks are cached by (a metaschema check takes
    milliseconds; the same schema again, the common case, takes none)."""
    spec = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    problem = _problem(spec)
    if problem is not None:
        message, where = problem
        raise InvalidRequestError(message, param=param + where)
    return spec


@functools.lru_cache(maxsize=256)
def _problem(spec: str) -> tuple[str, str] | None:
    """What is wrong with the schema ``spec``: (message, path from the schema's root), or None."""
    try:
        _check(json.loads(spec))
    except InvalidRequestError as exc:
        return exc.message, exc.param or ""
    return None


def _check(schema: Any) -> None:
    """``check_json_schema``'s checks, the paths in their errors from the schema's root ("")."""
    if not isinstance(schema, dict):
        raise InvalidRequestError("a JSON schema must be an object", param="")
    nodes = list(subschemas(schema))
    too_deep = next((path for _, path, depth in nodes if depth > MAX_SCHEMA_DEPTH), None)
    if too_deep is not None:  # before the metaschema check, which recurses
        raise InvalidRequestError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels", param=too_deep)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in exc.path)
        raise InvalidRequestError(f"not a valid JSON schema: {exc.message}", param=where) from exc
    for node, path, _ in nodes:
        _check_node(node, path, schema)


def _check_node(node: dict[str, Any], path: str, root: dict[str, Any]) -> None:
    for keyword in UNENFORCED:
        if keyword in node:
            raise _unenforced(keyword, path)
    if node.get("uniqueItems") is True:
        raise _unenforced("uniqueItems", path)
    fmt = node.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise InvalidRequestError(
            f"the string format {fmt!r} is not enforced (enforced: {', '.join(FORMATS)})",
            param=f"{path}.format",
        )
    if "multipleOf" in node and not (_types(node) == {"integer"} and _is_integer(node["multipleOf"])):
        raise InvalidRequestError(
            "multipleOf is enforced only as an integer on type 'integer'", param=f"{path}.multipleOf"
        )
    bounds = [any(key in node for key in pair) for pair in _BOUNDS]
    if "multipleOf" in node and bounds[0] != bounds[1]:
        raise InvalidRequestError(
            "multipleOf is enforced with both a lower and an upper bound, or with neither",
            param=f"{path}.multipleOf",
        )
    lengths = [key for key in ("minLength", "maxLength") if key in node]
    if lengths and ("pattern" in node or "format" in node):
        beside = "pattern" if "pattern" in node else "format"
        raise InvalidRequestError(
            f"{lengths[0]} is not enforced beside {beside}: write the length into the pattern",
            param=f"{path}.{lengths[0]}",
        )
    _check_bounds(node, path)
    _check_false_branches(node, path)
    if "pattern" in node and "format" in node:  # xgrammar enforces the format alone
        raise InvalidRequestError(
            "pattern is not enforced beside format: write the format into the pattern",
            param=f"{path}.pattern",
        )
    _check_required(node, path)
    if isinstance(node.get("items"), list):
        raise InvalidRequestError("items as a list is not supported: use prefixItems", param=f"{path}.items")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise InvalidRequestError("allOf with more than one schema is not enforced", param=f"{path}.allOf")
    if isinstance(node.get("pattern"), str):
        check_regex(node["pattern"], f"{path}.pattern")
        _check_json_string_regex(node["pattern"], f"{path}.pattern")
    for name in node.get("patternProperties") or {}:
        check_regex(name, f"{path}.patternProperties")
        _check_json_string_regex(name, f"{path}.patternProperties")
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        raise InvalidRequestError(
            f"only local references ('#/...') are resolved, not {ref!r}", param=f"{path}.$ref"
        )
    exclusive = next((key for key in EXCLUSIVE if key in node), None)
    if exclusive is not None:
        allowed = ANNOTATIONS | {exclusive} | ({"type"} if exclusive in ("const", "enum") else set())
        ignored = sorted(set(node) - allowed)
        if ignored:
            raise InvalidRequestError(
                f"keywords beside {exclusive} are not enforced: {', '.join(ignored)}",
                param=f"{path}.{ignored[0]}",
            )
        if exclusive in ("const", "enum") and "type" in node:
            values = [node["const"]] if exclusive == "const" else node["enum"]
            other = [value for value in values if not any(_is_a(value, kind) for kind in _types(node))]
            if other:  # xgrammar would write them anyway
                raise InvalidRequestError(
                    f"{exclusive} values that are not of the schema's type: {json.dumps(other)[:200]}",
                    param=f"{path}.{exclusive}",
                )
    if isinstance(node.get("oneOf"), list) and not _disjoint(node["oneOf"], root):
        raise InvalidRequestError(
            "oneOf is enforced only when no value can match two of its branches (distinct types, or a "
            "required property with distinct const values); use anyOf",
            param=f"{path}.oneOf",
        )


_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")


def check_regex(regex: str, param: str) -> None:
    """Refuses a regular expression with a look-ahead or look-behind, which xgrammar skips (a pattern it
    would relax); other constructs it cannot take fail its compile with its own message."""
    in_class, i = False, 0
    while i < len(regex):
        char = regex[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif regex.startswith(_LOOKAROUND, i):
            raise InvalidRequestError(
                "look-ahead and look-behind assertions are not enforced in regular expressions", param=param
            )
        i += 1


# a JSON string's characters that its text must escape: a pattern xgrammar applies to the text, not to
# the decoded string, must never name them (its ".", \s and classes leave out the quote and the
# backslash, and negated classes control characters too; a class still takes a control character)
_CONTROL = frozenset(range(0x20))
_ESCAPED = _CONTROL | {ord('"'), ord("\\")}
_BOUNDS = (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum"))


def _check_bounds(node: dict[str, Any], path: str) -> None:
    """Bounds xgrammar cannot compile, refused by name: draft 4's boolean ``exclusiveMinimum`` /
    ``exclusiveMaximum``, and an integer's bound that is not a whole number."""
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(node.get(key), bool):
            raise InvalidRequestError(
                f"a boolean {key} (draft 4) is not supported: give the bound itself as {key}, as draft 6 "
                "and later do",
                param=f"{path}.{key}",
            )
    if "integer" in _types(node):
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            value = node.get(key)
            if isinstance(value, float) and not value.is_integer():
                raise InvalidRequestError(
                    f"an integer's {key} must be a whole number, not {value}", param=f"{path}.{key}"
                )


def _check_false_branches(node: dict[str, Any], path: str) -> None:
    """A ``false`` schema where xgrammar cannot compile one (a property, a branch), refused by name."""
    for name, sub in (node.get("properties") or {}).items():
        if sub is False:
            raise InvalidRequestError(
                "a property whose schema is false (it may never appear) is not supported: leave it out",
                param=f"{path}.properties.{name}",
            )
    for key in ("anyOf", "oneOf"):
        for i, sub in enumerate(node.get(key) or []):
            if sub is False:
                raise InvalidRequestError(
                    "a branch whose schema is false matches nothing: leave it out", param=f"{path}.{key}[{i}]"
                )


def _check_json_string_regex(regex: str, param: str) -> None:
    """Refuses a pattern for a JSON string that names a quote, a backslash or a control character:
    xgrammar would write it unescaped, and the answer would not parse."""
    try:
        parsed = sre_parse.parse(regex)
    except (re.error, RecursionError, OverflowError):
        return  # not Python's syntax: xgrammar's compile decides
    if _names_escaped(parsed):
        raise InvalidRequestError(
            "a pattern that matches a quote, a backslash or a control character is not enforced in a JSON "
            "string (it would be written unescaped)",
            param=param,
        )


def _names_escaped(items: Any) -> bool:
    """Whether a parsed regex has a literal ``_ESCAPED`` character, or a class that is not negated with a
    control character, at any depth (groups, repeats, branches)."""
    for op, arg in items:
        if op is sre_constants.LITERAL and arg in _ESCAPED:
            return True
        if op is sre_constants.IN and not any(kind is sre_constants.NEGATE for kind, _ in arg):
            for kind, value in arg:
                if kind is sre_constants.LITERAL and value in _CONTROL:
                    return True
                if kind is sre_constants.RANGE and value[0] < 0x20:
                    return True
        elif any(_names_escaped(sub) for sub in _subpatterns(arg)):
            return True
    return False


def _subpatterns(arg: Any) -> Iterator[Any]:
    if isinstance(arg, sre_parse.SubPattern):
        yield arg
    elif isinstance(arg, tuple | list):
        for part in arg:
            yield from _subpatterns(part)


def _check_required(node: dict[str, Any], path: str) -> None:
    """A required name no ``properties`` entry declares: xgrammar drops it (and without additional
    properties the schema could not be met at all)."""
    required = node.get("required")
    if not isinstance(required, list) or "patternProperties" in node:
        return
    properties = node.get("properties")
    declared: dict[str, Any] = properties if isinstance(properties, dict) else {}
    missing = [name for name in required if name not in declared]
    if missing:
        raise InvalidRequestError(
            f"required names that properties do not declare are not enforced: {', '.join(map(str, missing))}",
            param=f"{path}.required",
        )


def _is_a(value: Any, kind: str) -> bool:
    """Whether a JSON value is of the JSON-schema type ``kind``."""
    if kind == "integer":
        return isinstance(value, int | float) and not isinstance(value, bool) and float(value).is_integer()
    python: dict[str, Any] = {"string": str, "number": int | float, "boolean": bool, "null": type(None)}
    python |= {"object": dict, "array": list}
    return isinstance(value, python[kind]) and (kind == "boolean" or not isinstance(value, bool))


def _unenforced(keyword: str, path: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"the JSON-schema keyword {keyword!r} is not enforced", param=f"{path}.{keyword}"
    )


def _types(node: dict[str, Any]) -> set[str]:
    kind = node.get("type")
    return {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()


def _is_integer(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and value > 0
        and float(value).is_integer()
    )


def _resolve(node: Any, root: dict[str, Any]) -> Any:
    """A local ``$ref`` followed (as far as it leads inside ``root``); anything else as it is."""
    for _ in range(MAX_SCHEMA_DEPTH):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not (isinstance(ref, str) and ref.startswith("#")):
            return node
        node = root
        for part in (p for p in ref[1:].split("/") if p):
            node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
    return node


def _disjoint(branches: list[Any], root: dict[str, Any]) -> bool:
    """Whether no value can match two branches, by a check that is sound, not complete: every two
    branches have distinct single primitive types ("integer" and "number" overlap), or both require
    one property whose const (or single-value enum) values differ."""
    resolved = [_resolve(branch, root) for branch in branches]
    if not all(isinstance(branch, dict) for branch in resolved):
        return False
    return all(
        _apart(resolved[i], resolved[j]) for i in range(len(resolved)) for j in range(i + 1, len(resolved))
    )


def _apart(a: dict[str, Any], b: dict[str, Any]) -> bool:
    types_a, types_b = _types(a), _types(b)
    if (
        len(types_a) == len(types_b) == 1
        and types_a != types_b
        and types_a | types_b != {"integer", "number"}
    ):
        return True
    props_a, props_b = a.get("properties", {}), b.get("properties", {})
    for name in set(a.get("required", [])) & set(b.get("required", [])):
        const_a, const_b = _const_of(props_a.get(name)), _const_of(props_b.get(name))
        if const_a is not _NONE and const_b is not _NONE and const_a != const_b:  # (1 == 1.0: not apart)
            return True
    return False


_NONE = object()


def _const_of(node: Any) -> Any:
    """The single value a property schema allows (``const``, or an ``enum`` of one); ``_NONE`` if it
    allows more."""
    if not isinstance(node, dict):
        return _NONE
    if "const" in node:
        return node["const"]
    if isinstance(node.get("enum"), list) and len(node["enum"]) == 1:
        return node["enum"][0]
    return _NONE
