"""``--scheduling-policy`` (engine/request_queue.py), step by step on the scheduler and its stand-in worker:
under ``priority`` waiting requests are taken by priority (lower first) then by arrival, and when KV
blocks run out the latest running request of the lowest priority is preempted, however early it was
admitted, and goes back to its place; under ``fcfs`` arrival alone decides, as before. The engine
refuses a non-zero priority under ``fcfs`` with a 400 naming the field. No processes."""

from __future__ import annotations

import random

import pytest

from engine.request import Request, RequestStatus
from engine.request_queue import WaitingQueue, order_key, place
from engine.scheduler import Scheduler
from tests.unit.engine_core_support import engine_core
from tests.unit.scheduler_support import config, make_request, run_step
from wire.protocol import AddRequest, SamplingParams

BLOCK = 16


def prioritised(req_id: str, priority: int, prompt_len: int = 20, max_tokens: int = 4) -> Request:
    request = make_request(req_id, prompt_len, max_tokens=max_tokens)
    request.priority = priority
    return request


def admission_order(s: Scheduler) -> list[str]:
    """The requests in the order they first ran, every step run until none is left."""
    order: list[str] = []
    while s.has_work:
        plan, _ = run_step(s)
        order += [r.req_id for r in plan.new_requests]
    return order


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("priority", ["urgent", "a", "b", "late", "bulk"]), ("fcfs", ["bulk", "a", "urgent", "b", "late"])],
)
def test_waiting_requests_are_taken_in_the_policys_order(policy: str, expected: list[str]) -> None:
    s = Scheduler(config(max_num_seqs=1, scheduling_policy=policy))
    for req_id, priority in [("bulk", 9), ("a", 0), ("urgent", -5), ("b", 0), ("late", 0)]:
        s.add_request(prioritised(req_id, priority if policy == "priority" else 0))
    assert admission_order(s) == expected


def test_under_priority_the_latest_of_the_lowest_priority_is_preempted_and_resumes_at_its_place() -> None:
    """6 blocks of 16: three 30-token prompts fill them; growing, one must go. Under fcfs it would be the
    last admitted ("c"); under priority it is "a", admitted first but of the lowest priority. It goes
    back after "e" (a higher priority) and before "d" (its priority, arrived later)."""
    s = Scheduler(config(block_size=BLOCK, num_kv_blocks=6, max_num_seqs=3, scheduling_policy="priority"))
    s.add_request(prioritised("a", 7, prompt_len=30, max_tokens=12))
    run_step(s)
    s.add_request(prioritised("b", 1, prompt_len=30, max_tokens=12))
    s.add_request(prioritised("c", 1, prompt_len=30, max_tokens=12))
    plan, _ = run_step(s)
    assert [r.req_id for r in plan.new_requests] == ["b", "c"]
    assert [r.req_id for r in s.running] == ["b", "c", "a"]  # the policy's order: "a" is last
    s.add_request(prioritised("d", 7, prompt_len=30, max_tokens=12))
    s.add_request(prioritised("e", 0, prompt_len=30, max_tokens=12))
    preempted: list[str] = []
    while not preempted:
        plan, _ = run_step(s)
        preempted = plan.preempted_req_ids
    assert preempted == ["a"] and s.requests["a"].status is RequestStatus.PREEMPTED
    assert [r.req_id for r in s.waiting] == ["e", "a", "d"]
    outputs_before = list(s.requests["a"].output_token_ids)
    assert admission_order(s) == ["e", "d"]  # ("a" resumed: it is not new)
    assert not s.requests and outputs_before


def test_fcfs_preempts_the_most_recently_admitted_whatever_its_priority_field() -> None:
    s = Scheduler(config(block_size=BLOCK, num_kv_blocks=6, max_num_seqs=3))
    for req_id in ["a", "b", "c"]:
        s.add_request(prioritised(req_id, 0, prompt_len=30, max_tokens=12))
    preempted: list[str] = []
    while not preempted:
        plan, _ = run_step(s)
        preempted = plan.preempted_req_ids
    assert preempted == ["c"] and s.waiting[0].req_id == "c"


def test_the_queue_keeps_the_order_under_any_sequence_of_adds_put_backs_and_removals() -> None:
    rng = random.Random(3)
    for policy in ("priority", "fcfs"):
        queue, held, arrived = WaitingQueue(policy), [], 0  # type: ignore[arg-type]
        for _ in range(400):
            op = rng.random()
            if op < 0.5 or not held and not len(queue):
                arrived += 1
                request = prioritised(f"r{arrived}", rng.randint(-2, 2))
                request.arrival_order = arrived
                queue.add(request)
            elif op < 0.75 and len(queue):
                taken = queue[0]
                queue.remove(taken)
                held.append(taken)
            elif held:
                queue.put_back(held.pop(rng.randrange(len(held))))
        if policy == "priority":
            keys = [order_key(r) for r in queue]
            assert keys == sorted(keys)
        assert len(set(map(id, queue))) == len(queue)


def test_running_requests_are_placed_in_the_policys_order() -> None:
    running: list[Request] = []
    for arrival, priority in enumerate([3, 1, 3, -1, 1], start=1):
        request = prioritised(f"r{arrival}", priority)
        request.arrival_order = arrival
        place(running, request, "priority")
    assert [r.req_id for r in running] == ["r4", "r2", "r5", "r1", "r3"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_engine_refuses_a_priority_it_would_not_read(policy: str) -> None:
    core, _ = engine_core(scheduling_policy=policy)  # type: ignore[arg-type]
    sampling = SamplingParams(max_tokens=2)
    outputs = core.add_request(
        b"api", AddRequest("r", [1, 2, 3], sampling, priority=-2), [memoryview(b"msg")]
    )
    if policy == "priority":
        assert outputs == {} and core.scheduler.requests["r"].priority == -2
        return
    [refused] = outputs[b"api"]
    assert refused.error is not None and refused.error.param == "priority"
    assert "--scheduling-policy priority" in refused.error.message and "r" not in core.scheduler.requests
