"""Entry point of the engine process: drain inbox → dispatch by message type → ``step()`` → publish.

API (DEALER, connect) ──[AddRequest|Abort|ResetCaches|Hello|Shutdown, frames]──▶ engine (ROUTER, bind)
                      ◀──[EngineReady|EngineOutputs|EngineDead]──────────────────
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from collections.abc import Sequence

import zmq

from engine.config import EngineConfig
from engine.core import EngineCore, Outputs
from engine.protocol import (
    Abort,
    AddRequest,
    EngineDead,
    EngineOutputs,
    EngineReady,
    ErrorInfo,
    FinishReason,
    Hello,
    RequestOutput,
    ResetCaches,
    Shutdown,
    decode_engine_inbound,
    encode,
)
from engine.scheduler import SchedulerConfig
from engine.worker_client import WorkerClient, WorkerFailed

log = logging.getLogger("mmserve.engine")

IDLE_POLL_MS = 100
# An API process that sent nothing (not even its Hello heartbeat) for this long is gone: its
# receiver-cache partition is dropped. Were it only stalled, its next request takes the safety net.
CLIENT_TIMEOUT_S = 60.0


class EngineServer:
    """Owns the sockets around an ``EngineCore``."""

    def __init__(self, config: EngineConfig, ctx: zmq.Context) -> None:
        self.config = config
        self.api_sock = ctx.socket(zmq.ROUTER)
        self.api_sock.setsockopt(zmq.LINGER, 0)
        self.api_sock.bind(config.engine_addr)
        self.worker = WorkerClient(ctx, config.worker_addr)
        self._core: EngineCore | None = None  # built once the worker says how large its KV pool is
        self.clients: dict[bytes, float] = {}  # identity -> last time it sent anything
        self.running = True
        self._stats_dirty = False

    @property
    def core(self) -> EngineCore:
        assert self._core is not None, "the API socket is read only once the worker is ready"
        return self._core

    def ready_message(self) -> EngineReady:
        c = self.config
        return EngineReady(
            epoch=self.core.epoch,
            max_model_len=c.max_model_len,
            max_num_batched_tokens=c.max_num_batched_tokens,
            encoder_cache_tokens=c.encoder_cache_tokens,
            encoder_compute_budget_tokens=c.encoder_compute_budget_tokens,
        )

    def serve(self) -> None:
        log.info(
            "engine listening on %s, waiting for the worker on %s",
            self.config.engine_addr,
            self.config.worker_addr,
        )
        ready = None
        while self.running and ready is None:
            ready = self.worker.poll_ready(timeout_s=0.1)
        if ready is None:
            return
        # the scheduler's knobs come from the engine's settings, the pool's size from the worker
        shared = {f.name for f in dataclasses.fields(SchedulerConfig)} & {
            f.name for f in dataclasses.fields(EngineConfig)
        }
        scheduler_config = SchedulerConfig(
            **{name: getattr(self.config, name) for name in shared},
            num_kv_blocks=ready.num_kv_blocks,
            block_size=ready.block_size,
        )
        self._core = EngineCore(scheduler_config, self.worker)
        log.info("KV pool: %d blocks of %d tokens", ready.num_kv_blocks, ready.block_size)
        while self.running:
            timeout = 0 if self.core.has_work else IDLE_POLL_MS
            if self.api_sock.poll(timeout):
                self._drain_inbox()
            if self.running and self.core.has_work:
                self._publish(self._step(), with_stats=True)
                self._stats_dirty = False
            elif self._stats_dirty:  # e.g. an abort emptied the engine: gauges must say so
                self._publish({}, with_stats=True)
                self._stats_dirty = False
            else:
                self._forget_silent_clients()

    def _drain_inbox(self) -> None:
        while self.running:
            try:
                parts = self.api_sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            client = parts[0].bytes
            self.clients[client] = time.monotonic()
            frames = [p.buffer for p in parts[1:]]
            self._publish(self._dispatch(client, frames), with_stats=False)

    def _forget_silent_clients(self) -> None:
        deadline = time.monotonic() - CLIENT_TIMEOUT_S
        for client in [c for c, last_seen in self.clients.items() if last_seen < deadline]:
            log.info("API client %r went silent: dropping its receiver-cache partition", client)
            del self.clients[client]
            self.core.receiver_caches.drop(client)

    def _dispatch(self, client: bytes, frames: Sequence[memoryview]) -> Outputs:
        msg = decode_engine_inbound(frames[0])
        self._stats_dirty |= not isinstance(msg, Hello)
        match msg:
            case AddRequest():
                return self.core.add_request(client, msg, frames)
            case Abort():
                return self.core.abort(client, msg)
            case ResetCaches():
                return self.core.reset_caches(client, msg)
            case Hello():
                self._send(client, self.ready_message())
                return {}
            case Shutdown():
                log.info("shutdown requested")
                self.running = False
                return {}
        raise AssertionError(f"unhandled message {msg!r}")

    def _step(self) -> Outputs:
        try:
            return self.core.step()
        except WorkerFailed as exc:
            # The worker's state for the running requests is unknown: fail them, keep serving others.
            log.exception("step failed")
            outputs: Outputs = {}
            error = ErrorInfo(
                message=f"internal error while running the model: {exc}",
                code="internal_error",
                http_status=500,
            )
            for request in list(self.core.scheduler.running):
                self.core.scheduler.abort(request.req_id)
                out = RequestOutput(request.req_id, finish_reason=FinishReason.ABORT, error=error)
                outputs.setdefault(request.client, []).append(out)
            return outputs

    def _publish(self, outputs: Outputs, *, with_stats: bool) -> None:
        stats = self.core.stats() if with_stats else None
        targets = self.clients if with_stats else set(outputs)
        for client in targets:
            self._send(client, EngineOutputs(outputs=outputs.get(client, []), stats=stats))

    def _send(self, client: bytes, msg: EngineOutputs | EngineReady | EngineDead) -> None:
        try:
            self.api_sock.send_multipart([client, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            log.warning("could not reach API client %r", client)

    def close(self, reason: str) -> None:
        for client in self.clients:
            self._send(client, EngineDead(reason))
        self.worker.shutdown()
        self.api_sock.close(linger=100)


def run_engine(config: EngineConfig) -> None:
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ctx = zmq.Context()
    server = EngineServer(config, ctx)

    def _stop(signum: int, _frame: object) -> None:
        server.running = False

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    reason = "engine stopped"
    try:
        server.serve()
    except Exception as exc:  # the engine dies loudly, telling its clients why
        log.exception("engine failed")
        reason = f"engine failed: {exc}"
        raise
    finally:
        server.close(reason)
        ctx.term()
