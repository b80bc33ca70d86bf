"""A JSON Schema's ``pattern`` compiled exactly (docs/api.md, "Structured outputs").

xgrammar compiles a JSON schema's ``pattern`` (and a ``patternProperties`` name) into one automaton of
its regex builder, ``Regex("…", json_string=true)`` in the schema's grammar (a tool's parameters' too),
and that builder takes strings the regex forbids: its ``X?`` adds an empty
path from X's start to its end, which X's own loops then follow (``^[A-Z]{3}( [0-9]+)?$`` takes
``ABC12``: the ``[0-9]+`` without its space), and its state merging lets ``(a|a{1,2})`` take ``aaa``.
Its regex-to-grammar converter (``Grammar.from_regex``, what a ``structured_outputs.regex`` compiles
with) reads the same regexes exactly. So before a grammar is compiled, each such automaton is replaced
by the converter's rules for its regex; a JSON string's keeps the limit the automaton had: no quote,
backslash or control character unescaped (a class loses them, so ``.`` or ``[^a]`` never reach them).

xgrammar builds its automaton for each pattern when the schema becomes a grammar, which takes long for
a bounded repetition (``([a-z0-9]{2,300}@){1,30}``: 0.15 s; a schema of 120 such, 18 s) and would be
thrown away. So the schema's patterns are first replaced by literal stand-ins (``stand_ins``), whose
automata cost nothing, and each stand-in's rule is made from the pattern it stands for.

The grammar is xgrammar's printed EBNF, edited as text: quoted strings and character classes are read
with the printer's escapes (xgrammar's ``cpp/support/encoding.h``), and only rule names and
``Regex(...)`` outside them are touched. A user's EBNF grammar (``structured_outputs.grammar``) goes the
same way where it has a ``Regex``, once its classes are written so that their printed text reads back
the same: xgrammar prints a class whose first member is an escaped caret as a negation.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from engine.structured.json_schemas import subschemas

MAX_CODEPOINT = 0x10FFFF
# what a JSON string's text cannot hold unescaped: the quote, the backslash, the control characters
FORBIDDEN = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
_ESCAPES = {
    "'": 0x27, '"': 0x22, "?": 0x3F, "\\": 0x5C, "/": 0x2F, "-": 0x2D, "]": 0x5D, "[": 0x5B, "^": 0x5E,
    "a": 0x07, "b": 0x08, "f": 0x0C, "n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B, "0": 0x00, "e": 0x1B,
}  # fmt: skip
_HEX_WIDTH = {"x": 2, "u": 4, "U": 8}
_JSON_STRING_CLOSE = ", json_string=true)"
_REGEX_CALL = re.compile(r"\bRegex\($")
_CARET = re.compile(r"\\(\^|x5[eE]|u005[eE]|U0000005[eE]|u\{0*5[eE]\})")  # an escaped caret
_RULE_NAME = re.compile(r"\broot((?:_\d+)*)\b")  # (root, root_2, root_1_1: the converter's names)
_STAND_IN = "mmservepattern{}"  # (a literal: its automaton is a chain of a few states)

Ranges = list[tuple[int, int]]


class PatternError(ValueError):
    """A pattern this compile cannot keep exact: a class that allows no character a JSON string holds
    unescaped, or a range from a caret."""


def stand_ins(schema: Any, patterns: dict[str, str] | None = None) -> dict[str, str]:
    """``schema`` (parsed JSON, changed in place) with each pattern, a ``pattern``'s or a
    ``patternProperties`` name, replaced by a literal stand-in; the patterns by their stand-ins, added
    to ``patterns`` where given (one table for several schemas: a tool call's)."""
    patterns = {} if patterns is None else patterns
    if not isinstance(schema, dict):
        return patterns

    def stand_in(pattern: str) -> str:
        name = _STAND_IN.format(len(patterns))
        patterns[name] = pattern
        return name

    for node, _, _ in subschemas(schema):
        if isinstance(node.get("pattern"), str):
            node["pattern"] = stand_in(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            node["patternProperties"] = {stand_in(k): v for k, v in node["patternProperties"].items()}
    return patterns


def compile_exact(xgr: Any, compiler: Any, grammar: Any, patterns: dict[str, str] | None = None) -> Any:
    """``grammar`` (an xgrammar ``Grammar``) compiled by ``compiler`` (a ``GrammarCompiler`` of the
    module ``xgr``, passed in: xgrammar loads only where a constraint comes), each regex in it read by
    xgrammar's regex converter: a stand-in's (``stand_ins``), the pattern it stands for."""
    table = patterns or {}
    exact = exact_patterns(str(grammar), lambda regex: _converted(xgr, table.get(regex, regex)))
    return compiler.compile_grammar(grammar if exact is None else exact)


def _converted(xgr: Any, regex: str) -> str:
    """xgrammar's rules for ``regex``, printed (its classes never begin with a caret)."""
    return str(xgr.Grammar.from_regex(_caret_last(regex)))


def exact_patterns(ebnf: str, from_regex: Callable[[str], str]) -> str | None:
    """``ebnf`` with each ``Regex("…")`` replaced by a rule made of ``from_regex(pattern)``
    (xgrammar's converter: EBNF whose root rule is ``root``), one with ``json_string=true`` kept
    within a JSON string's characters; None where it has none (compile the grammar as it is)."""
    if "Regex(" not in ebnf:
        return None
    prefix = _fresh_prefix(ebnf)
    parts: list[str] = []
    rules: list[str] = []
    segments = list(_segments(ebnf))
    index = 0
    while index < len(segments):
        kind, text = segments[index]
        ahead = segments[index + 1 : index + 3]
        closing = ahead[1][1] if len(ahead) == 2 and ahead[0][0] == "string" else ""
        json_string = closing.startswith(_JSON_STRING_CLOSE)
        if kind == "other" and _REGEX_CALL.search(text) and (json_string or closing.startswith(")")):
            name = f"{prefix}{len(rules)}"
            pattern = "".join(map(chr, _codepoints(ahead[0][1][1:-1])))
            rules.append(_renamed(from_regex(pattern), name, json_string))
            close = _JSON_STRING_CLOSE if json_string else ")"
            parts += [_REGEX_CALL.sub("", text), name]
            segments[index + 2] = ("other", closing.removeprefix(close))  # (it may open the next)
            index += 2
        else:
            parts.append(text)
            index += 1
    if not rules:
        return None
    return _fixed_width("".join(parts) + "\n" + "\n".join(rules) + "\n")


def _fixed_width(ebnf: str) -> str:
    """``ebnf`` with each ``\\xHH`` in its strings and classes written ``\\u00HH``: xgrammar prints
    U+0080 to U+00FF so, but reads ``\\x`` on over every hex digit that follows (``\\xb0C``, °C,
    would read back as U+0B0C)."""
    out = []
    for kind, text in _segments(ebnf):
        if kind != "other" and "\\x" in text:
            pieces, i = [], 0
            while i < len(text):
                step = 2 if text[i] == "\\" else 1
                pieces.append("\\u00" if text[i : i + 2] == "\\x" else text[i : i + step])
                i += step
            text = "".join(pieces)
        out.append(text)
    return "".join(out)


def _renamed(ebnf: str, name: str, json_string: bool) -> str:
    """The converter's rules renamed under ``name`` (its root: ``name`` itself); for a JSON string,
    each class narrowed to the characters it holds unescaped (a literal of the others is refused)."""
    out = []
    for kind, text in _segments(ebnf):
        if kind == "other":
            out.append(_RULE_NAME.sub(lambda m: name + m.group(1), text))
        elif not json_string:
            out.append(text)
        elif kind == "string":
            if _overlaps([(cp, cp) for cp in _codepoints(text[1:-1])], FORBIDDEN):
                raise PatternError("a pattern names a quote, a backslash or a control character")
            out.append(text)
        else:
            out.append(_class(_narrowed(text)))
    return "".join(out)


def _narrowed(class_text: str) -> Ranges:
    """A printed class's characters (``[a-z]``, ``[^a]``) less the ones a JSON string escapes."""
    negated = class_text.startswith("[^")
    codepoints = _codepoints(class_text[2 if negated else 1 : -1], in_class=True)
    ranges: Ranges = []
    i = 0
    while i < len(codepoints):
        if i + 2 < len(codepoints) and codepoints[i + 1] == -1:  # (a range's dash)
            ranges.append((codepoints[i], codepoints[i + 2]))
            i += 3
        else:
            ranges.append((codepoints[i], codepoints[i]))
            i += 1
    taken = _complement(ranges) if negated else _merged(ranges)
    allowed = _subtract(taken, FORBIDDEN)
    if not allowed:
        raise PatternError("a pattern's class holds only characters a JSON string escapes")
    return allowed


def _class(ranges: Ranges) -> str:
    return "[" + "".join(_hex(lo) + ("" if lo == hi else "-" + _hex(hi)) for lo, hi in ranges) + "]"


def _hex(codepoint: int) -> str:
    return f"\\u{codepoint:04x}" if codepoint <= 0xFFFF else f"\\U{codepoint:08x}"  # (fixed widths)


def _codepoints(text: str, in_class: bool = False) -> list[int]:
    """A printed string's or class's characters; in a class an unescaped ``-`` (a range) is -1."""
    out, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch != "\\":
            out.append(-1 if in_class and ch == "-" else ord(ch))
            i += 1
            continue
        kind = text[i + 1]
        if kind in _HEX_WIDTH:
            width = _HEX_WIDTH[kind]
            out.append(int(text[i + 2 : i + 2 + width], 16))
            i += 2 + width
        else:
            out.append(_ESCAPES[kind])
            i += 2
    return out


def _caret_last(regex: str) -> str:
    """``regex`` with a class that begins with escaped carets (``[\\^a]``) written with them last
    (``[a\\^]``), the same class: xgrammar prints a class's members in order, and a caret printed
    first would read back as the class's negation. A range from a caret (``[\\^-a]``, which xgrammar
    reads apart from Python) is refused."""
    out, i = [], 0
    while i < len(regex):
        ch = regex[i]
        if ch == "\\":
            out.append(regex[i : i + 2])
            i += 2
        elif ch == "[":
            j = i + 1
            while j < len(regex) and regex[j] != "]":
                j += 2 if regex[j] == "\\" else 1
            body, carets = _carets_moved(regex[i + 1 : j])
            out.append(f"[{body}]" if body else "\\^" if carets else "[]")
            i = j + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _carets_moved(body: str) -> tuple[str, bool]:
    """A class's body with its leading escaped carets written last, and whether it had any; "" for a
    class of carets alone. A range from a caret is refused."""
    carets = 0
    while (caret := _CARET.match(body)) is not None:
        body, carets = body[caret.end() :], carets + 1
        if body.startswith("-") and len(body) > 1:
            raise PatternError("a class range that starts at a caret is not supported")
    return (f"{body}\\^" if carets and body else body), carets > 0


def exact_ebnf(xgr: Any, compiler: Any, ebnf: str) -> Any:
    """A user's EBNF grammar compiled with each of its ``Regex("…")`` read by xgrammar's regex
    converter (as a schema's patterns are): its classes are first written so that their printed text
    reads back the same (leading escaped carets last; a class of carets alone as the string ``"^"``)."""
    if "Regex(" not in ebnf:
        return compiler.compile_grammar(ebnf)
    parts = []
    for kind, text in _segments(ebnf):
        if kind == "class" and not text.startswith("[^"):
            body, carets = _carets_moved(text[1:-1])
            text = f"[{body}]" if body or not carets else '"^"'
        parts.append(text)
    return compile_exact(xgr, compiler, xgr.Grammar.from_ebnf("".join(parts)))


def _segments(ebnf: str) -> Iterator[tuple[str, str]]:
    """``ebnf`` as ("string", ``"…"``), ("class", ``[…]``) and ("other", the rest) pieces, in order."""
    start = i = 0
    while i < len(ebnf):
        ch = ebnf[i]
        if ch == "#":  # a comment (a user's grammar), to the end of its line
            newline = ebnf.find("\n", i)
            i = len(ebnf) if newline < 0 else newline
        elif ch in '"[':
            close = '"' if ch == '"' else "]"
            j = i + 1
            while j < len(ebnf) and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            if j >= len(ebnf):  # unclosed: xgrammar's parser says where
                break
            if start < i:
                yield "other", ebnf[start:i]
            yield ("string" if ch == '"' else "class"), ebnf[i : j + 1]
            start = i = j + 1
        else:
            i += 1
    if start < len(ebnf):
        yield "other", ebnf[start:]


def _fresh_prefix(ebnf: str) -> str:
    prefix = "mmserve_pattern_"
    while prefix in ebnf:
        prefix = "x" + prefix
    return prefix


def _merged(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges: Ranges) -> Ranges:
    out, next_lo = [], 0
    for lo, hi in _merged(ranges):
        if lo > next_lo:
            out.append((next_lo, lo - 1))
        next_lo = hi + 1
    if next_lo <= MAX_CODEPOINT:
        out.append((next_lo, MAX_CODEPOINT))
    return out


def _subtract(ranges: Ranges, removed: tuple[tuple[int, int], ...]) -> Ranges:
    kept = _complement(list(removed))
    return [
        (max(lo, k_lo), min(hi, k_hi))
        for lo, hi in _merged(ranges)
        for k_lo, k_hi in kept
        if max(lo, k_lo) <= min(hi, k_hi)
    ]


def _overlaps(ranges: Ranges, others: tuple[tuple[int, int], ...]) -> bool:
    return any(max(lo, o_lo) <= min(hi, o_hi) for lo, hi in ranges for o_lo, o_hi in others)
