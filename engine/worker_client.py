"""The engine's side of the engine⇄worker pipe: a ROUTER bound at ``worker_addr``; the worker's DEALER
connects and says WorkerReady. Send SchedulerOutput (+ tensor frames), wait for the reply carrying the
same step id. Two steps may be in flight (``--async-scheduling``): the worker answers them in order, and
a reply read before its step is awaited is kept until it is.

    engine (ROUTER, bind)  ──[id, SchedulerOutput, frame 1..N]──▶  worker (DEALER, connect)
                           ◀──[id, WorkerReady | RunnerOutput | WorkerError]────
    socket monitor (inproc PAIR) ◀── ACCEPTED(fd) / DISCONNECTED(fd) of every peer connection

- **Late replies.** A step that timed out may still be answered; that reply arrives while a later step
  is awaited. Replies carry their step id: one for a step no longer in flight is discarded (logged,
  counted in ``num_stale_replies``), so a single timeout never shifts every later reply by one.
- **Bad messages.** A reply that does not decode, a second ``WorkerReady`` of the current worker, a
  reply for a step not sent yet, extra frames: counted in ``bad_messages`` and dropped. One that does
  not decode from the current worker while steps are in flight fails the oldest unanswered one
  (``WorkerFailed``): it was that step's reply. Nothing a peer sends raises anything else here.
- **Loss.** The kernel closes a dead process's connection and ZeroMQ reports ``EVENT_DISCONNECTED``
  with the connection's fd (ipc:// and tcp:// alike, within milliseconds of a SIGKILL). The worker's
  fd is read from its WorkerReady frame (``SRCFD``); its disconnect raises ``WorkerLost`` from
  ``execute`` (which polls the data socket and the monitor together) and from ``check`` (called by the
  idle engine loop). A WorkerReady from another peer also means the current worker was replaced: it is
  kept for the next ``poll_ready``, and the current worker counts as lost.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.executor import WorkerFailed, WorkerLost
from wire.bad_messages import BadMessage, BadMessageLog, decode_frame0
from wire.curve import CurveServer
from wire.protocol import (
    UNDECODABLE_STEP_ID,
    RunnerOutput,
    SchedulerOutput,
    WorkerError,
    WorkerOutbound,
    WorkerReady,
    WorkerShutdown,
    decode_worker_outbound,
    encode,
)

log = logging.getLogger(__name__)

__all__ = ["WorkerClient", "WorkerFailed", "WorkerLost"]


class WorkerClient:
    def __init__(
        self,
        ctx: zmq.Context,
        worker_addr: str,
        step_timeout_s: float,
        bad_messages: BadMessageLog | None = None,
        *,
        curve: CurveServer | None = None,
    ) -> None:
        """``bad_messages``: the engine process's log of them (a fresh one when None); ``curve``: the
        bind is a CURVE server (wire/curve.py)."""
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if curve is not None:
            curve.secure(self.sock)
        self.sock.bind(worker_addr)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)
        self.step_timeout_s = step_timeout_s
        self.worker_id: bytes | None = None
        self._worker_fd: int | None = None  # None while no worker, or where libzmq gives no SRCFD
        self._closed_fds: set[int] = set()  # disconnected, not accepted again since
        self._lost: str | None = None  # why the current worker is gone, until forget_worker()
        self._next_ready: tuple[bytes, int | None, WorkerReady] | None = None
        self.num_stale_replies = 0
        self.bad_messages = bad_messages if bad_messages is not None else BadMessageLog(log)
        self.worker_bad_messages = 0  # what the current worker last reported dropping
        self._in_flight: dict[int, float] = {}  # step id -> its deadline; sent, not awaited yet (in order)
        self._answers: dict[int, RunnerOutput | WorkerFailed] = {}  # read before their step was awaited
        self._last_sent_step_id = 0

    def poll_ready(self, timeout_s: float) -> WorkerReady | None:
        """Waits up to ``timeout_s`` for a worker to connect and say WorkerReady (a new process after a
        loss: a new identity). Called while there is no current worker."""
        assert self.worker_id is None, "forget_worker() first"
        deadline = time.monotonic() + timeout_s
        while self._next_ready is None:
            if not self._wait(deadline):
                return None
            self._read_monitor()
            self._read_replies()
        identity, fd, ready = self._next_ready
        self._next_ready = None
        self.worker_id, self._worker_fd = identity, fd
        log.info("worker ready on %s (%s)", ready.device, ready.dtype)
        return ready

    def forget_worker(self) -> None:
        """Called once the engine handled the loss of the current worker."""
        self.worker_id = self._worker_fd = self._lost = None
        self.worker_bad_messages = 0
        self._in_flight.clear()
        self._answers.clear()

    def check(self) -> None:
        """Non-blocking: raises ``WorkerLost`` if the current worker is gone; keeps the replies of steps in
        flight, discards stray ones."""
        self._read_monitor()
        self._read_replies()
        self._raise_if_lost()

    def execute(self, sched: SchedulerOutput, frames: Sequence[memoryview]) -> RunnerOutput:
        """``send`` then ``wait``."""
        self.send(sched, frames)
        return self.wait(sched.step_id)

    def send(self, sched: SchedulerOutput, frames: Sequence[memoryview]) -> None:
        """Sends the step (step ids increase); ``WorkerLost`` if the worker is gone."""
        self.check()
        assert self.worker_id is not None, "poll_ready() first"
        try:
            self.sock.send_multipart([self.worker_id, encode(sched), *frames], copy=False)
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the peer's pipe is gone
            self._lost = f"cannot send step {sched.step_id}: {exc}"
            self._raise_if_lost()
        self._in_flight[sched.step_id] = time.monotonic() + self.step_timeout_s
        self._last_sent_step_id = sched.step_id

    def wait(self, step_id: int) -> RunnerOutput:
        """The reply to the step ``send`` sent: ``WorkerFailed`` on ``WorkerError`` or after
        ``step_timeout_s`` from its send, ``WorkerLost`` as soon as the worker's connection closes."""
        assert step_id in self._in_flight, f"step {step_id} is not in flight"
        while True:
            self._read_monitor()
            self._read_replies()
            answer = self._answers.pop(step_id, None)
            if answer is not None:
                del self._in_flight[step_id]
                if isinstance(answer, WorkerFailed):
                    raise answer
                return answer
            self._raise_if_lost()
            if not self._wait(self._in_flight[step_id]):
                del self._in_flight[step_id]  # its reply, if it comes, is discarded
                raise WorkerFailed(f"worker did not answer step {step_id} in {self.step_timeout_s:g}s")

    def shutdown(self) -> None:
        if self.worker_id is not None:
            with contextlib.suppress(zmq.ZMQError):  # the worker may already be gone
                self.sock.send_multipart([self.worker_id, encode(WorkerShutdown())], flags=zmq.NOBLOCK)
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=100)

    # ------------------------------------------------------------------ internals

    def _wait(self, deadline: float) -> bool:
        """Polls the data socket and the monitor until either is readable (True) or ``deadline``."""
        remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
        return bool(self._poller.poll(remaining_ms))

    def _read_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._closed_fds.discard(fd)  # the number is reused by a new connection
                continue
            self._closed_fds.add(fd)
            if self.worker_id is not None and self._worker_fd in (fd, None):
                self._lost = "the worker's connection closed (its process exited or was killed)"

    def _read_replies(self) -> None:
        """Reads every waiting message: keeps the replies of steps in flight (a ``WorkerError`` as the
        ``WorkerFailed`` its wait raises), discards late ones, keeps a new worker's WorkerReady for
        ``poll_ready``."""
        while True:
            try:
                parts = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            identity, fd = parts[0].bytes, _source_fd(parts[-1])
            try:
                msg = _decode_reply(parts[1:])
                if isinstance(msg, WorkerReady):
                    self._on_ready(identity, fd, msg)
                    continue
                if identity == self.worker_id:
                    self.worker_bad_messages = msg.num_bad_messages
                self._keep(identity, msg)
            except BadMessage as bad:
                self.bad_messages.record("worker", bad)
                oldest = self._oldest_unanswered()
                if bad.kind in _UNDECODABLE and identity == self.worker_id and oldest is not None:
                    self._answers[oldest] = WorkerFailed(f"worker's reply to step {oldest}: {bad}")

    def _keep(self, identity: bytes, msg: RunnerOutput | WorkerError) -> None:
        """Keeps the reply of a step in flight (a ``WorkerError`` as its ``WorkerFailed``), or discards
        it; ``BadMessage`` for a reply to a step not sent yet."""
        if identity != self.worker_id:
            self._discard(msg, "from a worker that is no longer current")
            return
        step_id = msg.step_id
        if step_id == UNDECODABLE_STEP_ID:  # the worker answers in order: the oldest unanswered step's
            step_id = self._oldest_unanswered() or UNDECODABLE_STEP_ID
        if step_id > self._last_sent_step_id:
            last = self._last_sent_step_id
            raise BadMessage("reply for a step not sent", f"step {step_id}, last sent {last}")
        if step_id not in self._in_flight or step_id in self._answers:
            self._discard(msg, "for a step not in flight")
            return
        if isinstance(msg, WorkerError):
            self._answers[step_id] = WorkerFailed(
                f"worker failed step {step_id}: {msg.message}", msg.unavailable_mm_hashes
            )
        else:
            self._answers[step_id] = msg

    def _oldest_unanswered(self) -> int | None:
        return next((step_id for step_id in self._in_flight if step_id not in self._answers), None)

    def _on_ready(self, identity: bytes, fd: int | None, msg: WorkerReady) -> None:
        # The connection's ACCEPTED (and a DISCONNECTED, if it is gone already) was reported before
        # its message could be read: read the monitor again so a reused fd number is not mistaken.
        self._read_monitor()
        if fd is not None and fd in self._closed_fds:
            log.warning("ignoring WorkerReady of a connection that already closed")
            return
        if identity == self.worker_id:
            raise BadMessage("second WorkerReady", "the current worker said WorkerReady again")
        self._next_ready = (identity, fd, msg)
        if self.worker_id is not None:
            self._lost = "another worker connected"

    def _discard(self, msg: WorkerOutbound, why: str) -> None:
        self.num_stale_replies += 1
        step_id = getattr(msg, "step_id", None)
        log.warning("discarding a late %s for step %s %s", type(msg).__name__, step_id, why)

    def _raise_if_lost(self) -> None:
        if self._lost is not None:
            raise WorkerLost(self._lost)


_UNDECODABLE = frozenset({"empty message", "undecodable", "not a known message", "extra frame"})


def _decode_reply(frames: Sequence[zmq.Frame]) -> WorkerOutbound:
    """A worker's reply is one frame; ``BadMessage`` for anything else."""
    if len(frames) > 1:
        raise BadMessage("extra frame", f"a reply of {len(frames)} frames")
    msg: WorkerOutbound = decode_frame0(decode_worker_outbound, [f.buffer for f in frames])
    return msg


def _source_fd(frame: zmq.Frame) -> int | None:
    """The fd of the connection a frame came through (libzmq's deprecated but present ZMQ_SRCFD);
    None where unsupported, and then any disconnect counts as the worker's."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, ValueError):
        return None
