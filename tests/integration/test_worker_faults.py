"""A real engine process and real worker processes (``mmserve engine`` / ``mmserve worker`` on the tiny
LLaVA checkpoint, CPU), with this test as the API process: the worker is SIGKILLed mid-stream; the
request fails with 503 at once, the engine lives on, refuses work and stays unready until a new
worker connects, then announces a fresh epoch and answers as before the kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tests.api_peer import ApiPeer, tokens
from tests.integration.fake_engine import Prompt
from tests.integration.runner_support import greedy
from tests.paused import paused
from wire.protocol import (
    AddRequest,
    Drain,
    RequestOutput,
    SamplingParams,
    Shutdown,
    encode,
)
from workers.frames import tensor_to_frame

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# Far below the step timeout (600 s): a loss noticed sooner was heard from the connection, even on a
# machine busy with other tests.
LOSS_DEADLINE_S = 15.0
# A held request outlasts what a drain test does meanwhile, even on a busy machine (about 2 s alone).
HELD_TOKENS = 1500


class Role:
    """``python -m app.launch.cli ROLE ...`` with its output in a log file."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "app.launch.cli", *args],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


class Api(ApiPeer):
    def submit(self, req_id: str, prompt: Prompt, sampling: SamplingParams) -> None:
        """With the image's pixels (store=True), as after a mirror miss."""
        frames, features = [], []
        for feature, item in zip(prompt.features, prompt.items, strict=True):
            ref, buf = tensor_to_frame(item["pixel_values"], frame=len(frames) + 1)
            frames.append(buf)
            features.append(msgspec.structs.replace(feature, tensors={"pixel_values": ref}, store=True))
        msg = AddRequest(req_id, prompt.input_ids, sampling, mm_features=features)
        self.sock.send_multipart([encode(msg), *frames])

    def outputs(
        self, req_id: str, timeout_s: float, *, until_tokens: int | None = None
    ) -> list[RequestOutput]:
        """All of the request's outputs so far, once it finished (or has ``until_tokens`` tokens)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.received.get(req_id, [])
            if got and got[-1].finish_reason is not None:
                return got
            if until_tokens is not None and len(tokens(got)) >= until_tokens:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"{req_id}: no end within {timeout_s}s: {got}")
            self.recv(0.05)


@pytest.fixture
def roles(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[Api, list[Role], list[str]]]:
    """The engine, a way to start workers, and the test's API socket."""
    engine_addr, worker_addr = f"ipc://{tmp_path}/engine.sock", f"ipc://{tmp_path}/worker.sock"
    common = ["--model", str(tiny_model_dir), "--worker-addr", worker_addr, "--log-level", "info"]
    engine = Role(["engine", *common, "--engine-addr", engine_addr], tmp_path / "engine.log")
    started = [engine]
    worker_args = ["worker", *common, "--device", "cpu", "--kv-cache-tokens", "8192"]
    api = Api(engine_addr)
    try:
        yield api, started, worker_args
    finally:
        api.close()
        for role in started:
            role.stop()


def test_sigkilled_worker_fails_its_requests_and_a_new_worker_serves_a_fresh_epoch(
    roles: tuple[Api, list[Role], list[str]], tmp_path: Path, prompts: dict[str, Prompt], hf_model: object
) -> None:
    api, started, worker_args = roles
    engine = started[0]
    worker = Role(worker_args, tmp_path / "worker-1.log")
    started.append(worker)
    first = api.wait_ready(180)
    assert first is not None, engine.log() + worker.log()

    prompt = prompts["one"]
    api.submit("before", prompt, greedy(hf_model))
    before = tokens(api.outputs("before", 120))
    assert len(before) == 32

    endless = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    api.submit("endless", prompts["text"], endless)
    streamed = len(api.outputs("endless", 120, until_tokens=3))

    worker.proc.kill()
    killed = time.monotonic()
    rest = api.outputs("endless", LOSS_DEADLINE_S)[streamed:]
    noticed_s = time.monotonic() - killed
    error = rest[-1].error
    assert error is not None and (error.code, error.http_status) == ("worker_unavailable", 503), rest[-1]
    assert noticed_s < LOSS_DEADLINE_S
    deadline = time.monotonic() + LOSS_DEADLINE_S
    while not api.dead and time.monotonic() < deadline:
        api.recv(0.1)
    assert api.dead and "worker" in api.dead[0].reason

    # no worker: unready (Hello unanswered), new requests refused at once, the engine alive
    assert api.wait_ready(1.5) is None
    api.submit("meanwhile", prompt, greedy(hf_model))
    start = time.monotonic()
    [refused] = api.outputs("meanwhile", 5)
    assert refused.error is not None and refused.error.code == "worker_unavailable"
    assert refused.error.http_status == 503 and time.monotonic() - start < 5.0  # not queued for a worker
    assert engine.proc.poll() is None, engine.log()

    started.append(Role(worker_args, tmp_path / "worker-2.log"))
    second = api.wait_ready(180)
    assert second is not None, engine.log() + started[-1].log()
    assert second.epoch != first.epoch

    api.submit("after", prompt, greedy(hf_model))
    after = api.outputs("after", 120)
    assert tokens(after) == before
    assert after[0].num_cached_tokens == 0  # a fresh prefix cache
    assert api.stats is not None and api.stats.counters["worker_losses_total"] == 1

    api.sock.send(encode(Shutdown()))
    assert engine.proc.wait(30) == 0, engine.log()
    assert started[-1].proc.wait(30) == 0, started[-1].log()  # the engine told it to stop


def test_drain_refuses_new_requests_and_shutdown_waits_for_the_held_ones(
    roles: tuple[Api, list[Role], list[str]], tmp_path: Path, prompts: dict[str, Prompt], hf_model: object
) -> None:
    api, started, worker_args = roles
    engine = started[0]
    started.append(Role(worker_args, tmp_path / "worker.log"))
    assert api.wait_ready(180) is not None, engine.log() + started[-1].log()
    long = SamplingParams(max_tokens=HELD_TOKENS, temperature=0.0, ignore_eos=True)
    api.submit("held", prompts["text"], long)
    api.outputs("held", 120, until_tokens=1)

    api.sock.send(encode(Drain()))
    api.submit("new", prompts["one"], greedy(hf_model))
    api.sock.send(encode(Shutdown()))
    [refused] = api.outputs("new", 10)
    assert refused.error is not None
    assert (refused.error.code, refused.error.http_status) == ("server_shutting_down", 503)
    assert api.received["held"][-1].finish_reason is None and engine.proc.poll() is None  # still at it
    held = api.outputs("held", 120)
    assert len(tokens(held)) == HELD_TOKENS and held[-1].finish_reason == "length" and held[-1].error is None
    assert engine.proc.wait(30) == 0, engine.log()
    assert started[-1].proc.wait(30) == 0


def test_sigterm_to_engine_and_worker_together_drains_like_compose_stop(
    roles: tuple[Api, list[Role], list[str]], tmp_path: Path, prompts: dict[str, Prompt], hf_model: object
) -> None:
    """``docker compose stop`` SIGTERMs every service at once: the engine drains (new requests 503,
    held ones finish), the worker serves on until the engine's WorkerShutdown; both exit 0."""
    api, started, worker_args = roles
    engine = started[0]
    worker = Role(worker_args, tmp_path / "worker.log")
    started.append(worker)
    assert api.wait_ready(180) is not None, engine.log() + worker.log()
    long = SamplingParams(max_tokens=HELD_TOKENS, temperature=0.0, ignore_eos=True)
    api.submit("held", prompts["text"], long)
    api.outputs("held", 120, until_tokens=1)

    # the worker paused until the new request was sent: the held one cannot end (and the engine stop)
    # before it arrives, however slow the machine
    with paused(worker.proc.pid):
        engine.proc.send_signal(signal.SIGTERM)
        worker.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30  # until the engine took the signal in
        while "draining: new requests are refused" not in engine.log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline, engine.log()
            time.sleep(0.05)
        api.submit("new", prompts["one"], greedy(hf_model))
    [refused] = api.outputs("new", 10)
    assert refused.error is not None and refused.error.code == "server_shutting_down"
    held = api.outputs("held", 120)
    assert len(tokens(held)) == HELD_TOKENS and held[-1].finish_reason == "length" and held[-1].error is None
    assert engine.proc.wait(30) == 0, engine.log()
    assert worker.proc.wait(30) == 0, worker.log()
