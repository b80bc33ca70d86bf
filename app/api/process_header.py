"""Names the API process that answered: every HTTP response carries ``x-mmserve-api-process: <index>``
(0 .. --api-server-count - 1; 0 for a single process), so operators and tests can see how the kernel
spread connections over the processes sharing the port."""

from __future__ import annotations

from app.api.asgi_types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-mmserve-api-process"


class ProcessHeader:
    """Pure ASGI middleware, added outermost (``app.launch.launcher.run_api``) so refusals carry it too."""

    def __init__(self, app: ASGIApp, *, index: int) -> None:
        self.app = app
        self.value = str(index).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (HEADER, self.value)]}
            await send(message)

        await self.app(scope, receive, send_with_header)
