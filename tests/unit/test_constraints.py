"""A request's constraint fields become one Constraint, or a 400 naming the field at fault
(app/api/constraints.py); schemas with keywords xgrammar would not enforce are refused by name
(app/api/json_schema_support.py), and for each refusal the installed xgrammar is shown accepting what the
keyword forbids, so a refusal is dropped once xgrammar enforces it."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr
from pydantic import ValidationError

from app.api.constraint_schemas import ResponseFormat, StructuredOutputs
from app.api.constraints import requested_constraint
from app.api.json_schema_support import MAX_SCHEMA_DEPTH, check_json_schema
from app.api.schemas import ChatCompletionRequest
from app.errors import InvalidRequestError
from wire.protocol import MAX_CONSTRAINT_CHARS, ConstraintKind

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def constraint_of(**fields: Any) -> Any:
    body = chat(**fields)
    return requested_constraint(body.response_format, body.structured_outputs)


def refusal(**fields: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        constraint_of(**fields)
    return caught.value


def test_each_field_makes_its_constraint() -> None:
    schema_format = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT, "strict": True}}
    cases = {
        "response_format.json_schema.schema": (
            {"response_format": schema_format},
            ConstraintKind.JSON_SCHEMA,
        ),
        "response_format": ({"response_format": {"type": "json_object"}}, ConstraintKind.JSON_OBJECT),
        "structured_outputs.json": ({"structured_outputs": {"json": POINT}}, ConstraintKind.JSON_SCHEMA),
        "structured_outputs.regex": ({"structured_outputs": {"regex": "a+"}}, ConstraintKind.REGEX),
        "structured_outputs.choice": (
            {"structured_outputs": {"choice": ["a", "b", "a"]}},
            ConstraintKind.CHOICE,
        ),
        "structured_outputs.grammar": (
            {"structured_outputs": {"grammar": 'root ::= "x"'}},
            ConstraintKind.GRAMMAR,
        ),
        "structured_outputs.json_object": (
            {"structured_outputs": {"json_object": True}},
            ConstraintKind.JSON_OBJECT,
        ),
    }
    for param, (fields, kind) in cases.items():
        found = constraint_of(**fields)
        # OpenAI's field gives compact JSON by default, vLLM's allows whitespace as vLLM does
        any_whitespace = param.startswith("structured_outputs")
        assert (found.param, found.constraint.kind, found.constraint.any_whitespace) == (
            param,
            kind,
            any_whitespace,
        )
    assert json.loads(constraint_of(**cases["structured_outputs.json"][0]).constraint.spec) == POINT
    assert json.loads(constraint_of(structured_outputs={"json": json.dumps(POINT)}).constraint.spec) == POINT
    assert constraint_of(structured_outputs={"choice": ["a", "b", "a"]}).constraint.spec == '["a", "b"]'
    compact = constraint_of(structured_outputs={"json": POINT, "disable_any_whitespace": True})
    assert not compact.constraint.any_whitespace
    assert constraint_of() is None and constraint_of(response_format={"type": "text"}) is None


def test_json_whitespace_follows_the_server_default_unless_the_request_says() -> None:
    schema_format = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT}}

    def whitespace(server_allows: bool, **fields: Any) -> bool:
        body = chat(**fields)
        found = requested_constraint(body.response_format, body.structured_outputs, server_allows)
        return bool(found.constraint.any_whitespace)

    for server_allows in (False, True):
        assert whitespace(server_allows, response_format=schema_format) is server_allows
        assert whitespace(server_allows, response_format={"type": "json_object"}) is server_allows
        for disable in (False, True):  # the request's own word rules response_format's JSON too
            said = {"disable_any_whitespace": disable}
            assert whitespace(server_allows, response_format=schema_format, structured_outputs=said) is (
                not disable
            )
        # vLLM's constraints keep vLLM's default, whatever the server's default for response_format
        assert whitespace(server_allows, structured_outputs={"json": POINT}) is True


def test_the_schema_keeps_its_property_order() -> None:
    ordered = {"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "string"}}}
    spec = constraint_of(structured_outputs={"json": ordered}).constraint.spec
    assert spec.index("zeta") < spec.index("alpha")


def test_two_constraints_are_refused_naming_both() -> None:
    error = refusal(response_format={"type": "json_object"}, structured_outputs={"regex": "a"})
    assert "response_format and structured_outputs.regex" in error.message
    assert error.param == "structured_outputs.regex"
    error = refusal(structured_outputs={"regex": "a", "choice": ["b"]})
    assert "structured_outputs.regex and structured_outputs.choice" in error.message


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "empty"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
        ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json", "must be an object"),
        (
            {"structured_outputs": {"regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}},
            "structured_outputs.regex",
            "at most",
        ),
        (
            {"structured_outputs": {"json": {"enum": ["v" * 100] * 1000}}},
            "structured_outputs.json",
            "characters long",
        ),
    ],
)
def test_malformed_constraints_are_400s(fields: dict[str, Any], param: str, words: str) -> None:
    error = refusal(**fields)
    assert error.param == param and words in error.message


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": POINT}}}, "name"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": POINT}}},
            "name",
        ),
        ({"response_format": {"type": "structural_tag"}}, "type"),
        ({"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {}}}}, "json_schema"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "whitespace_pattern"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag"),
        ({"structured_outputs": {"disable_additional_properties": False}}, "disable_additional_properties"),
        ({"guided_json": POINT}, "guided_json"),
        ({"guided_regex": "a"}, "guided_regex"),
    ],
)
def test_shapes_outside_openai_and_vllm_are_refused(fields: dict[str, Any], loc: str) -> None:
    with pytest.raises(ValidationError) as caught:
        chat(**fields)
    assert any(loc in ".".join(str(part) for part in error["loc"]) for error in caught.value.errors()), (
        caught.value
    )


def test_a_json_schema_beside_another_type_is_refused_before_its_own_fields() -> None:
    """Not "missing name": the json_schema object does not belong with that type at all."""
    for kind in ("text", "json_object"):
        with pytest.raises(ValidationError) as caught:
            chat(response_format={"type": kind, "json_schema": {}})
        (error,) = caught.value.errors()
        assert error["loc"][-1] == "json_schema" and "only allowed with type" in error["msg"]


def test_accepted_options_that_change_nothing() -> None:
    fields = StructuredOutputs.model_validate({"regex": "a", "disable_fallback": True})
    assert fields.disable_additional_properties and fields.disable_fallback
    described = ResponseFormat.model_validate(
        {
            "type": "json_schema",
            "json_schema": {"name": "p", "description": "a point", "schema": POINT, "strict": False},
        }
    )
    assert described.json_schema is not None and described.json_schema.json_schema == POINT


# ---------------------------------------------------------------- unenforced JSON-schema keywords

# (schema, where the refusal points, an instance the schema forbids and xgrammar's grammar accepts)
UNENFORCED: dict[str, tuple[dict[str, Any], str, str]] = {
    "not": ({"not": {"type": "string"}}, ".not", '"x"'),
    "if": ({"if": {"type": "string"}, "then": {"maxLength": 1}}, ".if", '"xyz"'),
    "uniqueItems": (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        ".uniqueItems",
        "[1, 1]",
    ),
    "contains": (
        {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}},
        ".contains",
        "[1]",
    ),
    "dependentRequired": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        ".dependentRequired",
        '{"a": 1}',
    ),
    "multipleOf on a number": ({"type": "number", "multipleOf": 0.5}, ".multipleOf", "0.3"),
    "multipleOf not an integer": ({"type": "integer", "multipleOf": 1.5}, ".multipleOf", "1"),
    "an unknown format": ({"type": "string", "format": "iri"}, ".format", '"not an iri"'),
    "allOf of two": (
        {"allOf": [{"type": "integer", "minimum": 5}, {"type": "integer", "maximum": 3}]},
        ".allOf",
        "1",
    ),
    "overlapping oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, ".oneOf", "1"),
    "a remote $ref": ({"$ref": "https://example.com/s.json"}, ".$ref", '"x"'),
    "a keyword beside $ref": (
        {"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "minimum": 5},
        ".minimum",
        "1",
    ),
    "properties beside anyOf": (
        {"anyOf": [{"type": "object"}], "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        ".properties",
        "{}",
    ),
    "maxLength beside enum": ({"enum": ["a", "bb"], "maxLength": 1}, ".maxLength", '"bb"'),
    "a look-ahead in a pattern": ({"type": "string", "pattern": "^a(?!b)b?$"}, ".pattern", '"ab"'),
    # a pattern applies to the JSON text: a quote, a backslash or a newline in it is written raw
    "a quote in a pattern": ({"type": "string", "pattern": '^"$'}, ".pattern", '"""'),
    "a backslash in a pattern": ({"type": "string", "pattern": "^\\\\$"}, ".pattern", '"\\"'),
    "a newline in a pattern": ({"type": "string", "pattern": "^a\\nb$"}, ".pattern", '"a\nb"'),
    "a control character in a class": ({"type": "string", "pattern": "^[\\x00-\\x1f]$"}, ".pattern", '"\n"'),
    "maxLength beside pattern": (
        {"type": "string", "pattern": "^[a-z]*$", "maxLength": 3},
        ".maxLength",
        '"abcdef"',
    ),
    "maxLength beside format": (
        {"type": "string", "format": "email", "maxLength": 8},
        ".maxLength",
        '"abcdefgh@example.com"',
    ),
    "pattern beside format": (
        {"type": "string", "format": "uuid", "pattern": "^0+-.*$"},
        ".pattern",
        '"123e4567-e89b-12d3-a456-426614174000"',
    ),
    "an enum value of another type": ({"type": "string", "enum": ["a", 1]}, ".enum", "1"),
    "a const of another type": ({"type": "integer", "const": "x"}, ".const", '"x"'),
    "a required name not declared": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zzz"]},
        ".required",
        '{"a": 1}',
    ),
    "multipleOf with one bound": ({"type": "integer", "multipleOf": 7, "minimum": 0}, ".multipleOf", "5"),
}


@pytest.fixture(scope="module")
def byte_compiler() -> xgr.GrammarCompiler:
    """xgrammar over a vocabulary of the 256 single bytes: enough to test which strings a grammar takes."""
    return xgr.GrammarCompiler(xgr.TokenizerInfo([bytes([i]) for i in range(256)]), cache_enabled=False)


def xgrammar_accepts(compiler: xgr.GrammarCompiler, schema: dict[str, Any], text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
    return bool(matcher.accept_string(text)) and matcher.is_completed()


@pytest.mark.parametrize("case", list(UNENFORCED))
def test_a_keyword_xgrammar_does_not_enforce_is_refused_by_name(
    case: str, byte_compiler: xgr.GrammarCompiler
) -> None:
    schema, where, forbidden = UNENFORCED[case]
    with pytest.raises(InvalidRequestError) as caught:
        check_json_schema(schema, "response_format.json_schema.schema")
    assert caught.value.param == f"response_format.json_schema.schema{where}"
    assert xgrammar_accepts(byte_compiler, schema, forbidden), (
        f"xgrammar now enforces {case}: lift the refusal"
    )


def test_a_regex_with_a_look_around_is_refused() -> None:
    for regex in ("a(?=b)b", "(?<!x)y", "a(?!b)"):
        assert "look-ahead" in refusal(structured_outputs={"regex": regex}).message
    assert constraint_of(structured_outputs={"regex": r"\(?=[(?=]"}) is not None  # escaped, in a class


def test_an_invalid_schema_is_refused_by_its_metaschema() -> None:
    for schema, where in [
        ({"minLength": "3"}, ".minLength"),
        ({"type": "strnig"}, ".type"),
        ({"required": "a"}, ".required"),
    ]:
        error = refusal(structured_outputs={"json": schema})
        assert error.param == "structured_outputs.json" + where and "not a valid JSON schema" in error.message


def test_refusals_point_into_nested_schemas() -> None:
    nested = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(InvalidRequestError) as caught:
        check_json_schema({"$defs": {"Doc": nested}, "$ref": "#/$defs/Doc"}, "s")
    assert caught.value.param == "s.$defs.Doc.properties.tags.uniqueItems"
    too_deep: dict[str, Any] = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH + 1):
        too_deep = {"type": "object", "properties": {"a": too_deep}}
    with pytest.raises(InvalidRequestError, match="deeper than"):
        check_json_schema(too_deep, "s")


@pytest.mark.parametrize(
    ("schema", "forbidden"),
    [
        ({"type": "string", "format": "email"}, '"nope"'),
        ({"type": "integer", "multipleOf": 3}, "4"),
        ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, "[1, 2]"),
        (
            {
                "oneOf": [
                    {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                    {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]},
                ]
            },
            '{"k": "c"}',
        ),
        ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "true"),
        ({"enum": ["a", "b"], "type": "string", "title": "T", "description": "d"}, '"c"'),
        ({"enum": [1, None], "type": ["integer", "null"]}, "2"),
        ({"type": "string", "pattern": "^[^a]+$"}, '"""'),  # a negated class takes no quote there
        ({"type": "string", "pattern": "^.+$"}, '"\\"'),
        ({"type": "string", "pattern": '^[ -~"\\\\]$'}, '"""'),  # a class takes no quote or backslash raw
        ({"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 30}, "4"),
        ({"type": "string", "minLength": 2}, '"a"'),
    ],
)
def test_what_xgrammar_enforces_is_accepted(
    schema: dict[str, Any], forbidden: str, byte_compiler: xgr.GrammarCompiler
) -> None:
    check_json_schema(schema, "s")
    assert not xgrammar_accepts(byte_compiler, schema, forbidden)


def test_a_pydantic_discriminated_union_is_accepted() -> None:
    from typing import Literal

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(BaseModel):
        kind: Literal["dog"]
        good: bool

    class Pet(BaseModel):
        pet: Cat | Dog = Field(discriminator="kind")
        tags: list[str] = Field(max_length=3)
        nickname: str | None = None

    schema = Pet.model_json_schema()
    assert "oneOf" in json.dumps(schema)
    check_json_schema(schema, "s")


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        (
            {
                "$schema": "http://json-schema.org/draft-04/schema#",
                "type": "number",
                "minimum": 0,
                "exclusiveMinimum": True,
            },
            ".exclusiveMinimum",
        ),
        ({"type": "integer", "minimum": 1.5, "maximum": 3}, ".minimum"),
        ({"type": "object", "properties": {"a": False}}, ".properties.a"),
        ({"anyOf": [{"type": "integer"}, False]}, ".anyOf[1]"),
    ],
)
def test_a_valid_schema_xgrammar_cannot_compile_is_refused_by_name(
    schema: dict[str, Any], where: str, byte_compiler: xgr.GrammarCompiler
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_json_schema(schema, "s")
    assert caught.value.param == f"s{where}"
    with pytest.raises(RuntimeError):  # drop the refusal once xgrammar compiles it
        byte_compiler.compile_json_schema(json.dumps(schema))
