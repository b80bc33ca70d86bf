"""The tests' stand-in worker (tests/standin_worker.py) over ZeroMQ, as ``workers/worker_main.py``
serves the real one: in a thread (``serving``), or as a process of its own
(``python -m tests.standin_worker_process ADDR``, for tests that SIGKILL it)."""

from __future__ import annotations

import argparse
import contextlib
import threading
from collections.abc import Iterator

import msgspec
import zmq

from tests.standin_worker import StandinWorker
from wire.protocol import (
    UNDECODABLE_STEP_ID,
    RunnerOutput,
    WorkerError,
    WorkerShutdown,
    decode_worker_inbound,
    encode,
)


def serve(worker: StandinWorker, addr: str, stop: threading.Event) -> None:
    """``workers/worker_main.py``'s loop around ``worker``: a DEALER connects to ``addr``, says
    ``worker.ready`` and answers each step, until ``WorkerShutdown``, ``stop``, or a ``lose_steps``
    step (the socket closes unanswered, so the engine sees the connection drop)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(addr)
        sock.send(encode(worker.ready))
        while not stop.is_set():
            if not sock.poll(20):
                continue
            parts = sock.recv_multipart(copy=False)
            try:
                msg = decode_worker_inbound(parts[0].buffer)
            except msgspec.MsgspecError as exc:
                sock.send(encode(WorkerError(UNDECODABLE_STEP_ID, str(exc))))
                continue
            if isinstance(msg, WorkerShutdown):
                return
            reply: RunnerOutput | WorkerError | None
            try:
                reply = worker.handle(msg, [part.buffer for part in parts[1:]])
            except Exception as exc:  # as the worker does: answered, and serving goes on
                worker.errors.append(f"step {msg.step_id}: {type(exc).__name__}: {exc}")
                reply = WorkerError(msg.step_id, f"{type(exc).__name__}: {exc}")
            if worker.dead:
                return
            if reply is not None:
                sock.send(encode(reply))
    finally:
        sock.close(linger=0)
        ctx.term()
        worker.close()


@contextlib.contextmanager
def serving(worker: StandinWorker, addr: str) -> Iterator[StandinWorker]:
    """``serve`` in a thread for the duration of the block; yields ``worker``."""
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(worker, addr, stop), daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        stop.set()
        thread.join(5)


def main() -> None:
    """``python -m tests.standin_worker_process ADDR [--drop-replies STEP ...]``: the stand-in as a
    process of its own (for tests that SIGKILL it)."""
    parser = argparse.ArgumentParser(description="the tests' stand-in worker")
    parser.add_argument("addr")
    parser.add_argument("--drop-replies", type=int, nargs="*", default=[], metavar="STEP")
    args = parser.parse_args()
    serve(StandinWorker(drop_replies=args.drop_replies), args.addr, threading.Event())


if __name__ == "__main__":
    main()
