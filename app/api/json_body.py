"""Request bodies decoded as strict JSON (docs/api.md, "Errors"): every route's ``Request.json()`` is
msgspec's decoder instead of the standard library's, which lets through what no later step can handle:
a lone UTF-16 surrogate escape (``"\\ud800"``: a Python string that cannot be encoded, so tokenizers,
answers and engine messages fail on it), ``NaN`` and ``Infinity``, and nesting deep enough to exhaust
the stack. Each is the same 400 ``invalid_json`` as a syntax error, with the byte where it was found."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from fastapi import Request, Response
from fastapi.routing import APIRoute

_AT_BYTE = re.compile(r"\s*\(byte (\d+)\)$")
_ESCAPE = re.compile(rb"(\\+)(u)([0-9a-fA-F]{4})")
_HUGE_NUMBER = re.compile(rb"-?[0-9]+(?:\.[0-9]+)?[eE]\+?[0-9]{3,}|-?[0-9]{309,}(?:\.[0-9]+)?")


def decode_json(body: bytes) -> Any:
    """The body's JSON value; ``json.JSONDecodeError`` (FastAPI's 400 ``json_invalid``) where it is not
    strict JSON."""
    try:
        return msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        reason, position = _reason(exc, body)
    raise json.JSONDecodeError(reason, body.decode("utf-8", "replace"), position)


def _reason(exc: Exception, body: bytes) -> tuple[str, int]:
    if isinstance(exc, RecursionError):
        return "arrays or objects are nested too deeply", 0
    if isinstance(exc, UnicodeDecodeError):  # (its position is within the string msgspec was reading)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as whole:
            return "the body is not UTF-8", whole.start
        return "the body is not UTF-8", 0
    if isinstance(exc, msgspec.ValidationError):  # "Number out of range - at `$[...]`"
        return "a number is out of range (beyond a 64-bit float)", _too_large_number(body)
    message = str(exc).removeprefix("JSON is malformed: ")
    found = _AT_BYTE.search(message)
    if found is not None:
        return message[: found.start()], int(found.group(1))
    lone = _lone_surrogate(body)
    if lone is not None:
        return "a lone UTF-16 surrogate escape (\\ud800 to \\udfff outside a pair)", lone
    return message, 0


def _too_large_number(body: bytes) -> int:
    """Where the body's first number that no 64-bit float holds starts (``1e400``, 309 digits): found
    by its shape alone (one regex search, fast on a large body), so such a number inside a string
    before it would be named instead."""
    for found in _HUGE_NUMBER.finditer(body):
        if math.isinf(float(found.group())):
            return found.start()
    return 0


def _lone_surrogate(body: bytes) -> int | None:
    """Where the body has a ``\\uD800``-``\\uDFFF`` escape outside a high-low pair, or None. An escape
    is one whose backslashes before the ``u`` are odd in number (``\\\\u`` is a backslash and a u)."""
    escapes = [
        (match.start(2) - 1, int(match.group(3), 16))
        for match in _ESCAPE.finditer(body)
        if len(match.group(1)) % 2 == 1
    ]
    index = 0
    while index < len(escapes):
        at, code = escapes[index]
        if 0xD800 <= code <= 0xDBFF:  # a high half: the next escape must be a low half, right after it
            following = escapes[index + 1] if index + 1 < len(escapes) else None
            if following is None or following[0] != at + 6 or not 0xDC00 <= following[1] <= 0xDFFF:
                return at
            index += 2
            continue
        if 0xDC00 <= code <= 0xDFFF:
            return at
        index += 1
    return None


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = decode_json(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """Every router's route class: its handler reads the body with ``decode_json``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict
