"""What an API process does on the engine's socket, synchronously: for tests that play the API against a
real engine (a DEALER connected to the engine's ROUTER)."""

from __future__ import annotations

import time

import zmq

from wire.protocol import (
    EngineDead,
    EngineOutputs,
    EngineReady,
    EngineStats,
    Hello,
    RequestOutput,
    decode_engine_outbound,
    encode,
)


class ApiPeer:
    """Collects every output by request id, every EngineDead and the latest stats as messages arrive."""

    def __init__(self, addr: str, ctx: zmq.Context | None = None) -> None:
        self.own_ctx = ctx is None
        self.ctx = ctx if ctx is not None else zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.received: dict[str, list[RequestOutput]] = {}
        self.dead: list[EngineDead] = []
        self.stats: EngineStats | None = None

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.own_ctx:
            self.ctx.term()

    def recv(self, timeout_s: float) -> EngineOutputs | EngineReady | EngineDead | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        msg = decode_engine_outbound(self.sock.recv_multipart()[0])
        if isinstance(msg, EngineDead):
            self.dead.append(msg)
        if isinstance(msg, EngineOutputs):
            self.stats = msg.stats or self.stats
            for output in msg.outputs:
                self.received.setdefault(output.req_id, []).append(output)
        return msg

    def wait_ready(self, timeout_s: float) -> EngineReady | None:
        """Says Hello every 0.5 s until an EngineReady arrives (None after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.sock.send(encode(Hello()))
            end = min(deadline, time.monotonic() + 0.5)
            while (left := end - time.monotonic()) > 0:
                msg = self.recv(left)
                if isinstance(msg, EngineReady):
                    return msg
        return None

    def finished(self, req_id: str, timeout_s: float) -> list[RequestOutput]:
        """The request's outputs once its last one (with a finish reason) arrived."""
        deadline = time.monotonic() + timeout_s
        while not (got := self.received.get(req_id, [])) or got[-1].finish_reason is None:
            assert time.monotonic() < deadline, f"{req_id}: no end within {timeout_s}s: {got}"
            self.recv(0.05)
        return got


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for output in outputs for t in output.new_token_ids]
