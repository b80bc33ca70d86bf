"""No message can kill a process (docs/architecture.md, "Bad messages"), and CURVE keeps keyless peers
off the TCP sockets: the compose topology as processes (engine, worker, API, each its own role, over
tcp:// on loopback with the deployment's CURVE key), with relays (tests/e2e/zmq_relay.py) between the API
and the engine and between the worker and the engine, through which the test speaks as either peer.

Garbage of every kind on every socket leaves each process with its PID and the same greedy answer, and
moves ``mmserve_bad_messages_total{process,source}`` by exactly what was sent."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from app.launch.cli import main
from tests.e2e.conftest import greedy_body, make_image, user_message
from tests.e2e.metrics import parse_metrics
from tests.e2e.server import ServerProcess, free_port, wait_healthy
from tests.e2e.zmq_relay import Relay
from wire.curve import CurveKeys, secure_client, write_key_file
from wire.protocol import (
    AddRequest,
    EngineOutputs,
    Hello,
    MMFeature,
    RequestOutput,
    RunnerOutput,
    SamplingParams,
    Shutdown,
    TensorRef,
    WorkerReady,
    WorkerShutdown,
    decode_engine_outbound,
    encode,
)

pytestmark = pytest.mark.slow

NUM_KINDS = 5  # garbage() below
PAIRS = (
    ("engine", "api"),
    ("engine", "worker"),
    ("worker", "engine"),
    ("api", "engine"),
)  # (process, source)


def garbage(valid: msgspec.Struct, seed: int) -> dict[str, list[bytes]]:
    """The kinds of garbage, each a multipart message, around one valid message of the socket's union."""
    rng = random.Random(seed)
    encoded = encode(valid)
    return {
        "random bytes": [rng.randbytes(64)],
        "truncated msgpack": [encoded[: len(encoded) // 2]],
        "valid msgpack of an unknown type": [msgspec.msgpack.encode({"type": "nonsense", "value": 1})],
        "an extra frame": [encoded, b"extra"],
        "an empty frame": [b""],
    }


@dataclass
class Topology:
    keys: CurveKeys
    key_file: Path
    engine_addr: str  # the engine's API socket
    worker_addr: str  # the engine's worker socket
    processes: dict[str, ServerProcess]
    api_relay: Relay
    worker_relay: Relay
    base_url: str

    def pids(self) -> dict[str, int]:
        pids = {}
        for role, process in self.processes.items():
            assert process.proc is not None and process.proc.poll() is None, process.log()[-3000:]
            pids[role] = process.proc.pid
        return pids

    def bad_messages(self) -> dict[tuple[str, str], float]:
        metrics = parse_metrics(httpx.get(f"{self.base_url}/metrics").text)
        return {
            (process, source): metrics[f'mmserve_bad_messages_total{{process="{process}",source="{source}"}}']
            for process, source in (
                ("engine", "api"),
                ("engine", "worker"),
                ("worker", "engine"),
                ("api", "engine"),
            )
        }


@pytest.fixture(scope="module")
def topology(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    folder = tmp_path_factory.mktemp("bad-messages")
    key_file = folder / "curve.key"
    keys = write_key_file(key_file)
    engine_port, worker_port, api_front, worker_front, http_port = (free_port() for _ in range(5))
    engine_addr, worker_addr = f"tcp://127.0.0.1:{engine_port}", f"tcp://127.0.0.1:{worker_port}"
    common = ["--model", str(tiny_model_dir), "--curve-key-file", str(key_file), "--max-model-len", "2048"]
    processes: dict[str, ServerProcess] = {}
    relays: list[Relay] = []
    try:
        processes["engine"] = ServerProcess(
            ["engine", *common, "--engine-addr", engine_addr, "--worker-addr", worker_addr],
            folder / "engine.log",
        ).start()
        relays.append(Relay(f"tcp://127.0.0.1:{api_front}", engine_addr, keys))
        relays.append(Relay(f"tcp://127.0.0.1:{worker_front}", worker_addr, keys))
        processes["worker"] = ServerProcess(
            ["worker", *common, "--worker-addr", f"tcp://127.0.0.1:{worker_front}"], folder / "worker.log"
        ).start()
        processes["api"] = ServerProcess(
            ["api", *common, "--engine-addr", f"tcp://127.0.0.1:{api_front}", "--port", str(http_port)],
            folder / "api.log",
        ).start()
        base_url = f"http://127.0.0.1:{http_port}"
        wait_healthy(base_url, processes["api"])
        yield Topology(keys, key_file, engine_addr, worker_addr, processes, relays[0], relays[1], base_url)
    finally:
        for process in processes.values():
            process.kill()
        for relay in relays:
            relay.close()


def answer(topology: Topology) -> list[int]:
    body = greedy_body([user_message("What is here?", make_image(7))], max_tokens=6, logprobs=True)
    resp = httpx.post(f"{topology.base_url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["logprobs"]["content"]
    return [entry["token"] for entry in content]


def wait_for_counts(topology: Topology, expected: dict[tuple[str, str], float], answered: list[int]) -> None:
    """Until the counts are ``expected``: they travel with the engine's stats after a step (the worker's in
    its step replies), so each try asks for another answer, which must be ``answered`` again."""
    deadline = time.monotonic() + 60
    while (counts := topology.bad_messages()) != expected:
        assert time.monotonic() < deadline, counts
        assert answer(topology) == answered
        time.sleep(0.2)


def test_garbage_on_every_socket_changes_no_pid_and_no_answer(topology: Topology) -> None:
    before_answer = answer(topology)
    pids = topology.pids()
    before = topology.bad_messages()
    api_id = next(p for p in topology.api_relay.peers if p.startswith(b"api-"))
    worker_id = topology.worker_relay.peers[0]

    # the engine's API socket, from an API process
    for frames in garbage(Hello(), seed=1).values():
        topology.api_relay.to_back(api_id, frames)
    # the engine's worker socket, from the worker (no step in flight)
    for frames in garbage(RunnerOutput(0, [], [], [], 0, 0.0, 0.0), seed=2).values():
        topology.worker_relay.to_back(worker_id, frames)
    # the worker's socket, from the engine (WorkerShutdown with an extra frame must not stop it)
    for frames in garbage(WorkerShutdown(), seed=3).values():
        topology.worker_relay.to_front(worker_id, frames)
    # the API's socket, from the engine; and an output for a request it never sent
    for frames in garbage(EngineOutputs(outputs=[]), seed=4).values():
        topology.api_relay.to_front(api_id, frames)
    topology.api_relay.to_front(api_id, [encode(EngineOutputs([RequestOutput("chatcmpl-never-sent", [5])]))])

    assert answer(topology) == before_answer  # the garbage arrives before it or during it
    assert topology.pids() == pids
    expected = {
        ("engine", "api"): before[("engine", "api")] + NUM_KINDS,
        ("engine", "worker"): before[("engine", "worker")] + NUM_KINDS,
        ("worker", "engine"): before[("worker", "engine")] + NUM_KINDS,
        ("api", "engine"): before[("api", "engine")] + NUM_KINDS + 1,
    }
    wait_for_counts(topology, expected, before_answer)
    for role in ("engine", "worker", "api"):  # once per kind, never a traceback
        log = topology.processes[role].log()
        assert "Traceback" not in log, log[-3000:]
        assert log.count("dropped a bad message") <= NUM_KINDS + 1


def connect(
    topology: Topology, addr: str, keys: CurveKeys | None, server_key: bytes | None = None
) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        secure_client(sock, keys)
        if server_key is not None:
            sock.curve_serverkey = server_key
    sock.connect(addr)
    return sock


def test_a_request_that_names_itself_gets_its_error(topology: Topology) -> None:
    """An AddRequest whose tensor frame is missing: dropped, counted, and its sender hears of its request."""
    before = topology.bad_messages()
    sock = connect(topology, topology.engine_addr, topology.keys)
    try:
        feature = MMFeature("f" * 64, 0, 4, tensors={"pixel_values": TensorRef("float32", (4,), 1)})
        msg = AddRequest("chatcmpl-bad", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2), [feature])
        sock.send_multipart([encode(msg)])  # frame 1 is missing
        assert sock.poll(10_000), "the engine did not answer"
        reply = decode_engine_outbound(sock.recv())
        assert isinstance(reply, EngineOutputs)
        [output] = reply.outputs
        assert output.req_id == "chatcmpl-bad" and output.error is not None
        assert output.error.code == "internal_error" and "missing frame" in output.error.message
    finally:
        sock.close(linger=0)
    answered = answer(topology)  # stats travel with the next step
    wait_for_counts(topology, {**before, ("engine", "api"): before[("engine", "api")] + 1}, answered)


@pytest.mark.parametrize("who", ["no key", "another key"])
def test_a_peer_without_the_key_gets_no_reply_and_cannot_stop_the_engine(
    topology: Topology, who: str
) -> None:
    before_answer, pids = answer(topology), topology.pids()
    keys = None if who == "no key" else CurveKeys(*zmq.curve_keypair())
    server_key = topology.keys.public
    to_engine = connect(topology, topology.engine_addr, keys, server_key)
    to_worker_socket = connect(topology, topology.worker_addr, keys, server_key)
    try:
        to_engine.send_multipart([encode(Hello())], zmq.NOBLOCK)
        to_engine.send_multipart([encode(Shutdown())], zmq.NOBLOCK)
        # as a new worker, it would replace the real one (every request in flight would fail)
        to_worker_socket.send_multipart([encode(WorkerReady("cpu", "float32", 8, 16))], zmq.NOBLOCK)
    except zmq.Again:
        pass  # the handshake never completed: nothing can even be queued
    try:
        assert not to_engine.poll(3000), "a peer without the deployment's key got a reply"
        assert answer(topology) == before_answer
        assert topology.pids() == pids
    finally:
        to_engine.close(linger=0)
        to_worker_socket.close(linger=0)


def run_role(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``mmserve ARGS`` (its entry point, in this process: it must refuse before starting anything)."""
    status = main(list(args))
    return status, capsys.readouterr().err


def test_an_address_other_hosts_reach_needs_the_key(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused at start-up, before any socket exists; loopback and ipc:// need no key."""
    model = ["--model", str(tiny_model_dir)]
    addrs = ["--engine-addr", "tcp://0.0.0.0:5555", "--worker-addr", f"ipc://{tmp_path}/w"]
    status, err = run_role(capsys, "engine", *model, *addrs)
    assert status == 2 and "--engine-addr tcp://0.0.0.0:5555" in err
    assert "--curve-key-file" in err and "MMSERVE_CURVE_SECRET_KEY" in err
    status, err = run_role(capsys, "api", *model, "--engine-addr", "tcp://engine:5555")
    assert status == 2 and "--engine-addr tcp://engine:5555" in err
    (tmp_path / "bad.key").write_text("not a certificate\n")
    public_only = write_key_file(tmp_path / "public.key").public.decode()
    (tmp_path / "public.key").write_text(f'metadata\ncurve\n    public-key = "{public_only}"\n')
    for key_file, problem in (("bad.key", "cannot read the CURVE key file"), ("public.key", "no secret-key")):
        key = str(tmp_path / key_file)
        status, err = run_role(
            capsys, "worker", *model, "--worker-addr", "tcp://engine:5556", "--curve-key-file", key
        )
        assert status == 2 and problem in err
