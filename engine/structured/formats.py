"""String formats compiled as patterns of the engine's own (docs/api.md, "Structured outputs").

xgrammar's grammars for a few formats take strings the format forbids: an IPv4 address with an octet
written ``01`` or ``000`` (Python's ``ipaddress`` and the ``jsonschema`` package refuse it), an IPv6
address whose IPv4 tail has one (while it refuses ``1:2:3:4:5:6:1.2.3.4``: six groups and a tail), a
date that is no day (``2023-02-30``, ``2023-04-31``, the 29th of February of a year that is not leap, the year
0000), and a time whose fraction of a second never ends, so that an answer may run on until its max
tokens. Before xgrammar compiles a schema, each such ``format`` becomes a ``pattern`` (which xgrammar
matches against the whole string) that takes exactly the valid strings, with these bounds of their
own: at most 9 digits of a second's fraction, no leap second (``:60``, which Python's and pydantic's
times cannot hold), ``T`` and ``Z`` upper-case.
"""

from __future__ import annotations

from typing import Any

from engine.structured.json_schemas import subschemas

_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"  # 0001 to 9999
# divisible by 4 and not by 100 (its last two digits), or by 400 (its first two, divisible by 4)
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = "((0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])|(0[13-9]|1[0-2])-(29|30)|(0[13578]|1[02])-31)"
_DATE = f"({_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]([.][0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_IPV4 = f"{_OCTET}([.]{_OCTET}){{3}}"
_GROUP = "[0-9A-Fa-f]{1,4}"
_LAST_32 = f"({_GROUP}:{_GROUP}|{_IPV4})"  # the last 32 bits: two groups or an IPv4 address
# RFC 3986's IPv6address (RFC 4291's text forms, no zone): 8 groups, or "::" standing for one or more
# zero groups with at most 7 around it; the last two may be written as an IPv4 address
_IPV6 = "|".join(
    [f"({_GROUP}:){{6}}{_LAST_32}", f"::({_GROUP}:){{5}}{_LAST_32}"]
    + [f"(({_GROUP}:){{0,{k}}}{_GROUP})?::({_GROUP}:){{{4 - k}}}{_LAST_32}" for k in range(5)]
    + [f"(({_GROUP}:){{0,5}}{_GROUP})?::{_GROUP}", f"(({_GROUP}:){{0,6}}{_GROUP})?::"]
)
PATTERNS = {
    "ipv4": _IPV4,
    "ipv6": f"({_IPV6})",
    "date": _DATE,
    "date-time": f"{_DATE}T{_TIME}",
    "time": _TIME,
}


def strict_formats(schema: Any) -> Any:
    """``schema`` (parsed JSON, changed in place) with each format of ``PATTERNS`` as its pattern."""
    if isinstance(schema, dict):
        for node, _, _ in subschemas(schema):
            fmt = node.get("format")
            if isinstance(fmt, str) and fmt in PATTERNS and "pattern" not in node:  # (both: refused)
                del node["format"]
                node["pattern"] = PATTERNS[fmt]
    return schema
