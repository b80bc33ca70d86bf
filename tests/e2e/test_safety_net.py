"""The mirror's safety net (docs/architecture.md, "IPC mirror", rule 5): if the engine lacks an item
the API's mirror claims, the
API invalidates it and re-sends the request with payloads; the client never notices. The invariant
holds by construction, so the test breaks it on purpose: it drops the engine's receiver-cache partition
behind the mirror's back, then sends the same image again."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api.server import create_app
from app.settings import Settings
from tests.e2e.conftest import make_image, user_message
from tests.e2e.metrics import parse_metrics
from tests.e2e.server import ServerProcess
from wire.protocol import ResetCaches

pytestmark = pytest.mark.slow


def test_engine_miss_is_resent_with_payloads(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine_addr, worker_addr = f"ipc://{tmp_path}/engine.sock", f"ipc://{tmp_path}/worker.sock"
    addrs = ["--engine-addr", engine_addr, "--worker-addr", worker_addr, "--model", str(tiny_model_dir)]
    engine = ServerProcess(["engine", *addrs], tmp_path / "engine.log").start()
    worker = ServerProcess(["worker", *addrs], tmp_path / "worker.log").start()
    app = create_app(Settings(model=str(tiny_model_dir), engine_addr=engine_addr))
    try:
        with TestClient(app) as client:
            state = app.state.mmserve
            assert client.portal.call(state.engine.wait_ready, 120.0), engine.log() + worker.log()
            body = {
                "model": "tiny-llava",
                "messages": [user_message("Again?", make_image(600))],
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            }
            first = client.post("/v1/chat/completions", json=body)
            assert first.status_code == 200, first.text
            # Drift on purpose: the engine forgets this API's items, the mirror is not told.
            client.portal.call(state.engine._send, ResetCaches(encoder=False))
            second = client.post("/v1/chat/completions", json=body)
            assert second.status_code == 200, second.text
            assert second.json()["choices"] == first.json()["choices"]
            metrics = parse_metrics(client.get("/metrics").text)
            assert metrics["mmserve_mm_ipc_cache_resends_total"] == 1
            assert metrics["mmserve_mm_ipc_cache_hits_total"] == 1  # the mirror did claim it
            third = client.post("/v1/chat/completions", json=body)  # and the caches agree again
            assert third.json()["choices"] == first.json()["choices"]
            metrics = parse_metrics(client.get("/metrics").text)
            assert metrics["mmserve_mm_ipc_cache_resends_total"] == 1
            assert metrics["mmserve_mm_ipc_cache_hits_total"] == 2
    finally:
        for process in (engine, worker):
            process.interrupt(timeout_s=20)
