"""Graceful drain of the API process on SIGTERM.

``Drain`` keeps the guarded HTTP requests in flight; once started (the first SIGTERM), new ones are
refused with 503 ``server_shutting_down`` while those in flight run on, and ``finished`` turns true when
none is left or ``--shutdown-timeout`` has passed. ``DrainingServer`` is uvicorn's server with SIGTERM
mapped to that drain (a second SIGTERM, or SIGINT, stops at once); it exits once the drain finished, and
the lifespan then stops the engine as on any shutdown. At the deadline, a request whose answer has not
started (still uploading its body, a stream before its first token, a non-streamed answer not yet
complete) is cancelled and answered 503 ``server_shutting_down``: its work is abandoned as when a client
leaves (aborted in the engine), and its client gets the envelope instead of the plain-text 500 uvicorn
sends for a task it cancels. An answer already streaming ends with its endpoint's error event, code
``server_shutting_down`` (``on_cut_off``: the engine client ends every request's outputs), rather than
a dropped connection.

Background responses (app/api/responses_background.py) are waited for as requests are (``waits_for``);
one still running at the deadline ends ``failed`` with the same message.

With ``--api-server-count N`` the main ``serve`` process hooks its other API processes in: ``on_start``
forwards the SIGTERM to them (they drain concurrently, each with its own deadline) and ``waits_for`` keeps
its own drain, and so the engine, running until they exited (or the deadline passed).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn

from app.api.asgi_types import ASGIApp, Message, Receive, Scope, Send
from app.api.request_guards import GUARDED_PREFIXES, refuse
from app.errors import EngineUnavailableError

log = logging.getLogger("mmserve.api")


@dataclass(eq=False)
class _InFlight:
    """One guarded request: the task serving it, and whether its answer started or it was cut off."""

    task: asyncio.Task[Any]
    answering: bool = False
    cut_off: bool = False


class Drain:
    """``on_start``: called once, when the drain starts (in the signal handler: keep them short).
    ``waits_for``: other work the drain waits for besides this process's requests; each says whether
    it is still busy, polled on every server tick until none is or the deadline passed.
    ``on_cut_off``: called at the deadline with the message for the answers it ends (the app adds the
    engine client's ``end_in_flight``)."""

    def __init__(
        self,
        timeout_s: float,
        *,
        on_start: Sequence[Callable[[], None]] = (),
        waits_for: Sequence[Callable[[], bool]] = (),
    ) -> None:
        self.timeout_s = timeout_s
        self.requests: set[_InFlight] = set()
        self.deadline: float | None = None
        self.on_start = list(on_start)
        self.waits_for = list(waits_for)
        self.on_cut_off: list[Callable[[str], None]] = []

    @property
    def in_flight(self) -> int:
        return len(self.requests)

    @property
    def started(self) -> bool:
        return self.deadline is not None

    def start(self) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + self.timeout_s
            for callback in self.on_start:
                callback()

    @property
    def waiting(self) -> bool:
        """Whether any other work the drain waits for is still busy."""
        return any(busy() for busy in self.waits_for)

    @property
    def finished(self) -> bool:
        if self.deadline is None:
            return False
        idle = self.in_flight == 0 and not self.waiting
        return idle or time.monotonic() >= self.deadline

    def cut_off(self) -> int:
        """Ends the answers already streaming (``on_cut_off``) and cancels every request in flight whose
        answer has not started, so that it is answered 503 (``DrainGuard``: the cancellation comes first
        where both reach a request); returns how many were cancelled. Called from the event loop, at the
        deadline."""
        for end_answers in self.on_cut_off:
            end_answers(f"The server shut down before finishing this answer ({self.timeout_flag}).")
        unanswered = [r for r in self.requests if not r.answering and not r.cut_off]
        for request in unanswered:
            request.cut_off = True
            request.task.cancel()
        return len(unanswered)

    @property
    def timeout_flag(self) -> str:
        return f"--shutdown-timeout {self.timeout_s:g} s"


class DrainGuard:
    """ASGI middleware: counts guarded requests in flight, refuses new ones once the drain started."""

    def __init__(self, app: ASGIApp, *, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED_PREFIXES):
            await self.app(scope, receive, send)
            return
        if self.drain.started:
            error = EngineUnavailableError("The server is shutting down.", code="server_shutting_down")
            await refuse(error, scope, send)
            return
        task = asyncio.current_task()
        assert task is not None  # (uvicorn runs each request in a task of its own)
        request = _InFlight(task)

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                request.answering = True
            await send(message)

        self.drain.requests.add(request)
        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            if not request.cut_off or request.answering:
                raise
            request.task.uncancel()  # cancelled by ``Drain.cut_off`` alone: answer it
            message = f"The server shut down before answering this request ({self.drain.timeout_flag})."
            error = EngineUnavailableError(message, code="server_shutting_down")
            await refuse(error, scope, send, headers={"Connection": "close"})
        finally:
            self.drain.requests.discard(request)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Unlike uvicorn's own, no signal is re-raised after the shutdown: ``serve`` then stops its
        children and exits 0, without a KeyboardInterrupt traceback. A second SIGINT does not force the
        exit either (uvicorn would skip the lifespan's shutdown, which removes this process's shared
        memory): Ctrl-C reaches every process of the group and ``serve`` may pass it on again, and the
        shutdown is bounded anyway (uvicorn's ``timeout_graceful_shutdown``)."""
        if sig != signal.SIGTERM:
            if self.should_exit:
                return
            super().handle_exit(sig, frame)
            self._captured_signals.clear()
        elif not self.drain.started:
            log.info(
                "SIGTERM: draining %d request(s) for up to %gs; new requests get 503",
                self.drain.in_flight,
                self.drain.timeout_s,
            )
            self.drain.start()
        else:  # a second SIGTERM: stop now
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, then the app's lifespan shutdown if uvicorn skipped it (it does after what it takes
        for a forced exit): that shutdown removes this process's shared memory and is bounded, and a
        lifespan left waiting is cancelled when the loop closes, which logs a traceback."""
        await super().shutdown(sockets=sockets)
        done = getattr(self.lifespan, "shutdown_event", None)
        if done is not None and not done.is_set():
            log.info("running the application's shutdown that uvicorn skipped")
            await self.lifespan.shutdown()

    async def on_tick(self, counter: int) -> bool:
        if self.drain.finished and not self.should_exit:
            if self.drain.in_flight or self.drain.waiting:
                answered = self.drain.cut_off()  # answered 503 within uvicorn's grace after the drain
                log.warning(
                    "shutdown timeout: %d request(s) in flight are cut off (%d not yet answered get 503)%s",
                    self.drain.in_flight,
                    answered,
                    ", and the other work still running" if self.drain.waiting else "",
                )
            self.should_exit = True
        return await super().on_tick(counter)
