"""Scheduler, step by step: schedule() → the stand-in worker runs the step → postprocess(). No processes.

Each test drives the scheduler as the engine core does and checks the exact plan of every step: how many
tokens each request computes, which items the encoder runs on, which hashes the worker frees and which
requests it forgets.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from tests.unit.scheduler_support import (
    config,
    encoded,
    freeable,
    make_request,
    new_ids,
    run_step,
    users,
    worker_for,
)
from wire.protocol import FinishReason

# ---------------------------------------------------------------------------- continuous batching


def test_requests_join_between_steps_and_advance_together() -> None:
    s = Scheduler(config(max_num_batched_tokens=100))
    s.add_request(make_request("r1", 10, max_tokens=3))
    plan, result = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 10} and new_ids(plan) == ["r1"]
    assert result.new_token_ids == {"r1": [6]} and result.finished == []  # prompt tokens are all 5

    s.add_request(make_request("r2", 5, max_tokens=2))
    plan, result = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 1, "r2": 5} and new_ids(plan) == ["r2"]
    assert result.new_token_ids == {"r1": [7], "r2": [6]}

    plan, result = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 1, "r2": 1} and new_ids(plan) == []
    assert [r.req_id for r in result.finished] == ["r1", "r2"]
    assert [r.finish_reason for r in result.finished] == [FinishReason.LENGTH, FinishReason.LENGTH]
    assert [len(r.output_token_ids) for r in result.finished] == [3, 2]
    assert not s.has_work and s.requests == {}

    plan = s.schedule()
    assert plan.is_empty and plan.finished_req_ids == ["r1", "r2"]
    assert s.schedule().finished_req_ids == []  # reported exactly once


def test_max_num_seqs_bounds_running_requests() -> None:
    s = Scheduler(config(max_num_seqs=2))
    s.add_request(make_request("r1", 4, max_tokens=1))
    s.add_request(make_request("r2", 4, max_tokens=3))
    s.add_request(make_request("r3", 4, max_tokens=1))
    plan, result = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 4, "r2": 4} and new_ids(plan) == ["r1", "r2"]
    assert (s.num_running, s.num_waiting) == (1, 1)  # r1 finished at once, r3 still waits
    assert [r.req_id for r in result.finished] == ["r1"]

    plan, result = run_step(s)
    assert plan.num_scheduled_tokens == {"r2": 1, "r3": 4} and new_ids(plan) == ["r3"]
    assert plan.finished_req_ids == ["r1"]
    assert (s.num_running, s.num_waiting) == (1, 0)


def test_long_prompt_is_chunked_under_the_token_budget() -> None:
    s = Scheduler(config(max_num_batched_tokens=16))
    s.add_request(make_request("r1", 40, max_tokens=2))
    plans = []
    for _ in range(4):
        plan, result = run_step(s)
        plans.append((plan.num_scheduled_tokens, new_ids(plan), result.new_token_ids))
    assert plans == [
        ({"r1": 16}, ["r1"], {}),  # no token sampled before the prompt is fully computed
        ({"r1": 16}, [], {}),
        ({"r1": 8}, [], {"r1": [6]}),
        ({"r1": 1}, [], {"r1": [7]}),
    ]
    assert not s.has_work


def test_decodes_run_before_new_prefills_which_take_the_rest_of_the_budget() -> None:
    s = Scheduler(config(max_num_batched_tokens=16))
    s.add_request(make_request("r1", 10, max_tokens=5))
    s.add_request(make_request("r2", 30, max_tokens=5))
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 10, "r2": 6}  # r2 starts with what is left
    s.add_request(make_request("r3", 30, max_tokens=5))
    plan, _ = run_step(s)
    assert list(plan.num_scheduled_tokens.items()) == [("r1", 1), ("r2", 15)]
    assert s.num_waiting == 1  # no budget left for r3
    plan, result = run_step(s)
    assert list(plan.num_scheduled_tokens.items()) == [("r1", 1), ("r2", 9), ("r3", 6)]
    assert plan.num_batched_tokens == 16
    assert sorted(result.new_token_ids) == ["r1", "r2"]
    plan, _ = run_step(s)
    assert list(plan.num_scheduled_tokens.items()) == [("r1", 1), ("r2", 1), ("r3", 14)]


# ---------------------------------------------------------------------------- releasing, finishing


def test_abort_of_a_running_request_releases_its_entries() -> None:
    s = Scheduler(config(max_num_batched_tokens=30))
    s.add_request(make_request("r1", 100, images=[("h", 10, 50)]))
    plan, _ = run_step(s)
    assert encoded(plan) == ["h"] and users(s, "h") == {"r1"}

    aborted = s.abort("r1")
    assert aborted is not None and aborted.finish_reason is FinishReason.ABORT
    assert aborted.status is RequestStatus.FINISHED and aborted.encoder_hashes_in_use == set()
    assert freeable(s) == ["h"] and "h" in s.encoder_cache  # kept for reuse
    assert s.abort("r1") is None and not s.has_work

    plan = s.schedule()
    assert plan.is_empty and plan.finished_req_ids == ["r1"]
    assert s.schedule().finished_req_ids == []


def test_abort_of_a_waiting_request_is_never_reported_to_the_worker() -> None:
    s = Scheduler(config(max_num_batched_tokens=10))
    s.add_request(make_request("r1", 10, max_tokens=2))
    s.add_request(make_request("r2", 10, max_tokens=2))
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 10} and s.num_waiting == 1

    aborted = s.abort("r2")
    assert aborted is not None and aborted.finish_reason is FinishReason.ABORT
    assert s.num_waiting == 0 and "r2" not in s.requests
    plan, result = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 1} and new_ids(plan) == [] and plan.finished_req_ids == []
    assert [r.req_id for r in result.finished] == ["r1"]
    assert s.schedule().finished_req_ids == ["r1"]  # r2 never reached the worker


def run_to_finish(request: Request, tokens: Sequence[int]) -> Request:
    """Runs one text-only request, sampling ``tokens`` in order; returns it once finished."""
    s = Scheduler(config())
    s.add_request(request)
    script = iter(tokens)
    worker_for(s, next_token=lambda _req_id, _token_ids: next(script))
    for _ in tokens:
        _, result = run_step(s)
        if result.finished:
            assert result.finished == [request] and not s.has_work
            return request
    raise AssertionError("request did not finish")


def test_finish_reasons() -> None:
    r = run_to_finish(make_request("len", 4, max_tokens=3), [1, 1, 1])
    assert (r.finish_reason, r.output_token_ids) == (FinishReason.LENGTH, [1, 1, 1])

    r = run_to_finish(make_request("eos", 4, max_tokens=8, eos_token_ids=(2,)), [1, 2, 1])
    assert (r.finish_reason, r.output_token_ids) == (FinishReason.STOP, [1, 2])

    r = run_to_finish(make_request("ign", 4, max_tokens=3, eos_token_ids=(2,), ignore_eos=True), [2] * 5)
    assert (r.finish_reason, r.output_token_ids) == (FinishReason.LENGTH, [2, 2, 2])

    r = run_to_finish(make_request("min", 4, max_tokens=8, eos_token_ids=(2,), min_tokens=3), [2] * 8)
    assert (r.finish_reason, r.output_token_ids) == (FinishReason.STOP, [2, 2, 2])

    r = run_to_finish(
        make_request("stop", 4, max_tokens=8, eos_token_ids=(2,), ignore_eos=True, stop_token_ids=(9,)),
        [2, 3, 9, 1],
    )
    assert (r.finish_reason, r.output_token_ids) == (FinishReason.STOP, [2, 3, 9])

    r = run_to_finish(make_request("minstop", 4, max_tokens=8, stop_token_ids=(9,), min_tokens=2), [9] * 3)
    assert (r.finish_reason, r.output_token_ids) == (FinishReason.STOP, [9, 9])


# ---------------------------------------------------------------------------- admission


def test_admission_error_context_length() -> None:
    s = Scheduler(config(max_model_len=128))
    assert s.admission_error(100, 28, []) is None
    error = s.admission_error(100, 29, [])
    assert error is not None
    assert error.code == "context_length_exceeded"
    assert "maximum context length is 128 tokens" in error.message and "129 tokens" in error.message


def test_admission_error_item_larger_than_encoder_cache_or_compute_budget() -> None:
    s = Scheduler(config(encoder_cache_tokens=500, encoder_compute_budget_tokens=1000))
    assert s.admission_error(600, 1, [500, 10]) is None
    error = s.admission_error(600, 1, [10, 501])
    assert error is not None and error.code == "mm_item_too_large" and "501" in error.message

    s = Scheduler(config(encoder_cache_tokens=1000, encoder_compute_budget_tokens=300))
    assert s.admission_error(600, 1, [300]) is None
    assert s.admission_error(600, 1, [301]) is not None

    s = Scheduler(config(encoder_cache_tokens=0, encoder_compute_budget_tokens=300))  # cache disabled
    assert s.admission_error(600, 1, [300]) is None
    assert s.admission_error(600, 1, [301]) is not None


def test_a_full_waiting_queue_refuses_new_requests_with_429_and_keeps_the_queued_ones() -> None:
    s = Scheduler(config(max_waiting_requests=2, max_num_seqs=1))
    for req_id in ("a", "b"):
        assert s.admission_error(10, 4, []) is None
        s.add_request(make_request(req_id, 10, max_tokens=4))
    error = s.admission_error(10, 4, [])
    assert error is not None and (error.code, error.http_status) == ("too_many_requests", 429)
    assert "--max-waiting-requests 2" in error.message
    run_step(s)  # "a" starts running: one place frees up, "b" still waits
    assert s.num_waiting == 1 and s.admission_error(10, 4, []) is None
    assert set(s.requests) == {"a", "b"}  # nothing already accepted was dropped


def test_a_requests_later_choices_are_admitted_with_it_past_the_queue_cap() -> None:
    """The cap admits or refuses a request as a whole: its first choice is counted, the later ones of
    an n > 1 request are part of it (else n above the cap could never run, and a first choice prefilled
    in a nearly full queue would be wasted on its siblings' 429)."""
    s = Scheduler(config(max_waiting_requests=2, max_num_seqs=1))
    for req_id in ("a", "b"):
        s.add_request(make_request(req_id, 10, max_tokens=4))
    assert s.admission_error(10, 4, []) is not None
    assert s.admission_error(10, 4, [], queue_capped=False) is None
    assert s.admission_error(5000, 4, [], queue_capped=False) is not None  # what could never run still is
