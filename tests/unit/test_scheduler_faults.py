"""A step the worker fails (``Scheduler.fail_step``): its requests end, and neither the prefix cache
nor the encoder cache keeps what the step would have written; earlier steps' entries stay, and the
step's drops are sent again. Step-driven, no processes."""

from __future__ import annotations

from engine.request import RequestStatus
from engine.scheduler import Scheduler
from engine.step_plan import SchedulerConfig, StepPlan
from tests.unit.scheduler_support import config, encoded, make_request, new_ids, run_step, users

BLOCK = 16
# 64 prompt tokens: image "a" in block 0-1, image "b" in blocks 2-3
TWO_IMAGES = (("a", 2, 16), ("b", 40, 16))


def kv_config(**overrides: int | bool) -> SchedulerConfig:
    return config(**{"block_size": BLOCK, "enable_prefix_caching": True, **overrides})


def fail(s: Scheduler) -> tuple[StepPlan, list[str]]:
    plan = s.schedule()
    return plan, [r.req_id for r in s.fail_step(plan)]


def test_failed_first_step_leaves_no_prefix_hit_and_encodes_again() -> None:
    s = Scheduler(kv_config())
    s.add_request(make_request("r1", 64, images=TWO_IMAGES))
    plan, failed = fail(s)
    assert failed == ["r1"] and not s.requests
    assert encoded(plan) == ["a", "b"] and len(plan.cached_blocks) == 4
    assert "a" not in s.encoder_cache and "b" not in s.encoder_cache
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks and s.kv_cache._pool.num_cached_blocks == 0

    s.add_request(make_request("r2", 64, images=TWO_IMAGES))
    plan, _ = run_step(s)
    assert new_ids(plan) == ["r2"] and plan.new_requests[0].num_cached_tokens == 0  # no prefix hit
    assert encoded(plan) == ["a", "b"]  # encoded again
    # the worker drops whatever the failed step stored, before this step's encodes
    assert plan.free_mm_hashes == ["a", "b"] and plan.finished_req_ids == ["r1"]


def test_blocks_and_outputs_of_earlier_steps_survive_a_failed_step() -> None:
    s = Scheduler(kv_config(max_num_batched_tokens=32))
    s.add_request(make_request("r1", 64, images=TWO_IMAGES))
    plan, _ = run_step(s)  # tokens 0-32: encodes "a", registers blocks 0 and 1
    assert encoded(plan) == ["a"] and [b for b, _ in plan.cached_blocks] == [0, 1]
    plan, failed = fail(s)  # tokens 32-64: was to encode "b" and fill blocks 2 and 3
    assert failed == ["r1"] and encoded(plan) == ["b"] and [b for b, _ in plan.cached_blocks] == [2, 3]
    assert "a" in s.encoder_cache and "b" not in s.encoder_cache

    s.add_request(make_request("r2", 64, images=TWO_IMAGES))
    plan, _ = run_step(s)
    assert plan.new_requests[0].num_cached_tokens == 32  # blocks 0-1 hit, 2-3 not
    assert plan.num_scheduled_tokens == {"r2": 32}
    assert encoded(plan) == ["b"]  # "a" lies inside the hit; "b" is encoded again
    assert plan.free_mm_hashes == ["b"]


def test_sharing_within_the_failed_step_is_undone_too() -> None:
    # r2 is admitted after r1 in the same step and hits the blocks r1's allocation just registered.
    s = Scheduler(kv_config())
    s.add_request(make_request("r1", 64, images=TWO_IMAGES))
    s.add_request(make_request("r2", 80, images=TWO_IMAGES))
    plan, failed = fail(s)
    assert failed == ["r1", "r2"]
    assert plan.new_requests[1].num_cached_tokens == 64
    assert s.kv_cache._pool.num_cached_blocks == 0 and not s.encoder_cache._users

    s.add_request(make_request("r3", 80, images=TWO_IMAGES))
    plan, _ = run_step(s)
    assert plan.new_requests[0].num_cached_tokens == 0 and encoded(plan) == ["a", "b"]


def test_an_entry_shared_within_the_failed_step_is_encoded_again() -> None:
    s = Scheduler(kv_config(enable_prefix_caching=False))
    s.add_request(make_request("r1", 40, images=[("a", 2, 16)]))
    s.add_request(make_request("r2", 30, images=[("a", 4, 16)]))
    plan, failed = fail(s)
    assert failed == ["r1", "r2"] and encoded(plan) == ["a"]  # encoded once, used by both
    assert "a" not in s.encoder_cache
    s.add_request(make_request("r3", 30, images=[("a", 4, 16)]))
    plan, _ = run_step(s)
    assert encoded(plan) == ["a"] and plan.free_mm_hashes == ["a"]


def test_an_entry_of_an_earlier_step_that_the_failed_step_only_shared_stays() -> None:
    s = Scheduler(kv_config(enable_prefix_caching=False))
    s.add_request(make_request("r1", 20, images=[("a", 2, 16)], max_tokens=1))
    plan, result = run_step(s)
    assert encoded(plan) == ["a"] and [r.req_id for r in result.finished] == ["r1"]
    s.add_request(make_request("r2", 20, images=[("a", 2, 16)]))
    plan, failed = fail(s)
    assert failed == ["r2"] and encoded(plan) == []  # a hit on the freeable entry
    assert "a" in s.encoder_cache and not users(s, "a")
    s.add_request(make_request("r3", 20, images=[("a", 2, 16)]))
    plan = s.schedule()
    assert encoded(plan) == [] and users(s, "a") == {"r3"}
    assert plan.free_mm_hashes == []


def test_requests_outside_the_failed_step_run_on() -> None:
    # r2 waits (max_num_seqs 1) while r1's step fails; it runs afterwards, encoding its own image.
    s = Scheduler(kv_config(max_num_seqs=1))
    s.add_request(make_request("r1", 64, images=TWO_IMAGES))
    s.add_request(make_request("r2", 64, images=[("c", 2, 16)], max_tokens=1))
    _, failed = fail(s)
    assert failed == ["r1"] and s.requests["r2"].status is RequestStatus.WAITING
    plan, result = run_step(s)
    assert new_ids(plan) == ["r2"] and encoded(plan) == ["c"]
    assert [r.req_id for r in result.finished] == ["r2"]


def test_the_failed_steps_drops_are_sent_again() -> None:
    s = Scheduler(kv_config(enable_prefix_caching=False, encoder_cache_tokens=16))
    s.add_request(make_request("r1", 40, images=[("a", 2, 16)], max_tokens=1))
    _, result = run_step(s)
    assert [r.req_id for r in result.finished] == ["r1"]  # "a" freeable
    s.add_request(make_request("r2", 40, images=[("b", 2, 16)], max_tokens=1))
    plan, failed = fail(s)  # evicts "a" to make room for "b"; tells the worker r1 finished
    assert failed == ["r2"] and plan.free_mm_hashes == ["a"] and plan.finished_req_ids == ["r1"]
    plan = s.schedule()  # nothing to run; the drops go out again (the worker ignores repeats)
    assert plan.is_empty
    assert plan.free_mm_hashes == ["a", "b"] and plan.finished_req_ids == ["r1", "r2"]
    assert s.schedule().free_mm_hashes == []  # once


def test_preemptions_of_the_failed_step_are_sent_again() -> None:
    # 6 blocks: r1 and r2 (48 tokens each) fill all of them; r1's first decode token preempts r2.
    s = Scheduler(kv_config(num_kv_blocks=6, enable_prefix_caching=False))
    s.add_request(make_request("r1", 48, max_tokens=30))
    s.add_request(make_request("r2", 48, max_tokens=30))
    run_step(s)
    plan = s.schedule()
    assert plan.preempted_req_ids == ["r2"] and list(plan.num_scheduled_tokens) == ["r1"]
    assert [r.req_id for r in s.fail_step(plan)] == ["r1"]
    plan = s.schedule()  # r2 resumes; the worker first hears (again) that it was preempted
    assert [r.req_id for r in plan.resumed_requests] == ["r2"]
    assert plan.preempted_req_ids == ["r2"] and plan.finished_req_ids == ["r1"]
