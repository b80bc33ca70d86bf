"""What ``EngineCore`` needs from whatever runs its steps: the worker client, or a test double.

``send`` hands a step over without waiting, so the engine can publish the previous step's outputs and
read its inbox while the worker computes; ``wait`` then returns that step's ``RunnerOutput`` or raises
(``send`` raises ``WorkerLost`` only):

- ``WorkerFailed``: this step did not complete (the worker answered ``WorkerError``, or did not answer
  in time). The worker is still there; the engine fails the step's requests and rolls back what the
  step would have written (docs/architecture.md, "Engine step").
- ``WorkerLost`` (a ``WorkerFailed``): the worker's connection closed (its process died) or another
  worker took its place. Nothing it held survives: the engine fails every request and waits for a new
  worker with a fresh ``EngineCore``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from wire.protocol import RunnerOutput, SchedulerOutput


class WorkerFailed(RuntimeError):
    """The worker did not complete a step; it may still serve the next one. ``unavailable_mm_hashes``:
    it could neither load these encoder outputs from the store nor encode them (503, not 500)."""

    def __init__(self, message: str, unavailable_mm_hashes: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.unavailable_mm_hashes = list(unavailable_mm_hashes)


class WorkerLost(WorkerFailed):
    """The worker is gone (process died, connection closed, replaced by a new worker)."""


class Executor(Protocol):
    def send(self, sched: SchedulerOutput, frames: Sequence[memoryview]) -> None: ...

    def wait(self, step_id: int) -> RunnerOutput: ...
