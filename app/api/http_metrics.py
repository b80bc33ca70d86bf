"""Counts every HTTP response of an API process by route and status code
(``mmserve_http_requests_total``): the outermost ASGI middleware, so the guards' refusals (401, 413, the
drain's 503) count as well as the routes' answers. A response counts with the status it started with: an
error after a stream began goes out as an SSE event under 200 (``app.api.error_handlers``); but one
whose client left before its last byte counts as a 499, as one that left before it started does. A
route with parameters counts under its path template (``/v1/responses/{response_id}``), never the id
sent."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.requests import ClientDisconnect
from starlette.routing import Match, Route

from app.api.asgi_types import ASGIApp, Message, Receive, Scope, Send
from app.api.disconnect import CLIENT_CLOSED_REQUEST

OTHER_ROUTE = "other"  # any path the app has no route for: one label value, whatever clients send


class HttpMetrics:
    def __init__(self, app: ASGIApp, *, routes: Iterable[Route]) -> None:
        """``routes``: the app's routes; their paths (templates) are the only values of the ``route``
        label."""
        self.app = app
        self.static = frozenset(route.path for route in routes if not route.param_convertors)
        self.templated = [route for route in routes if route.param_convertors]

    def route(self, scope: Scope) -> str:
        """The label of a request's route: its path, the template of a route with parameters that
        matches it (whatever the method: a 405 counts under its route), else ``OTHER_ROUTE``."""
        if scope["path"] in self.static:
            return str(scope["path"])
        for route in self.templated:
            if route.matches(scope)[0] is not Match.NONE:
                return route.path
        return OTHER_ROUTE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = "500"  # an exception that escapes the app is answered 500 by the server
        ended = False  # the response's last byte went out

        async def sending(message: Message) -> None:
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)
            ended = ended or (message["type"] == "http.response.body" and not message.get("more_body"))

        try:
            await self.app(scope, receive, sending)
        except ClientDisconnect:  # writing to a client that left
            status = str(CLIENT_CLOSED_REQUEST)
            raise
        else:
            if not ended and status.startswith("2"):  # a stream its client left: it stopped unfinished
                status = str(CLIENT_CLOSED_REQUEST)
        finally:
            # the lifespan creates the metrics; a server listens only after it ran
            state = getattr(scope["app"].state, "mmserve", None)
            if state is not None:
                state.metrics.http_requests.labels(route=self.route(scope), status=status).inc()
