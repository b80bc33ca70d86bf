"""Entry point of the engine process: drain inbox → dispatch by message type → ``step()`` → publish.

API (DEALER, connect) ──[AddRequest|Abort|ResetCaches|Hello|Drain|Shutdown, frames]──▶ engine (ROUTER)
                      ◀──[EngineReady|EngineOutputs|EngineDead]──────────────────────

The engine serves only while it has a worker (docs/architecture.md, "Engine step")::

    no worker ──WorkerReady──▶ serving (a fresh EngineCore, new epoch; EngineReady to every API)
        ▲                          │
        └──────WorkerLost──────────┘  every request held fails with 503 worker_unavailable;
                                      EngineDead to every API
    With no worker, Hello is not answered (API health stays 503) and AddRequest is refused at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Sequence

import zmq

from engine.api_messages import decode_api_message
from engine.config import EngineConfig
from engine.core import EngineCore, Outputs
from engine.ec_connector import ECConnectorScheduler
from engine.executor import WorkerLost
from engine.step_plan import SchedulerConfig
from engine.structured.compiler import GrammarCompiler
from engine.worker_client import WorkerClient
from wire.bad_messages import BadMessage, BadMessageLog
from wire.curve import CurveServer, uses_curve
from wire.ec_store.reconnecting import ReconnectingStore
from wire.metric_names import EngineCounter
from wire.protocol import (
    Abort,
    AddRequest,
    Drain,
    EngineDead,
    EngineInbound,
    EngineOutputs,
    EngineReady,
    ErrorInfo,
    FinishReason,
    Hello,
    RequestOutput,
    ResetCaches,
    Shutdown,
    WorkerReady,
    encode,
)

log = logging.getLogger("mmserve.engine")

IDLE_POLL_MS = 100
# An API process that sent nothing (not even its Hello heartbeat) for this long is gone: its
# receiver-cache partition is dropped. Were it only stalled, its next request takes the safety net.
CLIENT_TIMEOUT_S = 60.0


class EngineServer:
    """Owns the sockets around an ``EngineCore`` (one per worker)."""

    def __init__(self, config: EngineConfig, ctx: zmq.Context) -> None:
        self.config = config
        # CURVE on tcp:// binds when the deployment has keys (wire/curve.py)
        self.curve = CurveServer(ctx, config.curve) if config.curve is not None else None
        self.api_sock = ctx.socket(zmq.ROUTER)
        self.api_sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None and uses_curve(config.engine_addr, config.curve):
            self.curve.secure(self.api_sock)
        self.api_sock.bind(config.engine_addr)
        self.bad_messages = BadMessageLog(log)  # from API processes and from the worker
        worker_curve = self.curve if uses_curve(config.worker_addr, config.curve) else None
        self.worker = WorkerClient(
            ctx, config.worker_addr, config.step_timeout_s, self.bad_messages, curve=worker_curve
        )
        # a compile thread ends by writing a byte here, which wakes the loop's poll
        self._grammar_wake_read, self._grammar_wake_write = os.pipe()
        os.set_blocking(self._grammar_wake_read, False)
        os.set_blocking(self._grammar_wake_write, False)
        self.grammars = GrammarCompiler(config.structured_outputs, wake=self._wake_for_grammar)
        self._poller = zmq.Poller()
        for sock in (self.api_sock, self.worker.sock, self.worker.monitor):
            self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._grammar_wake_read, zmq.POLLIN)
        self._core: EngineCore | None = None  # built once a worker says how large its KV pool is
        self.clients: dict[bytes, float] = {}  # identity -> last time it sent anything
        self.running = True
        self.draining = False  # Drain: new requests are refused, held ones run on
        self._stop_when_idle = False  # Shutdown while draining: stop once no request is held
        self._stop_deadline: float | None = None  # ... or at this time (SIGTERM's shutdown timeout)
        self._stats_dirty = False
        self.num_worker_losses = 0
        self._ec_store: ReconnectingStore | None = None  # opened with the first core, kept across cores

    @property
    def core(self) -> EngineCore:
        assert self._core is not None, "no worker: no core"
        return self._core

    @property
    def has_requests(self) -> bool:
        return self._core is not None and self._core.has_work

    def ready_message(self) -> EngineReady:
        return EngineReady(epoch=self.core.epoch)

    def serve(self) -> None:
        log.info(
            "engine listening on %s, waiting for the worker on %s",
            self.config.engine_addr,
            self.config.worker_addr,
        )
        while self.running:
            events = dict(self._poller.poll(0 if self.has_requests else IDLE_POLL_MS))
            if self.api_sock in events:
                self._drain_inbox()
            if self._grammar_wake_read in events:  # a compile ended: its figures go out, even idle
                with contextlib.suppress(BlockingIOError):
                    os.read(self._grammar_wake_read, 4096)
                self._stats_dirty = True
            if self._core is not None and self._core.grammar_tickets:
                resolved = self._core.resolve_grammars()
                self._stats_dirty |= bool(resolved)
                self._publish(resolved, with_stats=False)
            if not self.running:
                break
            try:
                self._advance()
            except WorkerLost as exc:
                self._on_worker_lost(str(exc))
            if self._stop_deadline is not None and time.monotonic() >= self._stop_deadline:
                log.warning("shutdown timeout: stopping with requests still held")
                self.running = False

    def _advance(self) -> None:
        """One turn of the loop after the inbox: adopt a worker, or finish the step in flight and
        launch the next, or launch one, or idle work.

        A step's outputs are published after the next step went out, and the inbox is read while it
        runs: the worker does not wait for either (a request that arrives meanwhile joins the step
        after). With ``--async-scheduling`` the next step is also scheduled and sent before the one in
        flight is answered, so the worker never waits for the scheduler either; it is scheduled from
        what is known, and a step that needs the answer first waits for it (``can_schedule_ahead``;
        docs/architecture.md, "Engine step")."""
        if self._core is None:
            ready = self.worker.poll_ready(timeout_s=0)
            if ready is not None:
                self._start_core(ready)
            elif self._stop_when_idle:
                self.running = False
            return
        core = self._core
        if not core.in_flight:
            self.worker.check()
            if not core.has_work:
                self._idle(core)
                return
        a_step_ends = bool(core.in_flight)
        outputs = core.advance(ahead=self.config.scheduler.async_scheduling)
        if a_step_ends or outputs:  # (a step just launched from idle has nothing to say yet)
            self._publish(outputs, with_stats=True)
            self._stats_dirty = False

    def _idle(self, core: EngineCore) -> None:
        if self._stop_when_idle and not core.holds_requests:
            log.info("drained: stopping")
            self.running = False
        elif self._stats_dirty:  # e.g. an abort emptied the engine: gauges must say so
            self._publish({}, with_stats=True)
            self._stats_dirty = False
        else:
            self._forget_silent_clients()

    def _start_core(self, ready: WorkerReady) -> None:
        """A fresh core for a new worker: empty caches, new epoch; every known API hears of it at
        once (a new epoch empties its mirror)."""
        # the scheduler's knobs come from the engine's settings, the pool's size from the worker
        scheduler_config = SchedulerConfig.for_worker(
            self.config.scheduler,
            num_kv_blocks=ready.num_kv_blocks,
            block_size=ready.block_size,
            can_encode=ready.has_vision_tower,
        )
        connector = None
        if self.config.ec is not None:
            if self._ec_store is None:
                self._ec_store = ReconnectingStore(self.config.ec)
            connector = ECConnectorScheduler(self._ec_store, self.config.ec.role)
        self._core = EngineCore(
            scheduler_config,
            self.worker,
            connector,
            encode_only=not ready.has_language_model,
            vocab_size=ready.vocab_size,
            bad_messages=self.bad_messages,
            grammars=self.grammars,
        )
        if self.draining:
            self._core.drain()
        log.info(
            "serving with epoch %s; KV pool: %d blocks of %d tokens",
            self._core.epoch,
            ready.num_kv_blocks,
            ready.block_size,
        )
        for client in self.clients:
            self._send(client, self.ready_message())

    def _on_worker_lost(self, reason: str) -> None:
        """Every request held fails with 503 (before EngineDead, so each gets its own error), the
        APIs hear EngineDead (their health turns 503), and the loop waits for the next worker."""
        log.error("worker lost: %s", reason)
        self.num_worker_losses += 1
        error = ErrorInfo(
            message=f"The model worker is unavailable ({reason}); retry shortly.",
            code="worker_unavailable",
            http_status=503,
        )
        self._publish(self.core.fail_all(error), with_stats=True)
        for client in self.clients:
            self._send(client, EngineDead(f"worker lost: {reason}"))
        self._core = None
        self.worker.forget_worker()

    def _drain_inbox(self) -> None:
        """Reads every waiting API message. One that is bad (wire/bad_messages.py) is counted and
        dropped; the request it names, if any, gets a 500 (docs/architecture.md, "Bad messages")."""
        while self.running:
            try:
                parts = self.api_sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            client = parts[0].bytes
            frames = [p.buffer for p in parts[1:]]
            msg: EngineInbound | None = None
            try:
                msg = decode_api_message(frames)
                self.clients[client] = time.monotonic()  # a sender becomes a client by a good message
                outputs = self._dispatch(client, msg, frames)
            except BadMessage as bad:
                outputs = self._on_bad_message(client, bad)
            except Exception as exc:  # a bug met by this message: it must not stop the engine
                req_id = msg.req_id if isinstance(msg, AddRequest) else None
                outputs = self._on_bad_message(client, BadMessage.from_bug(exc, f"{msg!r:.200}", req_id))
            self._publish(outputs, with_stats=False)

    def _on_bad_message(self, client: bytes, bad: BadMessage) -> Outputs:
        self.bad_messages.record("api", bad)
        self._stats_dirty = True
        if bad.req_id is None:
            return {}
        error = ErrorInfo(f"The engine could not take this request ({bad}).", "internal_error", 500)
        return {client: [RequestOutput(bad.req_id, finish_reason=FinishReason.ABORT, error=error)]}

    def _forget_silent_clients(self) -> None:
        deadline = time.monotonic() - CLIENT_TIMEOUT_S
        for client in [c for c, last_seen in self.clients.items() if last_seen < deadline]:
            log.info("API client %r went silent: dropping its receiver-cache partition", client)
            del self.clients[client]
            self.core.receiver_caches.drop(client)

    def _dispatch(self, client: bytes, msg: EngineInbound, frames: Sequence[memoryview]) -> Outputs:
        self._stats_dirty |= not isinstance(msg, Hello)
        match msg:
            case Shutdown():
                self.shutdown()
                return {}
            case Drain():
                self.drain()
                return {}
        if self._core is None:  # no worker: nothing to answer Hello with, nothing to run a request on
            if isinstance(msg, AddRequest):
                return _refusal(client, msg.req_id, "The model worker is unavailable; retry shortly.")
            return {}
        match msg:
            case AddRequest():
                return self._core.add_request(client, msg, frames)
            case Abort():
                return self._core.abort(client, msg)
            case ResetCaches():
                return self._core.reset_caches(client, msg)
            case Hello():
                self._send(client, self.ready_message())
                return {}
        raise AssertionError(f"unhandled message {msg!r}")

    def drain(self) -> None:
        """Refuse new requests (503 ``server_shutting_down``); the ones held run to the end."""
        log.info("draining: new requests are refused")
        self.draining = True
        if self._core is not None:
            self._core.drain()

    def shutdown(self, deadline: float | None = None) -> None:
        """Stop now; after ``drain()``, once no request is held (or at ``deadline``, if given)."""
        log.info("shutdown requested")
        if self.draining:
            self._stop_when_idle = True
            self._stop_deadline = deadline
        else:
            self.running = False

    def _publish(self, outputs: Outputs, *, with_stats: bool) -> None:
        stats = None
        if with_stats and self._core is not None:
            self._core.metrics.set_total(EngineCounter.WORKER_LOSSES, self.num_worker_losses)
            self._core.metrics.set_total(EngineCounter.WORKER_STALE_REPLIES, self.worker.num_stale_replies)
            bad = self.bad_messages.counts
            self._core.metrics.set_total(EngineCounter.BAD_MESSAGES_FROM_API, bad["api"])
            self._core.metrics.set_total(EngineCounter.BAD_MESSAGES_FROM_WORKER, bad["worker"])
            self._core.metrics.set_total(EngineCounter.WORKER_BAD_MESSAGES, self.worker.worker_bad_messages)
            stats = self._core.stats()
        targets = self.clients if stats is not None else set(outputs)
        for client in targets:
            self._send(client, EngineOutputs(outputs=outputs.get(client, []), stats=stats))

    def _wake_for_grammar(self) -> None:
        """From a compile thread, when a compile ended."""
        with contextlib.suppress(BlockingIOError):  # the pipe is full: the loop is awake anyway
            os.write(self._grammar_wake_write, b"g")

    def _send(self, client: bytes, msg: EngineOutputs | EngineReady | EngineDead) -> None:
        try:
            self.api_sock.send_multipart([client, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            log.warning("could not reach API client %r", client)

    def close(self, reason: str) -> None:
        for client in self.clients:
            self._send(client, EngineDead(reason))
        self.worker.shutdown()
        self.grammars.close()
        os.close(self._grammar_wake_read)
        os.close(self._grammar_wake_write)
        self.api_sock.close(linger=100)
        if self._ec_store is not None:
            self._ec_store.close()
        if self.curve is not None:
            self.curve.close()


def _refusal(client: bytes, req_id: str, message: str) -> Outputs:
    error = ErrorInfo(message=message, code="worker_unavailable", http_status=503)
    return {client: [RequestOutput(req_id, finish_reason=FinishReason.ABORT, error=error)]}


def run_engine(config: EngineConfig) -> None:
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ctx = zmq.Context()
    server = EngineServer(config, ctx)

    def _stop(signum: int, _frame: object) -> None:
        if signum == signal.SIGTERM and not server.draining:
            server.drain()
            server.shutdown(deadline=time.monotonic() + config.shutdown_timeout)
        else:  # SIGINT, or a second SIGTERM: stop now
            server.running = False

    if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:  # ignored: ``serve`` stops it by message
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
        # stopping already: a further Ctrl-C must not cut the exit short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        server.close(reason)
        ctx.term()
