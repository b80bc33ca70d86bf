"""Worker process entry point: serve the engine's steps over a ZeroMQ DEALER socket.

    engine (ROUTER, binds worker_addr)                worker (DEALER, connects)
        ◀── [WorkerReady(device, dtype, num_kv_blocks, block_size)]   model loaded, KV pool allocated
        ──▶ [SchedulerOutput, tensor frames...]
        ◀── [RunnerOutput]  or  [WorkerError(step_id, message)]   one reply per step
        ──▶ [WorkerShutdown]                             the worker closes and returns

A failing step is answered with ``WorkerError`` and the worker keeps serving. SIGTERM/SIGINT end the
loop between steps; the socket closes with linger 0.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

import msgspec
import zmq

from engine.protocol import (
    UNDECODABLE_STEP_ID,
    RunnerOutput,
    WorkerError,
    WorkerReady,
    WorkerShutdown,
    decode_worker_inbound,
    encode,
)
from workers.config import WorkerConfig
from workers.frames import dtype_name
from workers.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_POLL_INTERVAL_MS = 100  # how quickly a signal ends an idle loop


def run_worker(config: WorkerConfig) -> None:
    """Load the model, connect to the engine, serve steps until WorkerShutdown or a signal."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    runner = ModelRunner(
        config.model,
        config.device,
        block_size=config.block_size,
        kv_cache_tokens=config.kv_cache_tokens,
        gpu_memory_utilization=config.gpu_memory_utilization,
    )
    stop = threading.Event()
    restore_signals = _handle_signals(stop)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(config.worker_addr)
        ready = WorkerReady(
            device=str(runner.device),
            dtype=dtype_name(runner.dtype),
            num_kv_blocks=runner.num_kv_blocks,
            block_size=runner.block_size,
        )
        sock.send_multipart([encode(ready)])
        logger.info("worker ready on %s, connected to %s", runner.device, config.worker_addr)
        _serve(sock, runner, stop)
    finally:
        sock.close(linger=0)
        ctx.term()
        restore_signals()
        logger.info("worker stopped")


def _serve(sock: zmq.Socket, runner: ModelRunner, stop: threading.Event) -> None:
    while not stop.is_set():
        if not sock.poll(_POLL_INTERVAL_MS, zmq.POLLIN):
            continue
        frames = sock.recv_multipart(copy=False)
        try:
            msg = decode_worker_inbound(frames[0].buffer)
        except msgspec.MsgspecError as exc:
            logger.error("undecodable message from the engine: %s", exc)
            sock.send_multipart([encode(WorkerError(step_id=UNDECODABLE_STEP_ID, message=str(exc)))])
            continue
        if isinstance(msg, WorkerShutdown):
            logger.info("shutdown requested by the engine")
            return
        reply: RunnerOutput | WorkerError
        try:
            reply = runner.execute(msg, frames)
        except Exception as exc:
            logger.exception("step %d failed", msg.step_id)
            reply = WorkerError(step_id=msg.step_id, message=f"{type(exc).__name__}: {exc}")
        sock.send_multipart([encode(reply)])


def _handle_signals(stop: threading.Event) -> Callable[[], None]:
    """SIGTERM/SIGINT set ``stop``. Python only allows handlers in the main thread; elsewhere (a worker
    run in a thread, as tests do) the caller owns signals and this is a no-op."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
