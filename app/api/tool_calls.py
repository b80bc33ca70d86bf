"""Hermes-style tool calls in the output of the Qwen2.5 / Qwen3 families, as OpenAI ``tool_calls``.

The model writes free text and zero or more calls, each::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the calls is content. A call is the span from a ``<tool_call>`` to the first
``</tool_call>`` after it outside a JSON string (a string argument may hold the tag: code, markup). A
span whose JSON does not decode to a name and an arguments object stays in the content as raw text, so
the client sees what the model said. An unterminated ``<tool_call>`` (the output cut by the max tokens:
a started call is constrained to the end) is an incomplete call when its name was written, with the
arguments' text so far (none, cut before them), as OpenAI returns a call cut off; cut before its name,
it is dropped: markup is never content. So is the start of ``<tool_call>`` (``<tool_``) that ends an
output cut off by the max tokens or a stop string: a call was being opened. ``parse_tool_calls``
reads a whole output; ``ToolCallStreamer`` reads it delta by delta and reassembles to exactly the same
result for any split of the text.

An answer constrained to be an output format's JSON alone or calls alone (``answer_or_calls``: tools
beside a JSON output format, docs/api.md "Tool calling") is read as calls only where it begins with a
tag: the JSON answer is content whole, ``<tool_call>`` in its strings included.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

CallIdFactory = Callable[[], str]
# the start of a call cut off after its name: ``{"name": "get_weather", "arguments": {"city": "Pa``
_CUT_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")(.*)', re.DOTALL)
_CUT_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*(.*)', re.DOTALL)  # (what of them was written)
# in a call's JSON: outside a string, a quote opens one and a close tag ends the call; inside, an escape
# is skipped and a quote closes it
_OUTSIDE_STRING = re.compile('"|' + re.escape(CLOSE_TAG))
_INSIDE_STRING = re.compile(r'\\.|"', re.DOTALL)


def new_call_id() -> str:
    """An OpenAI-like call id: ``call_`` and 24 hex characters."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One decoded call; ``arguments`` is the arguments object as compact JSON text, or for a call cut
    off (``complete`` False) the text the model wrote of it."""

    id: str
    name: str
    arguments: str
    complete: bool = True


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output split into content (None when only whitespace is left) and calls; ``cut_off``: it
    ended inside a call (the max tokens, a stop string)."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    cut_off: bool = False


@dataclass(frozen=True)
class ContentDelta:
    """Content text to append to the message."""

    content: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call ``index``: the first carries ``id`` and ``name``, the rest argument fragments."""

    index: int
    id: str | None
    name: str | None
    arguments: str
    complete: bool = True  # False on the arguments of a call cut off by the max tokens


StreamDelta = ContentDelta | ToolCallDelta


def _decode_call(body: str) -> tuple[str, str] | None:
    """``(name, compact arguments JSON)`` for the text between the tags, or None if it is no call.

    "arguments" may be an object or a JSON string holding one (decoded once); a missing "arguments"
    means no arguments. Anything else, and arguments that do not re-serialise as strict JSON (NaN),
    is not a call.
    """
    try:
        call = json.loads(body)
        if not isinstance(call, dict):
            return None
        name, arguments = call.get("name"), call.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            return None
        return name, _compact_json(arguments)
    except (ValueError, RecursionError):  # json.JSONDecodeError is a ValueError
        return None


def _cut_call(body: str) -> tuple[str, str] | None:
    """``(name, the arguments' text so far)`` of an unterminated call whose name was written, else None."""
    match = _CUT_CALL.match(body)
    if match is None:
        return None
    try:
        name = json.loads(match.group(1))
    except ValueError:
        return None
    if not name:
        return None
    arguments_so_far = _CUT_ARGUMENTS.match(match.group(2))
    if arguments_so_far is None:  # cut between its name and its arguments: none written
        return name, ""
    written = arguments_so_far.group(1)
    try:  # arguments whole, the call cut after them (in its closing brace or tag): only the arguments
        arguments, _ = json.JSONDecoder().raw_decode(written.lstrip())
    except (ValueError, RecursionError):
        return name, written.rstrip()
    return name, _compact_json(arguments) if isinstance(arguments, dict) else written.rstrip()


class _CallEnd:
    """Where an open call's body ends: at the first close tag outside a JSON string, found as the body
    grows (each character is read once). A body that does not begin as JSON (``{``) ends at its first
    close tag."""

    def __init__(self) -> None:
        self._pos = 0  # the body is read up to here
        self._in_string = False
        self._json: bool | None = None  # undecided while the body is whitespace

    def find(self, body: str) -> int:
        """The index in ``body`` (the call's text so far, after ``<tool_call>``) of its close tag, or -1."""
        if self._json is None:
            first = body.lstrip()[:1]
            if not first:
                return -1
            self._json = first == "{"
        if not self._json:
            end = body.find(CLOSE_TAG, self._pos)
            self._pos = max(self._pos, len(body) - len(CLOSE_TAG) + 1)
            return end
        while True:
            if self._in_string:
                found = _INSIDE_STRING.search(body, self._pos)
                if found is None:  # (an unread backslash that ends the body escapes what comes next)
                    unread_backslash = self._pos < len(body) and body.endswith("\\")
                    self._pos = len(body) - 1 if unread_backslash else len(body)
                    return -1
                self._pos, self._in_string = found.end(), found.group() != '"'
                continue
            found = _OUTSIDE_STRING.search(body, self._pos)
            if found is None:
                self._pos = max(self._pos, len(body) - len(CLOSE_TAG) + 1)
                return -1
            if found.group() == CLOSE_TAG:
                return found.start()
            self._pos, self._in_string = found.end(), True


def _compact_json(value: dict[str, Any]) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def parse_tool_calls(
    text: str, new_call_id: CallIdFactory = new_call_id, *, cut: bool = False, answer_or_calls: bool = False
) -> ParsedOutput:
    """Splits a finished output into content and calls; ids come from ``new_call_id``, in order.

    Content is the text outside the decoded calls, joined, less the whitespace at its ends that touches
    a call (the newlines the template puts around calls do not become content); an answer without calls
    is content as written. ``cut``: the output was cut off (the max tokens, a stop string), not ended
    by the model. ``answer_or_calls``: the output is an answer alone or calls alone (the module's
    docstring).
    """
    if answer_or_calls and _answers(text):
        return ParsedOutput(text or None)
    between: list[str] = [""]  # the text before each call, and after the last
    tool_calls: list[ToolCall] = []
    pos, cut_off = 0, False
    while (start := text.find(OPEN_TAG, pos)) >= 0:
        body_at = start + len(OPEN_TAG)
        end = _CallEnd().find(text[body_at:])
        end = end + body_at if end >= 0 else -1
        between[-1] += text[pos:start]
        if end < 0:  # cut off: an incomplete call, or nothing
            written = _cut_call(text[start + len(OPEN_TAG) :])
            if written is not None:
                tool_calls.append(ToolCall(new_call_id(), *written, complete=False))
            pos, cut_off = len(text), True
            between.append("")
            break
        decoded = _decode_call(text[start + len(OPEN_TAG) : end])
        if decoded is None:
            between[-1] += text[start : end + len(CLOSE_TAG)]
        else:
            tool_calls.append(ToolCall(new_call_id(), *decoded))
            between.append("")
        pos = end + len(CLOSE_TAG)
    rest = text[pos:]
    if cut and not cut_off and (opening := _partial_tag_len(rest)):
        between[-1] += rest[:-opening]
        between.append("")
        cut_off = True
    else:
        between[-1] += rest
    return ParsedOutput(_untouched(between) or None, tool_calls, cut_off)


def _untouched(between: list[str]) -> str:
    """The text between calls joined, less its leading whitespace where a call comes before any text,
    and its trailing whitespace where no text follows the last call."""
    content = "".join(between)
    if len(between) > 1 and not between[0].strip():
        content = content.lstrip()
    if len(between) > 1 and not between[-1].strip():
        content = content.rstrip()
    return content


def finish_reason(parsed: ParsedOutput, engine_reason: str) -> str:
    """OpenAI's ``"tool_calls"`` when the model stopped by itself after calling; else the engine's (a
    call cut off, by a stop string too, is no reason to say the answer ended in calls)."""
    return _finish_reason(bool(parsed.tool_calls), parsed.cut_off, engine_reason)


def _finish_reason(called: bool, cut_off: bool, engine_reason: str) -> str:
    return "tool_calls" if called and not cut_off and engine_reason == "stop" else engine_reason


class ToolCallStreamer:
    """Turns the text deltas of one output into content and tool-call deltas, as they arrive.

    ``push`` is called with each text delta in order, ``finish`` once after the last. What holds: the
    content deltas concatenate to ``parse_tool_calls(text).content`` (or "" for None), and the call
    deltas grouped by index give its calls, ids included when both use the same id factory. Outside a
    call, text streams at once except a tail that could still grow into ``<tool_call>`` and trailing
    whitespace (held until more content follows; at the end, sent unless a call came after the last
    content), and whitespace after a call before any content is dropped. A call is held whole until
    ``</tool_call>``, since only then is it known to decode; it is sent as one delta with id and name
    and one with all of its arguments, or as content if it does not decode.
    """

    def __init__(self, new_call_id: CallIdFactory = new_call_id, *, answer_or_calls: bool = False) -> None:
        self._new_call_id = new_call_id
        # an answer alone, decided at its first character (``parse_tool_calls``' answer_or_calls)
        self._answer: bool | None = None if answer_or_calls else False
        self._buffer = ""  # undecided text: a partial open tag, or the body of the open call
        self._in_call = False
        self._call_end = _CallEnd()  # the open call's
        self._pending_whitespace = ""  # whitespace after the last content, sent when more follows
        self._sent_content = False
        self._called = False  # a call came
        self._called_since_content = False  # a call came after the last content sent
        self._finished = False
        self.num_tool_calls = 0
        self.cut_off = False  # the output ended inside a call

    def push(self, delta: str) -> list[StreamDelta]:
        """Called with each new piece of output text; returns the deltas now decided."""
        assert not self._finished, "push after finish"
        self._buffer += delta
        if self._answer is None and self._buffer.strip():
            self._answer = _answers(self._buffer)
        if self._answer:
            text, self._buffer = self._pending_whitespace + self._buffer, ""
            self._pending_whitespace = ""
            return [ContentDelta(text)] if text else []
        out: list[StreamDelta] = []
        while True:
            if self._in_call:
                end = self._call_end.find(self._buffer)
                if end < 0:
                    return out
                out += self._close_call(self._buffer[:end])
                self._buffer = self._buffer[end + len(CLOSE_TAG) :]
                self._in_call = False
            else:
                start = self._buffer.find(OPEN_TAG)
                if start < 0:
                    held = _partial_tag_len(self._buffer)
                    out += self._content(self._buffer[: len(self._buffer) - held])
                    self._buffer = self._buffer[len(self._buffer) - held :]
                    return out
                out += self._content(self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN_TAG) :]
                self._in_call, self._call_end = True, _CallEnd()

    def finish(self, cut: bool = False) -> list[StreamDelta]:
        """Called once after the last ``push``: releases held text; an unterminated call is an incomplete
        call (or nothing), as ``parse_tool_calls`` reads it, with the same ``cut``."""
        self._finished = True
        rest, self._buffer = self._buffer, ""
        if not self._in_call:
            if cut and _partial_tag_len(rest):  # (all of what is held: the open tag's start)
                self.cut_off = True
                return []
            out = self._content(rest)
            if self._pending_whitespace and not self._called_since_content:
                out.append(ContentDelta(self._pending_whitespace))
            return out
        self.cut_off = True
        written = _cut_call(rest)
        return [] if written is None else self._call(*written, complete=False)

    def finish_reason(self, engine_reason: str) -> str:
        """``finish_reason`` for the streamed output, once ``finish`` ran."""
        return _finish_reason(self.num_tool_calls > 0, self.cut_off, engine_reason)

    def _close_call(self, body: str) -> list[StreamDelta]:
        decoded = _decode_call(body)
        if decoded is None:
            return self._content(OPEN_TAG + body + CLOSE_TAG)
        self._called = self._called_since_content = True
        return self._call(*decoded)

    def _call(self, name: str, arguments: str, complete: bool = True) -> list[StreamDelta]:
        """A call's two deltas: its id and name, then its arguments."""
        index = self.num_tool_calls
        self.num_tool_calls += 1
        return [
            ToolCallDelta(index, self._new_call_id(), name, ""),
            ToolCallDelta(index, None, None, arguments, complete),
        ]

    def _content(self, text: str) -> list[StreamDelta]:
        """Content outside calls, with whitespace trimmed as ``parse_tool_calls`` trims it."""
        text = self._pending_whitespace + text
        kept = text.rstrip()
        self._pending_whitespace = text[len(kept) :]
        if not self._sent_content and self._called:
            kept = kept.lstrip()
        if not kept:
            return []
        self._sent_content, self._called_since_content = True, False
        return [ContentDelta(kept)]


def _answers(text: str) -> bool:
    """Whether an answer-or-calls output (with more than whitespace) is the answer: it opens no call."""
    return not text.lstrip().startswith(OPEN_TAG[0])


def _partial_tag_len(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``<tool_call>``."""
    for length in range(min(len(text), len(OPEN_TAG) - 1), 0, -1):
        if OPEN_TAG.startswith(text[-length:]):
            return length
    return 0
