"""The worker as a process: tensors as zero-copy frames, the DEALER protocol over a real ZeroMQ socket,
and a clean exit on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from app.launch.process_configs import worker_config
from app.settings import Settings
from tests.integration.runner_support import (
    greedy,
)
from wire.protocol import (
    EncoderInput,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
    WorkerError,
    WorkerReady,
    WorkerShutdown,
    decode_worker_outbound,
    encode,
)
from workers.frames import tensor_from_frame, tensor_to_frame
from workers.worker_main import ENGINE_LOST, run_worker

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------- frames and socket


def test_frames_roundtrip_without_copy():
    for tensor in (
        torch.randn(2, 3, 4),
        torch.arange(6, dtype=torch.int64),
        torch.ones(3, dtype=torch.bfloat16),
    ):
        ref, buf = tensor_to_frame(tensor, frame=1)
        back = tensor_from_frame(ref, [b"", bytes(buf)])
        assert back.dtype == tensor.dtype and torch.equal(back, tensor)
    source = bytearray(np.arange(4, dtype=np.float32).tobytes())
    ref, _ = tensor_to_frame(torch.zeros(2, 2), frame=1)
    view = tensor_from_frame(ref, [b"", source])
    source[0:4] = np.float32(7.0).tobytes()  # same memory: no copy was made
    assert view[0, 0].item() == 7.0


@pytest.fixture
def router(tmp_path):
    """The engine's side: a ROUTER bound on an ipc path; yields (socket, address)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)  # a dead worker fails the test instead of hanging it
    addr = f"ipc://{tmp_path}/worker.sock"
    sock.bind(addr)
    yield sock, addr
    sock.close(linger=0)
    ctx.term()


def test_worker_over_zmq(router, tiny_model_dir, hf_model, prompts):
    router, addr = router
    settings = Settings(
        model=str(tiny_model_dir), worker_addr=addr, device="cpu", block_size=32, kv_cache_tokens=1000
    )
    config = worker_config(settings)
    thread = threading.Thread(target=run_worker, args=(config,), daemon=True)
    thread.start()
    assert router.poll(60_000), "no WorkerReady"
    identity, payload = router.recv_multipart()
    try:
        ready = WorkerReady(
            device="cpu",
            dtype="float32",
            num_kv_blocks=1000 // 32,
            block_size=32,
            vocab_size=hf_model.get_input_embeddings().num_embeddings,
        )
        assert decode_worker_outbound(payload) == ready

        prompt = prompts["one"]
        ref, buf = tensor_to_frame(prompt.items[0]["pixel_values"], frame=1)
        block_ids = list(range(ready.num_kv_blocks))[::-1][: -(-(len(prompt.input_ids) + 2) // 32)]
        new = NewRequestData("r", prompt.input_ids, prompt.features, greedy(hf_model), block_ids)
        sched = SchedulerOutput(
            0,
            [new],
            {"r": len(prompt.input_ids)},
            [EncoderInput(prompt.features[0].mm_hash, "image", {"pixel_values": ref})],
            [],
            [],
        )
        router.send_multipart([identity, encode(sched), buf])
        out = decode_worker_outbound(router.recv_multipart()[1])
        assert isinstance(out, RunnerOutput) and out.num_encoded_items == 1
        assert out.sampled_token_ids == prompt.reference[:1]

        router.send_multipart([identity, encode(SchedulerOutput(1, [], {"nope": 1}, [], [], []))])
        err = decode_worker_outbound(router.recv_multipart()[1])
        assert isinstance(err, WorkerError) and err.step_id == 1 and "nope" in err.message

        router.send_multipart([identity, encode(SchedulerOutput(2, [], {"r": 1}, [], [], []))])
        out = decode_worker_outbound(router.recv_multipart()[1])  # still serving after the error
        assert isinstance(out, RunnerOutput) and out.sampled_token_ids == prompt.reference[1:2]
    finally:
        router.send_multipart([identity, encode(WorkerShutdown())])
        thread.join(timeout=30)
    assert not thread.is_alive()


def worker_process(model_dir: Path, addr: str, **settings: float) -> subprocess.Popen[bytes]:
    """``run_worker`` in a process of its own, exiting with its status."""
    extra = "".join(f", {name}={value!r}" for name, value in settings.items())
    code = (
        "import sys; from app.settings import Settings; "
        "from app.launch.process_configs import worker_config; "
        "from workers.worker_main import run_worker; "
        f"settings = Settings(model={str(model_dir)!r}, worker_addr={addr!r}, device='cpu'{extra}); "
        "sys.exit(run_worker(worker_config(settings)))"
    )
    repo_root = Path(__file__).resolve().parents[2]
    env = os.environ | {"PYTHONPATH": str(repo_root)}
    return subprocess.Popen([sys.executable, "-c", code], cwd=repo_root, env=env)


def test_worker_process_stops_on_sigterm_after_its_shutdown_timeout(router, tiny_model_dir):
    """SIGTERM lets the worker serve on (the engine is draining) until WorkerShutdown or, as here, its
    shutdown timeout; then it exits 0."""
    router, addr = router
    # a shutdown timeout that outlasts the 1 s look below, even on a busy machine
    proc = worker_process(tiny_model_dir, addr, shutdown_timeout=5.0)
    try:
        assert router.poll(120_000), "no WorkerReady"
        assert isinstance(decode_worker_outbound(router.recv_multipart()[1]), WorkerReady)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert proc.poll() is None, "still serving within its shutdown timeout"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_worker_process_exits_when_its_engine_goes_away(tmp_path, tiny_model_dir):
    """A dead engine's worker holds that engine's KV and encoder outputs: it exits with ENGINE_LOST so
    that a new one (started by serve or the compose restart policy) meets the new engine."""
    ctx = zmq.Context()
    engine = ctx.socket(zmq.ROUTER)
    addr = f"ipc://{tmp_path}/lost.sock"
    engine.bind(addr)
    proc = worker_process(tiny_model_dir, addr)
    try:
        assert engine.poll(120_000), "no WorkerReady"
        assert isinstance(decode_worker_outbound(engine.recv_multipart()[1]), WorkerReady)
        engine.close(linger=0)
        assert proc.wait(timeout=30) == ENGINE_LOST
    finally:
        if proc.poll() is None:
            proc.kill()
        ctx.term()
