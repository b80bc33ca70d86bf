"""The one place that maps errors to the OpenAI envelope ``{"error": {message, type, param, code}}``.

``install_error_handlers`` is called by the app factory. Request validation errors answer 400 (not
FastAPI's 422 shape) and name the first bad field as ``param`` in OpenAI's path notation
(``messages[0].content[1].image_url.url``); typed ``MMServeError``s answer their own status; Starlette's
404/405 and any unexpected exception (500, logged) get the same envelope. An error after a stream has
started cannot change the status any more; it goes out as one SSE event (``sse_error_event``).

An unexpected exception is answered by ``UnexpectedErrors``, a middleware around the routes, and goes
no further: past it, Starlette's outermost middleware would answer the same 500 but raise again, and
the server then closes the connection, so a keep-alive client would lose the request it sent next.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.asgi_types import ASGIApp, Message, Receive, Scope, Send
from app.api.disconnect import CLIENT_CLOSED_REQUEST, ClientLeft
from app.errors import MMServeError, from_family_error
from wire.protocol import ErrorInfo
from workers.families.errors import FamilyInputError

log = logging.getLogger("mmserve.api")

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def _type_for_status(http_status: int) -> str:
    return SERVER_ERROR if http_status >= 500 else INVALID_REQUEST


def error_detail(exc: BaseException | ErrorInfo) -> tuple[int, ErrorDetail]:
    """HTTP status and envelope fields of an error raised (or, for ``ErrorInfo``, reported by the
    engine) while serving a request. Anything not typed is an internal error: a 500 whose message
    names only the exception's class, so internals do not leak to clients."""
    if isinstance(exc, FamilyInputError):
        exc = from_family_error(exc)
    if isinstance(exc, MMServeError):
        return exc.http_status, ErrorDetail(
            message=exc.message, type=exc.err_type, param=exc.param, code=exc.code
        )
    if isinstance(exc, ErrorInfo):
        return exc.http_status, ErrorDetail(
            message=exc.message, type=_type_for_status(exc.http_status), code=exc.code
        )
    if isinstance(exc, RequestValidationError):
        return 400, validation_error_detail(exc.errors())
    if isinstance(exc, StarletteHTTPException):
        # a body cut off while streaming: too large, or stalled
        code = {413: "request_too_large", 408: "request_timeout"}.get(exc.status_code)
        return exc.status_code, ErrorDetail(
            message=str(exc.detail), type=_type_for_status(exc.status_code), code=code
        )
    return 500, ErrorDetail(message=f"Internal server error ({type(exc).__name__}).", type=SERVER_ERROR)


def error_response(exc: BaseException | ErrorInfo, headers: dict[str, str] | None = None) -> JSONResponse:
    """The envelope as a JSON response with the error's status."""
    status, detail = error_detail(exc)
    return JSONResponse(ErrorResponse(error=detail).model_dump(), status_code=status, headers=headers)


def sse_error_event(exc: BaseException | ErrorInfo) -> str:
    """One SSE ``data:`` event carrying the envelope, for an error after a stream's first bytes."""
    _, detail = error_detail(exc)
    return f"data: {ErrorResponse(error=detail).model_dump_json()}\n\n"


# The names pydantic gives a union's members in an error's location: not fields of the request
_UNION_MEMBER_TYPES = {"str", "int", "float", "bool", "list", "dict", "none", "any"}


def _is_union_member(part: str | int) -> bool:
    """``literal['none','auto']``, ``dict[str,any]``, ``str``, a model's class name (``NamedToolChoice``):
    pydantic's tag for the union member it tried; the request's own fields are lower-case names."""
    return isinstance(part, str) and (
        "[" in part or part in _UNION_MEMBER_TYPES or part[:1].isupper() or part.startswith("function-")
    )


def format_loc(loc: Sequence[str | int]) -> str | None:
    """``("body", "messages", 0, "content")`` → ``"messages[0].content"``; None for the body itself; a
    query or path parameter by its name. A union member's tag is left out: ``("tool_choice",
    "literal['none','auto']")`` → ``"tool_choice"``."""
    if loc and loc[0] in ("body", "query", "path"):
        loc = loc[1:]
    param = ""
    for part in (part for part in loc if not _is_union_member(part)):
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else str(part)
    return param or None


def validation_error_detail(errors: Sequence[Any]) -> ErrorDetail:
    """Envelope fields for pydantic/FastAPI validation errors: the first error is reported."""
    if not errors:
        return ErrorDetail(message="Invalid request.", type=INVALID_REQUEST, code="invalid_value")
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "decode error")
        where = first["loc"][-1] if isinstance(first["loc"][-1], int) else None
        at = f" at position {where}" if where is not None else ""
        message = f"The request body is not valid JSON: {reason}{at}."
        return ErrorDetail(message=message, type=INVALID_REQUEST, code="invalid_json")
    param = format_loc(first.get("loc", ()))
    reason = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        message = (
            "The request body is missing." if kind == "missing" else "The request body must be a JSON object."
        )
    elif kind == "missing":
        message = f"Missing required parameter: '{param}'."
    else:
        message = f"Invalid value for '{param}': {reason}."
    if len(errors) > 1:
        message += f" ({len(errors) - 1} more error{'s' if len(errors) > 2 else ''} in the request.)"
    code = "missing" if kind == "missing" else "invalid_value"
    return ErrorDetail(message=message, type=INVALID_REQUEST, param=param, code=code)


async def _on_mmserve_error(request: Request, exc: Exception) -> JSONResponse:
    retry_after_s = getattr(exc, "retry_after_s", None)  # a 429 tells the client when to come back
    return error_response(exc, headers={"Retry-After": str(retry_after_s)} if retry_after_s else None)


async def _on_request_error(request: Request, exc: Exception) -> JSONResponse:
    """Validation errors and a model family's refusals (``FamilyInputError``): 400. A body that is not
    an object because it was not sent as JSON says which content type it came as."""
    content_type = request.headers.get("content-type", "")
    if isinstance(exc, RequestValidationError) and _body_itself(exc) and not _is_json(content_type):
        sent = f"not {content_type!r}" if content_type else "and none was given"
        message = f"The request body must be JSON, sent as Content-Type: application/json, {sent}."
        detail = ErrorDetail(message=message, type=INVALID_REQUEST, code="invalid_content_type")
        return JSONResponse(ErrorResponse(error=detail).model_dump(), status_code=400)
    return error_response(exc)


def _body_itself(exc: RequestValidationError) -> bool:
    errors = exc.errors()
    return bool(errors) and format_loc(errors[0].get("loc", ())) is None


def _is_json(content_type: str) -> bool:
    """``application/json`` or a ``+json`` type, with any parameters (``; charset=utf-8``)."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == CLIENT_CLOSED_REQUEST:  # a body the client left unsent: nobody reads an answer
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    headers = dict(exc.headers) if exc.headers else None  # e.g. Allow on a 405
    if exc.status_code in (404, 405):
        verb = "Not found" if exc.status_code == 404 else "Method not allowed"
        exc = StarletteHTTPException(exc.status_code, f"{verb}: {request.method} {request.url.path}")
    return error_response(exc, headers=headers)


async def _on_client_left(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # (only for what UnexpectedErrors does not see: an exception in a middleware outside it)
    log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(exc)


class UnexpectedErrors:
    """An exception no handler took, raised before the response started: logged once and answered
    with the 500 envelope, the connection kept. After the start it propagates (the server ends the
    response and its connection: a half-sent answer cannot be completed)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            log.error("unhandled error in %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            await error_response(exc)(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Registers every handler; called once by the app factory, before the app serves."""
    app.add_exception_handler(MMServeError, _on_mmserve_error)
    app.add_exception_handler(RequestValidationError, _on_request_error)
    app.add_exception_handler(FamilyInputError, _on_request_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(ClientLeft, _on_client_left)
    app.add_exception_handler(Exception, _on_unexpected)
    app.add_middleware(UnexpectedErrors)  # the first added: the innermost, around the routes
