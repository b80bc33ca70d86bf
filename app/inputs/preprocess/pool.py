"""Decode + the family's HF image processor for processor-cache misses, in processes forked from the
fork server (app/child_processes.py), so a slow image never holds the event loop or the GIL that other
requests' cache hits need::

    API process (event loop)                              pool process i ("mmserve: preprocess")
                                          ◀── Loaded ──── load_processing(model), once
    process() → FIFO of waiting calls; one call per idle process at a time:
      Preprocess(out_name, options, param) ──▶ decode_image -> family.process_image
      + one frame: the encoded bytes ────────▶ tensors into /dev/shm/<out_name>
                          ◀── Processed(ShmOutput) | Refused(request error) | Failed(bug)
    read_output: map the file, copy each tensor out once, unmap, unlink -> ProcessedItem

Each process talks over its own pipe (a socketpair; msgpack-encoded typed messages, one length-prefixed
frame each), so the pool creates no semaphore, queue or lock: nothing that a SIGKILL of the whole
process group could leave behind in /dev/shm (multiprocessing's named semaphores, ``sem.mp-*``, are
unlinked only by its resource tracker). The large send runs on a thread; replies, small, are read by a
reader on the event loop, which also sees a process die (EOF on its pipe) while it is busy or idle.

The API names the output file, so it can unlink the file whoever holds it when something fails: the
process until it replies, then the API (a call cancelled meanwhile unlinks it when the reply lands; a
process that died may have left it half written). Request errors (``MMServeError``) come back as the
same class, message, param and code. A dead process fails only the call it had (``InternalError``) and
is started again; it takes calls once it has loaded the family.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import msgspec

from app.child_processes import child_context
from app.errors import (
    INVALID_MM_PROCESSOR_KWARGS,
    EngineUnavailableError,
    InternalError,
    InvalidRequestError,
    MediaError,
    MMServeError,
)
from app.inputs.preprocess.child import (
    Answer,
    Loaded,
    Preprocess,
    Processed,
    Refused,
    Reply,
    child_main,
    decode_and_process,
    encoder,
    reply_decoder,
    request_error,
)
from app.inputs.preprocess.transfer import ShmOutput, discard_output, output_name, read_output, write_output
from app.inputs.preprocess.video_item import VideoRules
from workers.families.processing import KWARGS_PARAM, FamilyProcessor, ProcessedItem

__all__ = ["PreprocessPool", "ShmOutput", "decode_and_process", "output_name", "read_output", "write_output"]

log = logging.getLogger("mmserve.api")

RESPAWN_DELAY_S = 1.0  # before spawning again after a process that never loaded died
STOP_TIMEOUT_S = 5.0  # for a process to leave its loop at EOF before it is killed
PROCESS_DIED = "An image preprocessing process died; the image was not processed."
SHUTTING_DOWN = "The server is shutting down."
# A video call gets this much longer than the decoder's own time limit before its process is killed.
HARD_TIMEOUT_MARGIN_S = 5.0


class _ProcessLost(Exception):
    """The process's pipe closed (it died) or broke the protocol; or the API stopped the process."""


class _PoolProcess:
    """One pool process and the API's end of its pipe, built on the event loop's thread; ``on_lost``
    runs once if the process dies."""

    def __init__(
        self, model: str, api_pid: int, video: VideoRules | None, on_lost: Callable[[_PoolProcess], None]
    ) -> None:
        ctx = child_context()
        self.conn, child_end = ctx.Pipe()
        self.process = ctx.Process(
            target=child_main, args=(model, api_pid, child_end, video), name="mmserve-preprocess", daemon=True
        )
        try:
            self.process.start()
        except BaseException:
            self.conn.close()
            raise
        finally:
            child_end.close()
        assert self.process.pid is not None
        self.pid = self.process.pid
        self.loaded, self.attached = False, True
        self._on_lost = on_lost
        self._fd = self.conn.fileno()
        self._loop = asyncio.get_running_loop()
        self._reply: asyncio.Future[Reply] | None = self._loop.create_future()  # Loaded comes first
        self._sending: asyncio.Future[None] | None = None
        self._ending: asyncio.Task[None] | None = None
        self._loop.add_reader(self._fd, self._on_readable)
        # uvloop (uvicorn's loop where it is installed) makes a watched fd non-blocking; ``_send`` writes
        # whole frames from a thread and must block on a full pipe, not fail half-way with EAGAIN
        os.set_blocking(self._fd, True)

    def _on_readable(self) -> None:
        # A reply is one small frame written at once, so it is all there when the first byte is.
        try:
            reply = reply_decoder.decode(self.conn.recv_bytes())
        except (EOFError, OSError, msgspec.DecodeError):
            self._lose()
            return
        if self._reply is None or self._reply.done():
            self._lose()  # a reply nobody asked for: the protocol is broken
        else:
            self._reply.set_result(reply)

    async def _next_reply(self) -> Reply:
        assert self._reply is not None
        try:
            return await self._reply
        finally:
            self._reply = None

    async def wait_loaded(self) -> None:
        """Returns once the process has loaded the family; ``_ProcessLost`` if it died first."""
        if not isinstance(await self._next_reply(), Loaded):
            self._lose()
            raise _ProcessLost
        self.loaded = True

    async def ask(self, call: bytes, data: bytes) -> Answer:
        """One call (an encoded ``Preprocess``) to a loaded, idle process; ``_ProcessLost`` if it died."""
        assert self.loaded and self._reply is None
        if not self.attached:  # died since it last answered
            raise _ProcessLost
        self._reply = self._loop.create_future()
        self._sending = asyncio.ensure_future(asyncio.to_thread(self._send, call, data))
        try:
            await self._sending
        except OSError:
            self._lose()
        finally:
            self._sending = None
        reply = await self._next_reply()
        if isinstance(reply, Loaded):
            self._lose()
            raise _ProcessLost
        return reply

    def _send(self, call: bytes, data: bytes) -> None:
        """On a thread: writing tens of MB must not stall the event loop."""
        self.conn.send_bytes(call)
        self.conn.send_bytes(data)

    def _detach(self) -> None:
        """Stops reading the pipe; a caller waiting for a reply gets ``_ProcessLost``."""
        if not self.attached:
            return
        self.attached = False
        self._loop.remove_reader(self._fd)
        if self._reply is not None and not self._reply.done():
            self._reply.set_exception(_ProcessLost())

    def kill(self) -> None:
        """Called when the process takes too long on a call: it is killed and replaced."""
        self._lose()

    def _lose(self) -> None:
        if self.attached:
            self._detach()
            self.process.kill()  # dead already, or it broke the protocol
            self._on_lost(self)

    def stop(self) -> asyncio.Task[None]:
        """Stops reading the pipe now; the task (one, however often this is called) ends the process
        and reaps it: EOF on its pipe ends its loop (SIGKILL while it still loads: it ignores SIGTERM),
        SIGKILL after ``STOP_TIMEOUT_S``."""
        self._detach()
        if self._ending is None:
            self._ending = self._loop.create_task(self._end())
        return self._ending

    async def _end(self) -> None:
        if self._sending is not None:  # the thread still writes to the pipe: never close it under it
            await asyncio.wait([self._sending])
        self.conn.close()
        if not self.loaded:
            self.process.kill()
        if not await self._exited(STOP_TIMEOUT_S):
            self.process.kill()
            await self._exited(None)
        self.process.close()

    async def _exited(self, timeout_s: float | None) -> bool:
        exited = self._loop.create_future()
        sentinel = self.process.sentinel
        self._loop.add_reader(sentinel, _set_once, exited)
        try:
            await asyncio.wait_for(exited, timeout_s)
        except TimeoutError:
            return False
        finally:
            self._loop.remove_reader(sentinel)
        self.process.join()  # exited: only reaps it
        return True


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass(eq=False, slots=True)
class _Call:
    out_name: str
    call: bytes  # the encoded Preprocess
    data: bytes
    result: asyncio.Future[ShmOutput]
    hard_timeout_s: float | None = None  # a video: the process is killed when it has not answered by then
    param: str | None = None


def _timed_out(timeout_s: float | None, param: str | None) -> MediaError:
    return MediaError(
        f"Decoding this video took longer than {timeout_s:g} s (--video-decode-timeout-s).",
        param=param,
        code="video_decode_timeout",
    )


def _settle(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():  # else its caller was cancelled
        future.set_exception(error)


class PreprocessPool:
    """Decode + HF processor for cache misses in ``processes`` child processes (0: threads of this
    process, running ``family``). Built, started, used and closed from the event loop's thread."""

    def __init__(
        self,
        model: str,
        processes: int,
        *,
        family: FamilyProcessor | None = None,
        video: VideoRules | None = None,
    ) -> None:
        """``video``: the limits of video items (None: the pool takes images only)."""
        if processes < 0 or (processes == 0 and family is None):
            raise ValueError("processes must be >= 1, or 0 with the family to run in threads")
        self.model, self._num_processes, self._family = model, processes, family
        self._video = video
        self._api_pid = os.getpid()
        self._started = self._closed = False
        self._failed: str | None = None  # why start failed: calls get it as their 500
        self._processes: list[_PoolProcess] = []  # loading, idle or busy; a dead one leaves at once
        self._idle: deque[_PoolProcess] = deque()
        self._busy: set[_PoolProcess] = set()
        self._waiting: deque[_Call] = deque()
        self._tasks: set[asyncio.Task[None]] = set()  # calls running, replacements, processes ending
        self._replacing: set[asyncio.Task[None]] = set()

    @property
    def num_processes(self) -> int:
        return self._num_processes

    @property
    def pids(self) -> list[int]:
        """The ids of the pool's live processes (loading, idle or busy); none with threads."""
        return [process.pid for process in self._processes]

    async def start(self) -> None:
        """Called once, when the API starts serving (it need not wait: calls made before the processes
        loaded the family wait for them): returns when every process has loaded it. If one could not,
        the pool closes, and every call then fails with a 500 naming the cause."""
        if not self._num_processes:
            return
        processes = [self._spawn() for _ in range(self._num_processes)]
        loads = await asyncio.gather(*(p.wait_loaded() for p in processes), return_exceptions=True)
        if any(isinstance(load, BaseException) for load in loads) or not all(p.attached for p in processes):
            self._failed = f"The preprocessing processes could not load {self.model} (see the server log)."
            self._fail_waiting(lambda: InternalError(self._failed or PROCESS_DIED))
            await self.close()
            raise RuntimeError(self._failed)
        self._started = True
        self._idle.extend(processes)
        self._dispatch()

    async def process(
        self, data: bytes, options: dict[str, Any], param: str, modality: str = "image"
    ) -> ProcessedItem:
        """One cache miss: decode + the family's processor off the event loop, with the request errors
        the family raises in this process. Calls made before ``start`` wait for it."""
        if self._failed is not None:
            raise InternalError(self._failed)
        if self._closed:
            raise EngineUnavailableError(SHUTTING_DOWN, code="server_shutting_down")
        if not self._num_processes:
            assert self._family is not None
            return await asyncio.to_thread(
                decode_and_process, self._family, data, options, param, modality, self._video
            )
        name = output_name(self._api_pid)
        try:
            call = encoder.encode(Preprocess(name, options, param, modality))
        except OverflowError as exc:  # an integer msgpack cannot carry: no processor takes it either
            raise InvalidRequestError(
                f"Invalid mm_processor_kwargs: {exc}", param=KWARGS_PARAM, code=INVALID_MM_PROCESSOR_KWARGS
            ) from exc
        result: asyncio.Future[ShmOutput] = asyncio.get_running_loop().create_future()
        hard_timeout_s = None
        if modality == "video" and self._video is not None:
            hard_timeout_s = self._video.limits.decode_timeout_s + HARD_TIMEOUT_MARGIN_S
        waiting = _Call(name, call, data, result, hard_timeout_s, param)
        self._waiting.append(waiting)
        self._dispatch()
        try:
            output = await result
        except asyncio.CancelledError:
            with contextlib.suppress(ValueError):
                self._waiting.remove(waiting)  # it holds the encoded bytes
            if result.done() and not result.cancelled() and result.exception() is None:
                discard_output(result.result().name)  # the result landed as the caller was cancelled
            raise
        return read_output(output)

    def _dispatch(self) -> None:
        """Gives the oldest waiting calls to idle processes, one call per process."""
        while self._idle and self._waiting:
            call = self._waiting.popleft()
            if call.result.done():  # its caller was cancelled while it waited
                continue
            process = self._idle.popleft()
            self._busy.add(process)
            self._track(self._run(process, call))

    async def _run(self, process: _PoolProcess, call: _Call) -> None:
        """One call on one process; then the process takes the next waiting call (or ends, closing)."""
        try:
            reply = await asyncio.wait_for(process.ask(call.call, call.data), call.hard_timeout_s)
        except TimeoutError:  # stuck past its own time limit (inside the decoder): killed, replaced
            process.kill()
            discard_output(call.out_name)
            _settle(call.result, _timed_out(call.hard_timeout_s, call.param))
            return
        except _ProcessLost:
            discard_output(call.out_name)  # it may have died while writing it
            _settle(call.result, InternalError(PROCESS_DIED))
            return
        finally:
            self._busy.discard(process)
        if isinstance(reply, Processed):
            if call.result.done():
                discard_output(reply.output.name)
            else:
                call.result.set_result(reply.output)
        elif isinstance(reply, Refused):
            _settle(call.result, request_error(reply))
        else:
            log.error("preprocess process %d failed: %s", process.pid, reply.error)
            _settle(call.result, InternalError("Image preprocessing failed; see the server log."))
        if not process.attached:  # died after it answered: _lost has replaced it
            return
        if self._closed:
            await self._retire(process)
        else:
            self._idle.append(process)
            self._dispatch()

    def _spawn(self) -> _PoolProcess:
        process = _PoolProcess(self.model, self._api_pid, self._video, self._lost)
        self._processes.append(process)
        return process

    def _lost(self, process: _PoolProcess) -> None:
        """A process died (its call, if any, fails in ``_run``): reaped, and spawned again once started."""
        self._processes.remove(process)
        if process in self._idle:
            self._idle.remove(process)
        self._track(process.stop())
        if self._closed or not self._started:
            return
        if not process.loaded and not any(w.loaded for w in self._processes):
            # No process can take the waiting calls until one loads, which has just failed: no hang.
            self._fail_waiting(lambda: InternalError(PROCESS_DIED))
        log.warning("preprocess process %d died; spawning another", process.pid)
        replacement = self._track(self._replace(0.0 if process.loaded else RESPAWN_DELAY_S))
        self._replacing.add(replacement)
        replacement.add_done_callback(self._replacing.discard)

    async def _replace(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        process = self._spawn()
        try:
            await process.wait_loaded()
        except _ProcessLost:
            return  # _lost has spawned another one
        self._idle.append(process)
        self._dispatch()

    def _retire(self, process: _PoolProcess) -> asyncio.Task[None]:
        self._processes.remove(process)
        return self._track(process.stop())

    def _track(self, aw: Coroutine[Any, Any, None] | asyncio.Task[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(aw)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _fail_waiting(self, error: Callable[[], MMServeError]) -> None:
        while self._waiting:
            _settle(self._waiting.popleft().result, error())

    async def close(self) -> None:
        """Called when the server stops (idempotent): waiting calls fail with ``server_shutting_down``,
        running ones are abandoned (their processes killed: a drain has already answered or cut off
        every request, so nobody waits for them, and a large image would hold the exit for seconds),
        then every process ends."""
        self._closed = True
        self._fail_waiting(lambda: EngineUnavailableError(SHUTTING_DOWN, code="server_shutting_down"))
        self._idle.clear()
        for process in [w for w in self._processes if w not in self._busy]:
            self._retire(process)
        for process in list(self._busy):
            process.kill()
        for task in self._replacing:
            task.cancel()
        while self._tasks:
            await asyncio.wait(set(self._tasks))
