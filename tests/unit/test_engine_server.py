"""EngineServer (engine/engine_main.py) over real ZeroMQ sockets, in threads, with the stand-in worker
(tests/standin_worker.py) on its worker socket and this test as the API: requests are served with the
stand-in's tokens, a worker that dies mid-request fails it at once with 503 and EngineDead, and the
next worker brings a fresh epoch. No model, no processes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from engine.config import EngineConfig, SchedulerOptions, StructuredOutputOptions
from engine.engine_main import EngineServer
from tests.api_peer import ApiPeer, tokens
from tests.standin_worker import StandinWorker
from tests.standin_worker_process import serving
from wire.protocol import (
    AddRequest,
    SamplingParams,
    Shutdown,
    encode,
)


class Api(ApiPeer):
    def submit(self, req_id: str, max_tokens: int) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.sock.send(encode(AddRequest(req_id, list(range(20)), sampling)))


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
        prefix_match="token",
        disable_chunked_mm_input=False,
        max_waiting_requests=None,
        async_scheduling=True,
        scheduling_policy="fcfs",
    )
    engine_addr, worker_addr = f"ipc://{tmp_path}/engine.sock", f"ipc://{tmp_path}/worker.sock"
    grammars = StructuredOutputOptions(str(tmp_path / "no-model"), cache_bytes=1 << 20, compile_timeout_s=5.0)
    config = EngineConfig(
        engine_addr,
        worker_addr,
        options,
        5.0,
        "info",
        None,
        step_timeout_s=5,
        curve=None,
        structured_outputs=grammars,
    )
    ctx = zmq.Context()
    server = EngineServer(config, ctx)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    api = Api(engine_addr, ctx)
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
        first = api.wait_ready(10.0)
        assert first is not None
        api.submit("before", max_tokens=2)
        assert tokens(api.finished("before", 10.0)) == [20, 21]  # steps 1 and 2: the stand-in counts on

        api.submit("endless", max_tokens=400)  # step 3 gives a token, the worker dies on step 4
        [*streamed, last] = api.finished("endless", 10.0)
        assert tokens(streamed) == [20] and last.new_token_ids == []
        assert last.error is not None and (last.error.code, last.error.http_status) == (
            "worker_unavailable",
            503,
        )
        while not api.dead:
            assert api.recv(5) is not None, "no EngineDead"
        assert "worker" in api.dead[0].reason

    with serving(StandinWorker(), worker_addr):
        second = api.wait_ready(10.0)
        assert second is not None and second.epoch != first.epoch
        api.submit("after", max_tokens=3)
        after = api.finished("after", 10.0)
        assert tokens(after) == [20, 21, 22] and after[0].num_cached_tokens == 0  # a fresh prefix cache
        assert api.stats is not None and api.stats.counters["worker_losses_total"] == 1
