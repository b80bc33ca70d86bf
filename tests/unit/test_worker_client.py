"""WorkerClient over real ZeroMQ sockets, against stand-in workers that follow the protocol (DEALER
peers in threads, or in a child process where it must die by SIGKILL): replies matched by step id
(late ones discarded), errors, and a lost worker noticed at once through the socket monitor."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from engine.executor import WorkerFailed, WorkerLost
from engine.protocol import (
    UNDECODABLE_STEP_ID,
    RunnerOutput,
    SchedulerOutput,
    WorkerError,
    WorkerReady,
    decode_worker_inbound,
    encode,
)
from engine.worker_client import WorkerClient

READY = WorkerReady(device="cpu", dtype="float32", num_kv_blocks=8, block_size=16)
REPO = Path(__file__).resolve().parents[2]


def step(step_id: int) -> SchedulerOutput:
    return SchedulerOutput(step_id, [], {}, [], [], [])


def output(step_id: int) -> RunnerOutput:
    return RunnerOutput(step_id, [], [], [], 0, 0.0, 0.0)


Reply = Callable[[SchedulerOutput], tuple[float, RunnerOutput | WorkerError] | None]


class Peer:
    """A worker stand-in in a thread: says WorkerReady, then answers each step with ``reply(sched)``
    = (delay in seconds, message), or closes its socket when that returns None."""

    def __init__(self, addr: str, reply: Reply) -> None:
        self.addr, self.reply = addr, reply
        self.received: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.addr)
        sock.send(encode(READY))
        try:
            while not self.stop.is_set():
                if not sock.poll(20):
                    continue
                msg = decode_worker_inbound(sock.recv_multipart()[0])
                assert isinstance(msg, SchedulerOutput)
                self.received.append(msg.step_id)
                answer = self.reply(msg)
                if answer is None:
                    return
                delay, reply = answer
                time.sleep(delay)
                sock.send(encode(reply))
        finally:
            sock.close(linger=0)
            ctx.term()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


@pytest.fixture(params=["ipc", "tcp"])
def client(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[WorkerClient, str]]:
    """A client with a 0.3 s step timeout, bound on ipc:// or tcp://; yields (client, address)."""
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/worker.sock" if request.param == "ipc" else "tcp://127.0.0.1:*"
    client = WorkerClient(ctx, addr, step_timeout_s=0.3)
    yield client, client.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    client.shutdown()
    ctx.term()


@contextlib.contextmanager
def peer(addr: str, reply: Reply) -> Iterator[Peer]:
    p = Peer(addr, reply)
    try:
        yield p
    finally:
        p.close()


def prompt(sched: SchedulerOutput) -> tuple[float, RunnerOutput | WorkerError]:
    return 0.0, output(sched.step_id)


def test_ready_then_steps_answered_in_order(client: tuple[WorkerClient, str]) -> None:
    c, addr = client
    with peer(addr, prompt):
        assert c.poll_ready(timeout_s=5) == READY and c.has_worker
        assert c.execute(step(1), []) == output(1)
        assert c.execute(step(2), []) == output(2)
        c.check()  # idle, all well
        assert c.num_stale_replies == 0


def test_a_late_reply_is_discarded_by_step_id(client: tuple[WorkerClient, str]) -> None:
    c, addr = client

    def slow_first(sched: SchedulerOutput) -> tuple[float, RunnerOutput]:
        return (0.6 if sched.step_id == 1 else 0.0), output(sched.step_id)

    with peer(addr, slow_first):
        assert c.poll_ready(timeout_s=5) is not None
        with pytest.raises(WorkerFailed, match="did not answer step 1") as failed:
            c.execute(step(1), [])
        assert not isinstance(failed.value, WorkerLost)
        c.step_timeout_s = 5.0
        assert c.execute(step(2), []) == output(2)  # step 1's answer came first and was dropped
        assert c.execute(step(3), []) == output(3)
        assert c.num_stale_replies == 1


def test_a_late_reply_arriving_while_idle_is_discarded(client: tuple[WorkerClient, str]) -> None:
    c, addr = client

    def slow(sched: SchedulerOutput) -> tuple[float, RunnerOutput]:
        return (0.5 if sched.step_id == 1 else 0.0), output(sched.step_id)

    with peer(addr, slow):
        assert c.poll_ready(timeout_s=5) is not None
        with pytest.raises(WorkerFailed):
            c.execute(step(1), [])
        deadline = time.monotonic() + 5
        while c.num_stale_replies == 0 and time.monotonic() < deadline:
            c.check()
            time.sleep(0.01)
        assert c.num_stale_replies == 1
        assert c.execute(step(2), []) == output(2)


def test_worker_errors_are_matched_by_step_id_too(client: tuple[WorkerClient, str]) -> None:
    c, addr = client

    def errors(sched: SchedulerOutput) -> tuple[float, WorkerError]:
        if sched.step_id == 1:
            return 0.5, WorkerError(1, "late error")
        if sched.step_id == 2:
            return 0.0, WorkerError(2, "boom")
        return 0.0, WorkerError(UNDECODABLE_STEP_ID, "undecodable message")

    with peer(addr, errors):
        assert c.poll_ready(timeout_s=5) is not None
        with pytest.raises(WorkerFailed, match="did not answer"):
            c.execute(step(1), [])
        c.step_timeout_s = 5.0
        with pytest.raises(WorkerFailed, match="failed step 2: boom"):
            c.execute(step(2), [])
        assert c.num_stale_replies == 1
        with pytest.raises(WorkerFailed, match="failed step 3: undecodable"):
            c.execute(step(3), [])


def test_a_reply_to_a_future_step_is_a_protocol_error(client: tuple[WorkerClient, str]) -> None:
    c, addr = client
    with peer(addr, lambda sched: (0.0, output(sched.step_id + 1))):
        assert c.poll_ready(timeout_s=5) is not None
        with pytest.raises(WorkerFailed, match="answered step 2 while step 1"):
            c.execute(step(1), [])


def test_a_closed_connection_during_a_step_is_a_lost_worker(client: tuple[WorkerClient, str]) -> None:
    c, addr = client
    with peer(addr, lambda sched: None if sched.step_id == 2 else prompt(sched)) as p:
        assert c.poll_ready(timeout_s=5) is not None
        c.execute(step(1), [])
        c.step_timeout_s = 30.0
        start = time.monotonic()
        with pytest.raises(WorkerLost, match="connection closed"):
            c.execute(step(2), [])
        assert time.monotonic() - start < 2.0 and p.received == [1, 2]
    with pytest.raises(WorkerLost):  # until the engine handled it
        c.check()
    c.forget_worker()
    assert not c.has_worker


def test_a_new_workers_ready_replaces_the_current_one(client: tuple[WorkerClient, str]) -> None:
    c, addr = client
    with peer(addr, prompt) as old:
        assert c.poll_ready(timeout_s=5) is not None
        with peer(addr, lambda sched: (0.0, output(100 + sched.step_id))) as new:
            deadline = time.monotonic() + 5
            with pytest.raises(WorkerLost, match="another worker connected"):
                while time.monotonic() < deadline:
                    c.check()
                    time.sleep(0.01)
            c.forget_worker()
            assert c.poll_ready(timeout_s=0) == READY  # the new worker's, kept for this call
            with pytest.raises(WorkerFailed, match="answered step 101"):
                c.execute(step(1), [])  # went to the new peer (which answers 100 + step id)
            assert new.received == [1] and old.received == []


PEER_PROCESS = """
import sys, time, zmq
from engine.protocol import WorkerReady, encode
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(sys.argv[1])
sock.send(encode(WorkerReady(device="cpu", dtype="float32")))
sock.recv_multipart()  # the first step, never answered
print("got a step", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("busy", [True, False], ids=["during-a-step", "idle"])
def test_a_sigkilled_worker_process_is_lost_at_once(client: tuple[WorkerClient, str], busy: bool) -> None:
    c, addr = client
    c.step_timeout_s = 60.0
    proc = subprocess.Popen(
        [sys.executable, "-c", PEER_PROCESS, addr], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert c.poll_ready(timeout_s=30) is not None
        if busy:
            killer = threading.Timer(0.3, proc.send_signal, args=(signal.SIGKILL,))
            killer.start()
            start = time.monotonic()
            with pytest.raises(WorkerLost):
                c.execute(step(1), [])
            elapsed = time.monotonic() - start - 0.3
            killer.join()
        else:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            start = time.monotonic()
            with pytest.raises(WorkerLost):
                while time.monotonic() - start < 5:
                    c.check()
                    time.sleep(0.01)
            elapsed = time.monotonic() - start
        assert elapsed < 1.0, f"the loss was noticed after {elapsed:.2f}s"
    finally:
        proc.kill()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
