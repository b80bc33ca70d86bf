"""The order in which the scheduler takes requests (``--scheduling-policy``, docs/architecture.md,
"Scheduling policy"): ``fcfs``, by arrival, a preempted request first in line again; ``priority``, by
each request's ``priority`` (lower first, as vLLM's) and then by arrival, a preempted request back at its
place in that order. The waiting queue is a ``WaitingQueue``; the running list is kept in the same order
(``place``), so that the request last in it is the one to preempt: the most recently admitted, or the
latest of the lowest priority."""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from engine.config import SchedulingPolicy
from engine.request import Request


def order_key(request: Request) -> tuple[int, int]:
    """A request's place under ``priority``: its priority, then its arrival."""
    return request.priority, request.arrival_order


def place(requests: list[Request], request: Request, policy: SchedulingPolicy) -> None:
    """Adds ``request`` to ``requests`` (kept in the policy's order): last under ``fcfs``, at its place
    by ``order_key`` under ``priority`` (after those of equal key: none has its arrival)."""
    if policy == "priority":
        bisect.insort_right(requests, request, key=order_key)
    else:
        requests.append(request)


class WaitingQueue:
    """The requests waiting to run, in the order they are taken. A few thousand at most
    (``--max-waiting-requests``): a list, whose inserts and removals cost microseconds."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._requests: list[Request] = []

    def add(self, request: Request) -> None:
        """A new request: last in line, or last of its priority."""
        place(self._requests, request, self.policy)

    def put_back(self, request: Request) -> None:
        """A preempted request: first in line under ``fcfs``; under ``priority`` at its place, ahead of
        those of its priority that arrived after it."""
        if self.policy == "priority":
            bisect.insort_left(self._requests, request, key=order_key)
        else:
            self._requests.insert(0, request)

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request: object) -> bool:
        return request in self._requests

    def __getitem__(self, index: int) -> Request:
        return self._requests[index]
