"""The string formats the engine compiles as patterns of its own (engine/structured/formats.py) take
exactly the valid strings, checked over grids against Python's own parsers: ``ipaddress`` for IPv4 and IPv6,
``datetime`` for dates, pydantic's times (what the openai SDK's ``parse`` gives) within the documented
bounds. xgrammar's own grammars for them are shown taking some invalid strings, so the rewrite is
dropped once xgrammar's are exact."""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import json
from typing import Any

import pytest
import xgrammar as xgr
from pydantic import TypeAdapter, ValidationError

from engine.structured.formats import PATTERNS, strict_formats
from engine.structured.patterns import compile_exact

YEARS = ["0000", "0001", "0004", "0100", "0400", "1900", "2000", "2023", "2024", "9999"]
DATES = [f"{y}-{m:02d}-{d:02d}" for y in YEARS for m in range(14) for d in range(33)]
TIMES = [
    f"{h}:{m}:{s}{frac}{offset}"
    for h, m, s, frac, offset in itertools.product(
        ["00", "09", "23", "24"],
        ["00", "59", "60"],
        ["00", "59", "60"],
        ["", ".1", ".123456789", ".1234567890"],
        ["Z", "z", "+00:00", "-23:59", "+24:00", "+05:60", ""],
    )
]
OCTETS = [
    "0",
    "00",
    "000",
    "01",
    "010",
    "9",
    "10",
    "99",
    "100",
    "199",
    "249",
    "250",
    "255",
    "256",
    "300",
    "999",
]


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo([bytes([i]) for i in range(256)]), cache_enabled=False)


def acceptor(compiler: xgr.GrammarCompiler, schema: dict[str, Any], exact: bool = True) -> Any:
    """Whether a value's JSON text is taken: by the engine's compile (``exact``), or xgrammar's own."""
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    compiled = compile_exact(xgr, compiler, grammar) if exact else compiler.compile_grammar(grammar)

    def accepts(value: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return bool(matcher.accept_string(json.dumps(value))) and matcher.is_completed()

    return accepts


def strict(fmt: str) -> dict[str, Any]:
    return dict(strict_formats({"type": "string", "format": fmt}))


def a_date(text: str) -> bool:
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return True


def a_time(text: str) -> bool:
    """pydantic's time, with an offset (RFC 3339's full-time), upper-case, at most 9 digits of fraction."""
    if text.endswith("Z"):
        body = text[:-1]
    elif text[-6:-5] in ("+", "-"):
        body = text[:-6]
    else:
        return False
    if len(body) > len("hh:mm:ss.123456789"):
        return False
    try:
        TypeAdapter(datetime.time).validate_python(text)
    except ValidationError:
        return False
    return True


def an_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


def test_a_date_is_a_day_of_the_calendar(compiler: xgr.GrammarCompiler) -> None:
    accepts = acceptor(compiler, strict("date"))
    wrong = [text for text in DATES if accepts(text) != a_date(text)]
    assert not wrong, wrong[:10]
    assert accepts("2000-02-29") and accepts("0004-02-29") and not accepts("1900-02-29")
    loose = acceptor(compiler, {"type": "string", "format": "date"}, exact=False)
    assert loose("2023-02-30") and loose("0000-01-01"), "xgrammar's date is exact now: drop the rewrite"


def test_a_time_has_its_offset_and_a_bounded_fraction(compiler: xgr.GrammarCompiler) -> None:
    accepts = acceptor(compiler, strict("time"))
    wrong = [text for text in TIMES if accepts(text) != a_time(text)]
    assert not wrong, wrong[:10]
    assert accepts("23:59:59.123456789+05:30") and not accepts("23:59:60Z")
    assert not accepts("00:00:0000000000+00:00")  # (xgrammar's own X? would take it: patterns.py)


def test_a_date_time_is_a_valid_day_and_time(compiler: xgr.GrammarCompiler) -> None:
    accepts = acceptor(compiler, strict("date-time"))
    days = ["2024-02-29", "2023-02-29", "2023-04-31", "0000-01-01", "9999-12-31"]
    for day, time in itertools.product(days, TIMES[::7]):
        assert accepts(f"{day}T{time}") == (a_date(day) and a_time(time)), f"{day}T{time}"
    assert not accepts("2023-01-01t12:00:00Z") and not accepts("2023-01-01 12:00:00Z")
    loose = acceptor(compiler, {"type": "string", "format": "date-time"}, exact=False)
    assert loose("2023-02-30T12:00:00Z"), "xgrammar's date-time is exact now: drop the rewrite"


def test_an_ipv4_address_has_no_leading_zeros(compiler: xgr.GrammarCompiler) -> None:
    accepts = acceptor(compiler, strict("ipv4"))
    for octet in OCTETS:
        for text in (f"{octet}.1.2.3", f"1.2.3.{octet}", f"1.{octet}.{octet}.1"):
            assert accepts(text) == an_ipv4(text), text
    assert not accepts("1.2.3") and not accepts("1.2.3.4.5")
    loose = acceptor(compiler, {"type": "string", "format": "ipv4"}, exact=False)
    assert loose("000.000.000.000"), "xgrammar's ipv4 is exact now: drop the rewrite"


def an_ipv6(text: str) -> bool:
    """Python's IPv6 address, without a zone (``%eth0``: not in JSON Schema's ipv6)."""
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return "%" not in text


def ipv6_texts() -> list[str]:
    """Every split of 0 to 9 groups around at most two "::" (groups of 1 to 5 digits), with and
    without an IPv4 tail (a leading zero in it too)."""
    groups = ["0", "ab", "FfFf", "00000"]
    texts = []
    for before, after in itertools.product(range(10), range(10)):
        for tail in ("", "1.2.3.4", "1.2.03.4"):
            for g in groups:
                left = ":".join([groups[i % 3] for i in range(before)] + ([g] if before else []))
                right = ":".join([groups[(i + 1) % 3] for i in range(after)] + ([tail] if tail else []))
                texts += [f"{left}::{right}", f"{left}:{right}" if left and right else left or right]
    return sorted(set(texts)) + ["::1::", ":::", "1:2:3:4:5:6:7:8%0", ":1::", "::1:"]


def test_an_ipv6_address_is_what_python_reads(compiler: xgr.GrammarCompiler) -> None:
    accepts = acceptor(compiler, strict("ipv6"))
    texts = ipv6_texts()
    wrong = [text for text in texts if accepts(text) != an_ipv6(text)]
    assert not wrong, wrong[:10]
    assert sum(map(an_ipv6, texts)) > 100 and accepts("1:2:3:4:5:6:1.2.3.4") and accepts("::")
    loose = acceptor(compiler, {"type": "string", "format": "ipv6"}, exact=False)
    assert loose("::1.02.3.4") and not loose("1:2:3:4:5:6:1.2.3.4"), "xgrammar's ipv6 is exact now: drop it"


def test_the_rewrite_reaches_every_subschema_and_no_data() -> None:
    schema = {
        "type": "object",
        "properties": {
            "when": {"type": ["string", "null"], "format": "date"},
            "hosts": {"type": "array", "items": {"type": "string", "format": "ipv4"}},
            "format": {"type": "string", "format": "email"},  # a property named format; a format kept
            "tag": {"const": {"format": "date"}},  # data: left as it is
        },
        "$defs": {"t": {"anyOf": [{"type": "string", "format": "time"}, {"type": "integer"}]}},
    }
    rewritten = strict_formats(json.loads(json.dumps(schema)))
    properties = rewritten["properties"]
    assert properties["when"] == {"type": ["string", "null"], "pattern": PATTERNS["date"]}
    assert properties["hosts"]["items"] == {"type": "string", "pattern": PATTERNS["ipv4"]}
    assert properties["format"] == {"type": "string", "format": "email"}
    assert properties["tag"] == {"const": {"format": "date"}}
    assert rewritten["$defs"]["t"]["anyOf"][0] == {"type": "string", "pattern": PATTERNS["time"]}
