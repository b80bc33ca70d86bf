"""Background responses (``background: true``; docs/architecture.md, "Background responses"): the
response is stored ``queued`` and returned at once, and its answer is made by a task of the API process
that took it, which stores the finished response in its place. Everything a client does with it goes
through the response store, so any API process answers it:

    GET /v1/responses/{id}                     the stored object: queued, in_progress, then ended
    GET /v1/responses/{id}?stream=true         a streamed one's events, from its event log in the store
        &starting_after=N                      (those numbered past N), followed until it ends
    POST /v1/responses/{id}/cancel             the status becomes cancelled; the task stops and its
                                               request is aborted in the engine
    DELETE /v1/responses/{id}                  gone; the task stops too

A task learns of a cancel or delete made in this process at once (``forget``); with a store
file that other API processes share, it also reads its status every ``poll_s`` (the owner may be another
process). Readers of an event log are woken by this process's writes, and poll every ``poll_s`` for
another process's. A task that is still running when the process stops ends its response ``failed``
(``close``): a poller never waits on a response no process is making.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from app.api.response_store import RUNNING, ResponseStore
from app.api.responses_object import closing_event

log = logging.getLogger("mmserve.api")

Key = tuple[str, str]  # (tenant, response id)
BACKGROUND_POLL_S = 0.1  # with a shared store file
RESUBMIT_MAX_DELAY_S = 1.0  # between tries to submit while the engine is too busy to take a request
SHUTTING_DOWN = {"code": "server_error", "message": "The server shut down before the response ended."}


class BackgroundResponses:
    def __init__(
        self, store: ResponseStore, poll_s: float | None, on_end: Callable[[], None] = lambda: None
    ) -> None:
        """``poll_s``: how often a task reads its status and a reader its log for another process's
        changes; None where this process alone opens the store (nothing else changes it). ``on_end``:
        called (on the event loop) after a task ended its response itself (the store's gauges)."""
        self.store = store
        self.poll_s = poll_s
        self.on_end = on_end
        self._tasks: dict[Key, asyncio.Task[None]] = {}
        self._changed: dict[Key, asyncio.Event] = {}
        self._readers: collections.Counter[Key] = collections.Counter()

    @property
    def busy(self) -> bool:
        """Whether a task of this process is still making a response (the drain waits for them)."""
        return bool(self._tasks)

    def run(self, key: Key, work: Coroutine[Any, Any, None]) -> None:
        """Makes the response ``key`` with ``work``, which stores it when done."""
        task = asyncio.create_task(self._running(key, work), name=f"background {key[1]}")
        self._tasks[key] = task
        task.add_done_callback(lambda _: self._tasks.pop(key, None))

    def forget(self, key: Key) -> None:
        """The response was cancelled or deleted here: its task (if this process runs it) stops."""
        task = self._tasks.get(key)
        if task is not None:
            task.cancel()

    def notify(self, key: Key) -> None:
        """Events were added to ``key``'s log: wake this process's readers."""
        changed = self._changed.pop(key, None)
        if changed is not None:
            changed.set()

    async def events(self, key: Key, after: int) -> AsyncIterator[str]:
        """The events of ``key``'s log numbered past ``after``, then each as it is written, until the
        response ended (its last event is written with its end) or is gone."""
        self._readers[key] += 1
        try:
            while True:
                changed = self._changed.setdefault(key, asyncio.Event())
                events, status = await asyncio.to_thread(self.store.read_events, *key, after)
                for number, text in events:
                    yield text
                    after = number
                if status not in RUNNING:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), self.poll_s)
        finally:
            self._readers[key] -= 1
            if not self._readers[key]:
                del self._readers[key]
                self._changed.pop(key, None)

    async def close(self) -> None:
        """Stops every task still running; their responses end ``failed``."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _running(self, key: Key, work: Coroutine[Any, Any, None]) -> None:
        watch = asyncio.create_task(self._watch(key)) if self.poll_s is not None else None
        try:
            await work
        except asyncio.CancelledError:
            # cancelled here or elsewhere (already ended: left as it is), or the process is stopping
            self.store.set_status(*key, "failed", SHUTTING_DOWN, closing_event)
            self.on_end()
            raise
        except Exception:
            log.exception("background response %s failed", key[1])
            error = {"code": "server_error", "message": "Internal error."}
            self.store.set_status(*key, "failed", error, closing_event)
            self.on_end()
        finally:
            self.notify(key)
            if watch is not None:
                watch.cancel()

    async def _watch(self, key: Key) -> None:
        """Stops ``key``'s task once another process ended or deleted its response."""
        assert self.poll_s is not None
        while True:
            await asyncio.sleep(self.poll_s)
            if await asyncio.to_thread(self.store.status, *key) not in RUNNING:
                self.forget(key)
                return


def process_identity(pid: int) -> str | None:
    """Which process ``pid`` of this machine is: the machine's boot id, the pid and its start time (in
    clock ticks since boot), which a reused pid does not share; what a stored background response
    records of the process making it. None: no such process (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state, *fields = stat.read().rpartition(b")")[2].split()
    except FileNotFoundError:
        return None
    if state == b"Z":
        return None
    return f"{_boot_id()}:{pid}:{int(fields[18])}"  # starttime, the stat file's 22nd field


def maker_alive(identity: str) -> bool:
    """Whether the process a stored identity names still runs (the same pid, started at the same time,
    since this machine's boot). One of another machine (a store file several hosts share) cannot be
    told here: taken as alive."""
    boot_id, pid, _ = identity.split(":")
    return boot_id != _boot_id() or process_identity(int(pid)) == identity


def _boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as boot:
        return boot.read().strip()
