"""Request bodies decoded as strict JSON (docs/api.md, "Errors"): every route's ``Request.json()`` is
msgspec's decoder instead of the standard library's, which lets through what no later step can handle:
a lone UTF-16 surrogate escape (``"\\ud800"``: a Python string that cannot be encoded, so tokenizers,
answers and engine messages fail on it), ``NaN`` and ``Infinity``, and nesting deep enough to exhaust
the stack. Each is the same 400 ``invalid_json`` as a syntax error, with the byte where it was found."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from fastapi import Request, Response
from fastapi.routing import APIRoute

_AT_BYTE = re.compile(r"\s*\(byte (\d+)\)$")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


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
    message = str(exc).removeprefix("JSON is malformed: ")
    found = _AT_BYTE.search(message)
    position = int(found.group(1)) if found else 0
    if found is None and (surrogate := _SURROGATE_ESCAPE.search(body)) is not None:
        return "a lone UTF-16 surrogate escape (\\ud800 to \\udfff outside a pair)", surrogate.start()
    return (message[: found.start()] if found else message), position


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
