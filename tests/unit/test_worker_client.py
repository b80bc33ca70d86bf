"""WorkerClient over real ZeroMQ sockets, against the stand-in worker (tests/standin_worker.py) serving
in a thread, or in a child process where it must die by SIGKILL: replies matched by step id (late ones
discarded), errors, and a lost worker noticed at once through the socket monitor."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from engine.executor import WorkerFailed, WorkerLost
from engine.worker_client import WorkerClient
from tests.standin_worker import StandinWorker
from tests.standin_worker_process import serving
from wire.protocol import RunnerOutput, SchedulerOutput, WorkerReady, encode

REPO = Path(__file__).resolve().parents[2]


def step(step_id: int) -> SchedulerOutput:
    """A step with nothing to run (the stand-in answers it with an empty RunnerOutput)."""
    return SchedulerOutput(step_id, [], {}, [], [], [])


# The step timeout of the tests of it: the stand-in holds the answer it must miss until the client gave
# up on it (``held``), so a busy machine cannot make it come in time.
SHORT_TIMEOUT_S = 0.3
# The step timeout an answered step meets even on a busy machine.
ANSWERED_TIMEOUT_S = 5.0


def output(step_id: int) -> RunnerOutput:
    return RunnerOutput(step_id, [], [], [], 0, 0.0, 0.0)


@pytest.fixture(params=["ipc", "tcp"])
def client(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[WorkerClient, str]]:
    """A client bound on ipc:// or tcp://; yields (client, address). Its step timeout is
    ``ANSWERED_TIMEOUT_S``; a test of the timeout sets ``SHORT_TIMEOUT_S``."""
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/worker.sock" if request.param == "ipc" else "tcp://127.0.0.1:*"
    client = WorkerClient(ctx, addr, step_timeout_s=ANSWERED_TIMEOUT_S)
    yield client, client.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    client.shutdown()
    ctx.term()


def test_ready_then_steps_answered_in_order(client: tuple[WorkerClient, str]) -> None:
    c, addr = client
    with serving(StandinWorker(num_kv_blocks=8), addr) as worker:
        assert c.poll_ready(timeout_s=5) == worker.ready and c.worker_id is not None
        assert c.execute(step(1), []) == output(1)
        assert c.execute(step(2), []) == output(2)
        c.check()  # idle, all well
        assert c.num_stale_replies == 0 and worker.errors == []


def test_two_steps_in_flight_are_answered_in_order(client: tuple[WorkerClient, str]) -> None:
    """Scheduling ahead: step 2 is sent before step 1 is awaited, and step 2's reply, read while step 1
    was awaited (or while sending step 3), is kept for its own wait, not discarded. An undecodable
    reply counts as the oldest unanswered step's."""
    c, addr = client
    with serving(StandinWorker(delay_s={1: 0.2}, undecodable_steps={3}), addr):
        assert c.poll_ready(timeout_s=5) is not None
        c.send(step(1), [])
        c.send(step(2), [])
        assert c.wait(1).step_id == 1
        deadline = time.monotonic() + 5
        while 2 not in c._answers and time.monotonic() < deadline:  # step 2's reply is read early
            c.check()
            time.sleep(0.01)
        c.send(step(3), [])
        c.send(step(4), [])
        assert c.wait(2) == output(2)
        with pytest.raises(WorkerFailed, match="reply to step 3: undecodable|failed step 3: undecodable"):
            c.wait(3)
        assert c.wait(4) == output(4)
        assert c.num_stale_replies == 0


def test_a_late_reply_is_discarded_by_step_id(client: tuple[WorkerClient, str]) -> None:
    c, addr = client
    release = threading.Event()
    with serving(StandinWorker(held={1: release}), addr):
        assert c.poll_ready(timeout_s=5) is not None
        c.step_timeout_s = SHORT_TIMEOUT_S
        with pytest.raises(WorkerFailed, match="did not answer step 1") as failed:
            c.execute(step(1), [])
        assert not isinstance(failed.value, WorkerLost)
        release.set()
        c.step_timeout_s = ANSWERED_TIMEOUT_S
        assert c.execute(step(2), []) == output(2)  # step 1's answer came first and was dropped
        assert c.execute(step(3), []) == output(3)
        assert c.num_stale_replies == 1


def test_a_late_reply_arriving_while_idle_is_discarded(client: tuple[WorkerClient, str]) -> None:
    c, addr = client
    release = threading.Event()
    with serving(StandinWorker(held={1: release}), addr):
        assert c.poll_ready(timeout_s=5) is not None
        c.step_timeout_s = SHORT_TIMEOUT_S
        with pytest.raises(WorkerFailed):
            c.execute(step(1), [])
        release.set()
        c.step_timeout_s = ANSWERED_TIMEOUT_S
        deadline = time.monotonic() + 5
        while c.num_stale_replies == 0 and time.monotonic() < deadline:
            c.check()
            time.sleep(0.01)
        assert c.num_stale_replies == 1
        assert c.execute(step(2), []) == output(2)


def test_worker_errors_are_matched_by_step_id_too(client: tuple[WorkerClient, str]) -> None:
    c, addr = client
    release = threading.Event()
    worker = StandinWorker(fail_steps={1: "late error", 2: "boom"}, held={1: release}, undecodable_steps={3})
    with serving(worker, addr):
        assert c.poll_ready(timeout_s=5) is not None
        c.step_timeout_s = SHORT_TIMEOUT_S
        with pytest.raises(WorkerFailed, match="did not answer"):
            c.execute(step(1), [])
        release.set()
        c.step_timeout_s = ANSWERED_TIMEOUT_S
        with pytest.raises(WorkerFailed, match="failed step 2: boom"):
            c.execute(step(2), [])
        assert c.num_stale_replies == 1
        with pytest.raises(WorkerFailed, match="failed step 3: undecodable"):
            c.execute(step(3), [])


def test_a_step_the_worker_refuses_is_a_failed_step(client: tuple[WorkerClient, str]) -> None:
    c, addr = client
    with serving(StandinWorker(), addr) as worker:
        assert c.poll_ready(timeout_s=5) is not None
        with pytest.raises(WorkerFailed, match="StepError: request 'nope' is scheduled but unknown"):
            c.execute(SchedulerOutput(1, [], {"nope": 1}, [], [], []), [])
        assert c.execute(step(2), []) == output(2)  # still serving after the error
        assert len(worker.errors) == 1


def wait_counted(c: WorkerClient, counts: dict[str, int]) -> None:
    """Until ``c`` counted these bad messages: a reply that came after a step's timeout is read later."""
    deadline = time.monotonic() + 5
    while c.bad_messages.counts != counts and time.monotonic() < deadline:
        c.check()
        time.sleep(0.01)
    assert c.bad_messages.counts == counts


def test_a_reply_to_a_future_step_is_a_bad_message(client: tuple[WorkerClient, str]) -> None:
    """Dropped and counted: the step awaited then times out as one never answered."""
    c, addr = client
    with serving(StandinWorker(misnumber_replies=1), addr):
        assert c.poll_ready(timeout_s=5) is not None
        c.step_timeout_s = SHORT_TIMEOUT_S
        with pytest.raises(WorkerFailed, match="did not answer step 1"):
            c.execute(step(1), [])
        wait_counted(c, {"worker": 1})  # the misnumbered reply, read then or since
        assert c.num_stale_replies == 0


def test_a_closed_connection_during_a_step_is_a_lost_worker(client: tuple[WorkerClient, str]) -> None:
    c, addr = client
    with serving(StandinWorker(lose_steps={2}), addr) as worker:
        assert c.poll_ready(timeout_s=5) is not None
        c.execute(step(1), [])
        c.step_timeout_s = 30.0
        start = time.monotonic()
        with pytest.raises(WorkerLost, match="connection closed"):
            c.execute(step(2), [])
        assert time.monotonic() - start < 5.0 and worker.received_step_ids == [1, 2]  # not the 30 s
    with pytest.raises(WorkerLost):  # until the engine handled it
        c.check()
    c.forget_worker()
    assert c.worker_id is None


def test_a_new_workers_ready_replaces_the_current_one(client: tuple[WorkerClient, str]) -> None:
    c, addr = client
    with serving(StandinWorker(), addr) as old:
        assert c.poll_ready(timeout_s=5) is not None
        with serving(StandinWorker(num_kv_blocks=8, misnumber_replies=100), addr) as new:
            deadline = time.monotonic() + 5
            with pytest.raises(WorkerLost, match="another worker connected"):
                while time.monotonic() < deadline:
                    c.check()
                    time.sleep(0.01)
            c.forget_worker()
            assert c.poll_ready(timeout_s=0) == new.ready  # the new worker's, kept for this call
            c.step_timeout_s = SHORT_TIMEOUT_S
            with pytest.raises(WorkerFailed, match="did not answer step 1"):
                c.execute(step(1), [])  # went to the new worker (which answers 100 + step id)
            assert new.received_step_ids == [1] and old.received_step_ids == []
            wait_counted(c, {"worker": 1})  # its reply to "step 101", dropped


@pytest.mark.parametrize("busy", [True, False], ids=["during-a-step", "idle"])
def test_a_sigkilled_worker_process_is_lost_at_once(client: tuple[WorkerClient, str], busy: bool) -> None:
    c, addr = client
    c.step_timeout_s = 60.0
    # the stand-in in a process of its own, which never answers step 1
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.standin_worker_process", addr, "--drop-replies", "1"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
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
        # far below the 60 s step timeout: heard from the connection, even on a busy machine
        assert elapsed < 5.0, f"the loss was noticed after {elapsed:.2f}s"
    finally:
        proc.kill()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()


def test_bad_replies_are_counted_and_dropped_unless_they_answer_the_step(
    client: tuple[WorkerClient, str],
) -> None:
    """A second WorkerReady, garbage and extra frames while idle: counted, dropped, the worker kept.
    Garbage from the worker while a step is awaited is that step's reply: the step fails."""
    c, addr = client
    ctx = zmq.Context.instance()
    worker = ctx.socket(zmq.DEALER)
    worker.setsockopt(zmq.LINGER, 0)
    worker.connect(addr)
    try:
        ready = WorkerReady("cpu", "float32", 8, 16)
        worker.send(encode(ready))
        assert c.poll_ready(timeout_s=5) == ready
        worker.send(encode(ready))
        worker.send(b"\xc1")
        worker.send_multipart([encode(output(0)), b"extra"])
        deadline = time.monotonic() + 5
        while sum(c.bad_messages.counts.values()) < 3 and time.monotonic() < deadline:
            c.check()
            time.sleep(0.01)
        assert c.bad_messages.counts == {"worker": 3} and c.worker_id is not None
        c.send(step(1), [])
        assert worker.poll(5000)
        worker.recv_multipart()
        worker.send(b"garbage")
        with pytest.raises(WorkerFailed, match="reply to step 1"):
            c.wait(1)
        assert c.bad_messages.counts == {"worker": 4}
    finally:
        worker.close(linger=0)
