"""A process stopped (SIGSTOP) for a block and continued after: a test holds what that process would do
(a worker's next step, a store's answer) for as long as it needs, however fast or slow the machine."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def paused(pid: int, timeout_s: float = 5.0) -> Iterator[None]:
    """``pid`` stopped for the block, continued after (also when the block fails). Waits until every
    thread of it is stopped: the signal is delivered asynchronously, and work that arrives first is still
    done."""
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout_s
        while not all_threads_stopped(pid):
            assert time.monotonic() < deadline, f"pid {pid} did not stop"
            time.sleep(0.005)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def all_threads_stopped(pid: int) -> bool:
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError):  # a thread that just exited
            states.append(stat.read_text().rpartition(")")[2].split()[0])
    return bool(states) and all(state in ("T", "t") for state in states)
