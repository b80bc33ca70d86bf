"""The engine's side of the engine⇄worker pipe: a ROUTER bound at ``worker_addr``; the worker's DEALER
connects and says WorkerReady. One step at a time: send SchedulerOutput (+ tensor frames), wait for
the RunnerOutput of the same step.

    engine (ROUTER, bind)  ──[id, SchedulerOutput, frame 1..N]──▶  worker (DEALER, connect)
                           ◀──[id, WorkerReady | RunnerOutput]────
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import zmq

from engine.protocol import (
    RunnerOutput,
    SchedulerOutput,
    WorkerError,
    WorkerReady,
    WorkerShutdown,
    decode_worker_outbound,
    encode,
)

log = logging.getLogger(__name__)


class WorkerFailed(RuntimeError):
    pass


class WorkerClient:
    def __init__(self, ctx: zmq.Context, worker_addr: str, step_timeout_s: float = 600.0) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(worker_addr)
        self.step_timeout_ms = int(step_timeout_s * 1000)
        self.worker_id: bytes | None = None
        self.ready: WorkerReady | None = None

    def poll_ready(self, timeout_s: float) -> WorkerReady | None:
        """Waits up to ``timeout_s`` for the worker to connect and load its model."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        identity, payload = self.sock.recv_multipart()
        msg = decode_worker_outbound(payload)
        if not isinstance(msg, WorkerReady):
            raise WorkerFailed(f"expected WorkerReady, got {type(msg).__name__}")
        self.worker_id, self.ready = identity, msg
        log.info("worker ready on %s (%s)", msg.device, msg.dtype)
        return msg

    def execute(self, sched: SchedulerOutput, frames: Sequence[memoryview]) -> RunnerOutput:
        assert self.worker_id is not None, "poll_ready() first"
        self.sock.send_multipart([self.worker_id, encode(sched), *frames], copy=False)
        if not self.sock.poll(self.step_timeout_ms):
            raise WorkerFailed(f"worker did not answer step {sched.step_id}")
        _identity, payload = self.sock.recv_multipart()
        msg = decode_worker_outbound(payload)
        if isinstance(msg, WorkerError):
            raise WorkerFailed(f"worker failed step {msg.step_id}: {msg.message}")
        if not isinstance(msg, RunnerOutput) or msg.step_id != sched.step_id:
            raise WorkerFailed(f"unexpected worker reply {msg!r}")
        return msg

    def shutdown(self) -> None:
        if self.worker_id is not None:
            with contextlib.suppress(zmq.ZMQError):  # the worker may already be gone
                self.sock.send_multipart([self.worker_id, encode(WorkerShutdown())], flags=zmq.NOBLOCK)
        self.sock.close(linger=100)
