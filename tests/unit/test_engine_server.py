"""EngineServer (engine/engine_main.py) over real ZeroMQ sockets, in threads, with the stand-in worker
(tests/standin_worker.py) on its worker socket and this test as the API: requests are served with the
stand-in's tokens, a worker that dies mid-request fails it at once with 503 and EngineDead, and the
next worker brings a fresh epoch. No model, no processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from engine.config import EngineConfig, SchedulerOptions
from engine.engine_main import EngineServer
from engine.protocol import (
    AddRequest,
    EngineDead,
    EngineOutputs,
    EngineReady,
    EngineStats,
    Hello,
    RequestOutput,
    SamplingParams,
    Shutdown,
    decode_engine_outbound,
    encode,
)
from tests.standin_worker import StandinWorker, serving


class Api:
    """What an API process does on the engine socket, synchronously."""

    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.received: dict[str, list[RequestOutput]] = {}
        self.dead: list[EngineDead] = []
        self.stats: EngineStats | None = None

    def recv(self, timeout_s: float) -> EngineOutputs | EngineReady | EngineDead | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        msg = decode_engine_outbound(self.sock.recv_multipart()[0])
        if isinstance(msg, EngineDead):
            self.dead.append(msg)
        if isinstance(msg, EngineOutputs):
            self.stats = msg.stats or self.stats
            for out in msg.outputs:
                self.received.setdefault(out.req_id, []).append(out)
        return msg

    def wait_ready(self, timeout_s: float = 10.0) -> EngineReady:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.sock.send(encode(Hello()))
            if isinstance(msg := self.recv(0.2), EngineReady):
                return msg
        raise AssertionError("no EngineReady")

    def submit(self, req_id: str, max_tokens: int) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.sock.send(encode(AddRequest(req_id, list(range(20)), sampling)))

    def finished(self, req_id: str, timeout_s: float = 10.0) -> list[RequestOutput]:
        deadline = time.monotonic() + timeout_s
        while not (got := self.received.get(req_id, [])) or got[-1].finish_reason is None:
            assert time.monotonic() < deadline, f"{req_id} did not finish: {got}"
            self.recv(0.05)
        return got


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[Api, str]]:
    """An EngineServer serving in a thread; yields (the API's socket, the worker address)."""
    options = SchedulerOptions(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=512,
        encoder_cache_tokens=1024,
        encoder_compute_budget_tokens=512,
        enable_prefix_caching=True,
        disable_chunked_mm_input=False,
        max_waiting_requests=None,
    )
    engine_addr, worker_addr = f"ipc://{tmp_path}/engine.sock", f"ipc://{tmp_path}/worker.sock"
    config = EngineConfig(engine_addr, worker_addr, options, 5.0, "info", None, step_timeout_s=5.0)
    ctx = zmq.Context()
    server = EngineServer(config, ctx)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    api = Api(ctx, engine_addr)
    try:
        yield api, worker_addr
        api.sock.send(encode(Shutdown()))
        thread.join(5)
        assert not thread.is_alive(), "Shutdown did not stop the engine"
    finally:
        server.running = False
        thread.join(5)
        api.sock.close(linger=0)
        server.close("test over")
        ctx.term()


def test_a_lost_worker_fails_its_request_and_the_next_worker_serves_a_fresh_epoch(
    engine: tuple[Api, str],
) -> None:
    api, worker_addr = engine
    with serving(StandinWorker(lose_steps={4}), worker_addr):
        first = api.wait_ready()
        api.submit("before", max_tokens=2)
        assert tokens(api.finished("before")) == [20, 21]  # steps 1 and 2: the stand-in counts on

        api.submit("endless", max_tokens=400)  # step 3 gives a token, the worker dies on step 4
        [*streamed, last] = api.finished("endless")
        assert tokens(streamed) == [20] and last.new_token_ids == []
        assert last.error is not None and (last.error.code, last.error.http_status) == (
            "worker_unavailable",
            503,
        )
        while not api.dead:
            assert api.recv(5) is not None, "no EngineDead"
        assert "worker" in api.dead[0].reason

    with serving(StandinWorker(), worker_addr):
        second = api.wait_ready()
        assert second.epoch != first.epoch
        api.submit("after", max_tokens=3)
        after = api.finished("after")
        assert tokens(after) == [20, 21, 22] and after[0].num_cached_tokens == 0  # a fresh prefix cache
        assert api.stats is not None and api.stats.counters["worker_losses_total"] == 1
