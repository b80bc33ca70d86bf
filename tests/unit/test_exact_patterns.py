"""Regexes in grammars compiled exactly (engine/structured/patterns.py): random patterns take exactly
what Python's ``re`` fully matches, where xgrammar's own automata take more; a JSON string's pattern
never reaches a quote, a backslash or a control character; every kind of constraint the backend
with a schema (``response_format``, a tool's parameters) goes through it; a class that begins with a
caret keeps its meaning; and the printer's escapes read back to the characters they print."""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr

from engine.structured.backend import XGrammarBackend
from engine.structured.patterns import (
    FORBIDDEN,
    PatternError,
    _codepoints,
    _narrowed,
    compile_exact,
    stand_ins,
)
from wire.protocol import Constraint, ConstraintKind

STRINGS = ["".join(chars) for n in range(6) for chars in itertools.product("ab", repeat=n)]
ATOMS = ["a", "b", "[ab]", ".", "[^a]"]
QUANTIFIERS = ["", "", "?", "*", "+", "{0,1}", "{1,2}", "{2}", "{0,2}", "{1,}", "??", "+?"]


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo([bytes([i]) for i in range(256)]), cache_enabled=False)


def random_pattern(rng: random.Random, depth: int = 3) -> str:
    if depth == 0 or rng.random() < 0.3:
        return rng.choice(ATOMS) + rng.choice(QUANTIFIERS)
    parts = [random_pattern(rng, depth - 1) for _ in range(rng.randint(1, 3))]
    body = "|".join(parts) if rng.random() < 0.2 else "".join(parts)
    return f"({body}){rng.choice(QUANTIFIERS)}"


def taken(compiled: Any, texts: list[str]) -> list[bool]:
    def takes(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return bool(matcher.accept_string(text)) and matcher.is_completed()

    return [takes(text) for text in texts]


def pattern_grammar(pattern: str) -> xgr.Grammar:
    return xgr.Grammar.from_json_schema(
        json.dumps({"type": "string", "pattern": pattern}), any_whitespace=False
    )


def random_mismatches(
    seed: int, ours: Callable[[str], Any], theirs: Callable[[str], Any], texts: list[str]
) -> tuple[list[str], int]:
    """Over 100 random patterns: those whose compile by ``ours`` takes other ``texts`` (STRINGS, as
    written) than Python's ``re`` fully matches, and how many ``theirs`` (xgrammar's own) got wrong."""
    rng = random.Random(seed)
    wrong, theirs_wrong = [], 0
    for _ in range(100):
        pattern = random_pattern(rng)
        expected = [re.fullmatch(pattern, s) is not None for s in STRINGS]
        if taken(ours(pattern), texts) != expected:
            wrong.append(pattern)
        theirs_wrong += taken(theirs(pattern), texts) != expected
    return wrong, theirs_wrong


def test_random_patterns_take_what_re_fully_matches(compiler: xgr.GrammarCompiler) -> None:
    wrong, xgrammar_wrong = random_mismatches(
        1,  # (a seed whose patterns Python's re matches without backtracking for long)
        lambda pattern: compile_exact(xgr, compiler, pattern_grammar(pattern)),
        lambda pattern: compiler.compile_grammar(pattern_grammar(pattern)),
        [json.dumps(s) for s in STRINGS],
    )
    assert not wrong, wrong[:5]
    assert xgrammar_wrong, "xgrammar's own automata are exact now: drop engine/structured/patterns.py"


@pytest.mark.parametrize(
    ("pattern", "forbidden", "allowed"),
    [
        ("^[A-Z]{3}( [0-9]+)?$", "ABC12", "ABC 12"),  # X? joined X's own loop
        ("^(a|a{1,2})$", "aaa", "aa"),  # merged states
        ("^[0-9]+[.][0-9]+[.][0-9]+(-[a-z0-9]+)?$", "1.2.3rc1", "1.2.3-rc1"),
    ],
)
def test_patterns_xgrammar_relaxes_are_exact(
    compiler: xgr.GrammarCompiler, pattern: str, forbidden: str, allowed: str
) -> None:
    texts = [json.dumps(forbidden), json.dumps(allowed)]
    assert taken(compile_exact(xgr, compiler, pattern_grammar(pattern)), texts) == [False, True]
    assert taken(compiler.compile_grammar(pattern_grammar(pattern)), texts) == [True, True], (
        "xgrammar's own automaton is exact here now"
    )


@pytest.mark.parametrize("pattern", [".+", "[^a]+", "[ -~]+", "\\S+", "\\W+", "[\\s\\S]+"])
def test_a_json_strings_pattern_never_takes_what_the_string_escapes(
    compiler: xgr.GrammarCompiler, pattern: str
) -> None:
    compiled = compile_exact(xgr, compiler, pattern_grammar(pattern))
    escaped = ['"x\\"y"', '"x\\\\y"', '"x\\ny"', '"x\\u0001y"', '"x\ty"', '"x"y"']
    assert not any(taken(compiled, escaped))
    assert any(taken(compiled, ['"~%"', '"  "', '"~é"']))


@pytest.mark.parametrize(
    ("pattern", "taken_values", "refused"),
    [
        ("^[\\^a]+$", ["^a", "a^"], ["b"]),
        ("^[\\^]$", ["^"], ["a"]),
        ("^x[\\x5ea-c]$", ["x^", "xb"], ["xd"]),
        ("^[^\\^a]$", ["b"], ["^", "a"]),
        ("^[\\^\\^]$", ["^"], ["z"]),
        ("^[\\u{5e}a]$", ["^", "a"], ["z"]),
        ("^[\\^\\x5ea]+$", ["^a^"], ["z"]),
    ],
)
def test_a_class_that_begins_with_a_caret_keeps_its_meaning(
    compiler: xgr.GrammarCompiler, pattern: str, taken_values: list[str], refused: list[str]
) -> None:
    """xgrammar prints ``[\\^a]`` as ``[^a]``, which reads back negated; the caret goes last."""
    compiled = compile_exact(xgr, compiler, pattern_grammar(pattern))
    texts = [json.dumps(s) for s in taken_values + refused]
    assert taken(compiled, texts) == [True] * len(taken_values) + [False] * len(refused)


def test_a_range_from_a_caret_is_refused(compiler: xgr.GrammarCompiler) -> None:
    """xgrammar reads ``[\\^-a]`` as three members, Python as a range: neither can be promised."""
    with pytest.raises(PatternError, match="range that starts at a caret"):
        compile_exact(xgr, compiler, pattern_grammar("^[\\^-a]$"))


def test_latin_1_characters_beside_hex_digits_keep_their_meaning(compiler: xgr.GrammarCompiler) -> None:
    """xgrammar prints U+0080 to U+00FF as ``\\xHH`` but reads ``\\x`` on over the hex digits after
    it (``°C`` would read back as U+0B0C): strings and classes go back with fixed-width escapes."""
    schema = {
        "type": "object",
        "properties": {
            "d": {"type": "string", "format": "date"},
            "u": {"enum": ["°C", "°F"]},
            "référence": {"type": "string", "pattern": "^[A-Fé]+[°é]$"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}( [0-9]+)?$"},
        },
        "required": ["d", "u", "référence", "code"],
        "additionalProperties": False,
    }
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema, ensure_ascii=False), any_whitespace=False)
    assert "Regex(" in str(grammar)  # (compiled through its printed text)
    compiled = compile_exact(xgr, compiler, grammar)
    good = '{"d": "2024-05-01", "u": "°C", "référence": "CAFé°", "code": "ABC"}'
    bad = '{"d": "2024-05-01", "u": "\u0b0c", "référence": "CAFé°", "code": "ABC"}'
    assert taken(compiled, [good, bad]) == [True, False]


def test_every_regex_of_a_schema_is_replaced(compiler: xgr.GrammarCompiler) -> None:
    """Names and values of ``patternProperties`` and nested patterns (their rules printed one after
    another)."""
    code = {"type": "string", "pattern": "^[A-Z]{3}( [0-9]+)?$"}
    schema = {
        "type": "object",
        "patternProperties": {"^k[0-9]+(x)?$": code},
        "properties": {"list": {"type": "array", "items": code}},
        "additionalProperties": False,
    }
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert str(grammar).count("Regex(") == 3
    compiled = compile_exact(xgr, compiler, grammar)
    good = ['{"k1": "ABC"}', '{"k12x": "ABC 1"}', '{"list": ["ABC", "XYZ 9"]}']
    bad = ['{"k1": "ABC1"}', '{"kx": "ABC"}', '{"list": ["ABC1"]}']
    assert taken(compiled, good) == [True] * 3 and taken(compiled, bad) == [False] * 3


def test_schemas_and_tools_compile_their_patterns_exactly(tiny_model: Callable[[str], Path]) -> None:
    backend = XGrammarBackend(str(tiny_model("qwen2_5_vl")), 0)
    code = {"type": "string", "pattern": "^[A-Z]{3}( [0-9]+)?$"}
    schema = {"type": "object", "properties": {"v": code}, "required": ["v"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    kinds = {
        ConstraintKind.JSON_SCHEMA: (json.dumps(schema), '{"v": "ABC12"}', '{"v": "ABC 12"}'),
        ConstraintKind.TOOL_CALLS: (
            json.dumps(
                {"format": "qwen_3", "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False}
            ),
            '<tool_call>\n{"name": "f", "arguments": {"v": "ABC12"}}\n</tool_call>',
            '<tool_call>\n{"name": "f", "arguments": {"v": "ABC 12"}}\n</tool_call>',
        ),
    }
    for kind, (spec, forbidden, allowed) in kinds.items():
        compiled = backend.compile(Constraint(kind, spec))
        assert taken(compiled, [forbidden, allowed]) == [False, True], kind


def test_every_pattern_of_a_schema_has_a_stand_in_and_no_data_does() -> None:
    """xgrammar meets literals in place of a schema's patterns (its automata for them would be built
    and thrown away); the table gives each stand-in's pattern back."""
    code = "^[A-Z]{3}( [0-9]+)?$"
    schema = {
        "type": "object",
        "patternProperties": {"^k[0-9]+$": {"type": "string", "pattern": code}},
        "propertyNames": {"pattern": "^[a-z0-9]+$"},
        "properties": {
            "pattern": {"type": "array", "items": {"type": "string", "pattern": code}},  # (a name)
            "tag": {"const": {"pattern": "^data$"}},  # data: left as it is
        },
        "$defs": {"d": {"anyOf": [{"type": "string", "pattern": "^a+$"}, {"type": "integer"}]}},
    }
    patterns = stand_ins(schema)
    assert sorted(patterns.values()) == sorted([code, code, "^k[0-9]+$", "^[a-z0-9]+$", "^a+$"])
    assert all(re.fullmatch(r"[a-z]+[0-9]+", name) for name in patterns)  # literals
    [key] = schema["patternProperties"]
    assert patterns[key] == "^k[0-9]+$"
    assert patterns[schema["patternProperties"][key]["pattern"]] == code
    assert patterns[schema["properties"]["pattern"]["items"]["pattern"]] == code
    assert schema["properties"]["tag"] == {"const": {"pattern": "^data$"}}
    more = stand_ins({"type": "string", "pattern": "^b$"}, patterns)  # one table for several schemas
    assert more is patterns and len(patterns) == 6 and "^b$" in patterns.values()


def test_printed_escapes_read_back_to_their_characters() -> None:
    """Every character xgrammar's printer writes in a string or a class (raw, a C escape, ``\\xHH``,
    ``\\uHHHH`` or ``\\UHHHHHHHH``) reads back as itself; a class loses what a JSON string escapes."""
    far = 0x10FFFE  # a first member, so that the class stays a class (and a caret is not first)
    forbidden = {cp for lo, hi in FORBIDDEN for cp in range(lo, hi + 1)}
    for cp in [*range(1, 0x80), 0xA0, 0xE9, 0x2028, 0xFFFF, 0x10000, 0x10FFFF]:
        printed = str(xgr.Grammar.from_ebnf(f'root ::= "a\\U{cp:08x}" [\\U{far:08x}\\U{cp:08x}]'))
        found = re.fullmatch(r'root ::= \(\(("(?:[^"\\]|\\.)*") (\[.*\])\)\)\n', printed)
        assert found is not None, printed
        string, cls = found.groups()
        assert _codepoints(string[1:-1]) == [ord("a"), cp], (cp, string)
        members = {c for lo, hi in _narrowed(cls) for c in range(lo, hi + 1)}
        assert members == {far} | ({cp} - forbidden), (cp, cls)
    assert _narrowed("[^\\x00-\\U0010fffd]") == [(0x10FFFE, 0x10FFFF)]
    with pytest.raises(ValueError, match="only characters a JSON string escapes"):
        _narrowed(r"[\"\\\0-\x1f]")


def test_two_patterns_with_nested_groups_compile_side_by_side(tiny_model: Callable[[str], Path]) -> None:
    """xgrammar's converter names a nested group's rules ``root_1_1``; each pattern's rules are renamed
    whole, so two such patterns (two ipv4 fields, two tools with one each, a grammar's two Regex rules)
    never define one rule twice."""
    backend = XGrammarBackend(str(tiny_model("qwen2_5_vl")), 0)
    ip = {"type": "string", "format": "ipv4"}
    pair = {"type": "string", "pattern": "^((a|b)(c|d))+$"}
    schema = {
        "type": "object",
        "properties": {"src": ip, "dst": ip, "p": pair, "q": pair},
        "required": ["src", "dst", "p", "q"],
        "additionalProperties": False,
    }
    good = '{"src": "10.0.0.1", "dst": "192.168.1.255", "p": "acbd", "q": "ad"}'
    bad = '{"src": "10.0.0.1", "dst": "192.168.1.256", "p": "acbd", "q": "ad"}'
    assert taken(
        backend.compile(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))), [good, bad]
    ) == [
        True,
        False,
    ]
    tools = [
        {
            "type": "function",
            "function": {"name": name, "parameters": {"type": "object", "properties": {"ip": ip}}},
        }
        for name in ("ping", "trace")
    ]
    spec = {"format": "qwen_3", "tools": tools, "tool_choice": "required", "parallel_tool_calls": False}
    call = '<tool_call>\n{{"name": "trace", "arguments": {{"ip": "{}"}}}}\n</tool_call>'
    compiled = backend.compile(Constraint(ConstraintKind.TOOL_CALLS, json.dumps(spec)))
    assert taken(compiled, [call.format("1.2.3.4"), call.format("1.2.3.04")]) == [True, False]
    grammar = 'root ::= a " " b\na ::= Regex("((a|b)(c|d))+")\nb ::= Regex("((x|y)(z|w))+")'
    compiled = backend.compile(Constraint(ConstraintKind.GRAMMAR, grammar))
    assert taken(compiled, ["acbd xz", "acb xz"]) == [True, False]
