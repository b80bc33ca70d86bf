"""Scheduler and encoder cache, step by step: which images run through the encoder in which step, how
entries are shared, released and evicted, and a seeded soak that keeps the stand-in worker's encoder
store in step."""

from __future__ import annotations

import random
from collections import Counter

from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.step_wire import to_scheduler_output
from tests.unit.scheduler_support import (
    Image,
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

# ---------------------------------------------------------------------------- encoder scheduling


def test_image_is_encoded_in_the_step_whose_chunk_first_covers_it() -> None:
    s = Scheduler(config(max_num_batched_tokens=16))
    s.add_request(make_request("r1", 40, images=[("h", 16, 10)], max_tokens=1))
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 16} and plan.encoder_items == []  # [0, 16) ends at it
    assert "h" not in s.encoder_cache

    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 16} and encoded(plan) == ["h"]
    assert plan.encoder_items[0][1] is s.requests["r1"].mm_items["h"]
    # [16, 32) covers [16, 26) entirely: released after the step, held as freeable
    assert s.requests["r1"].encoder_hashes_in_use == set()
    assert freeable(s) == ["h"] and s.encoder_cache.num_used_tokens == 10

    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 8} and plan.encoder_items == []
    assert not s.has_work


def test_chunk_covering_part_of_an_image_encodes_it_whole_once() -> None:
    s = Scheduler(config(max_num_batched_tokens=16))
    s.add_request(make_request("r1", 40, images=[("h", 10, 20)], max_tokens=1))
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 16} and encoded(plan) == ["h"]
    assert s.encoder_cache.num_used_tokens == 20  # the whole image, not the 6 covered positions
    assert s.requests["r1"].encoder_hashes_in_use == {"h"} and users(s, "h") == {"r1"}

    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 16} and plan.encoder_items == []  # not re-encoded
    assert s.requests["r1"].encoder_hashes_in_use == set() and freeable(s) == ["h"]  # 32 >= 30

    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 8} and plan.encoder_items == []
    assert s.encoder_cache.num_queries == 1


def test_compute_budget_encodes_one_image_per_step_and_stops_the_other_chunk_before_it() -> None:
    s = Scheduler(config(encoder_compute_budget_tokens=600))
    s.add_request(make_request("r1", 596, images=[("a", 10, 576)], max_tokens=3))
    s.add_request(make_request("r2", 596, images=[("b", 10, 576)], max_tokens=3))
    plan, result = run_step(s)
    # r2's text before its image still runs; its image waits for the next step's budget
    assert plan.num_scheduled_tokens == {"r1": 596, "r2": 10}
    assert encoded(plan) == ["a"] and new_ids(plan) == ["r1", "r2"]
    assert sorted(result.new_token_ids) == ["r1"]
    assert "b" not in s.encoder_cache and s.requests["r2"].encoder_hashes_in_use == set()

    plan, result = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 1, "r2": 586} and encoded(plan) == ["b"]
    assert sorted(result.new_token_ids) == ["r1", "r2"]


def test_head_of_line_request_blocked_at_its_first_image_waits_in_fcfs_order() -> None:
    s = Scheduler(config(encoder_compute_budget_tokens=600))
    s.add_request(make_request("r1", 596, images=[("a", 10, 576)], max_tokens=3))
    s.add_request(make_request("r2", 586, images=[("b", 0, 576)], max_tokens=3))
    s.add_request(make_request("r3", 5, max_tokens=3))  # text only, but behind r2
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 596} and encoded(plan) == ["a"] and new_ids(plan) == ["r1"]
    assert s.num_waiting == 2 and s.requests["r2"].status is RequestStatus.WAITING

    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 1, "r2": 586, "r3": 5}
    assert encoded(plan) == ["b"] and new_ids(plan) == ["r2", "r3"]


def test_cache_full_of_in_use_entries_stops_the_chunk_until_space_frees() -> None:
    s = Scheduler(config(max_num_batched_tokens=300, encoder_cache_tokens=600))
    s.add_request(make_request("r1", 510, images=[("a", 0, 500)], max_tokens=2))
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 300} and encoded(plan) == ["a"]

    s.add_request(make_request("r2", 215, images=[("b", 5, 200)], max_tokens=1))
    plan, _ = run_step(s)
    # "a" (500 of 600) is still in use by r1: "b" does not fit, r2 runs its 5 text tokens only
    assert plan.num_scheduled_tokens == {"r1": 210, "r2": 5}
    assert plan.encoder_items == [] and plan.free_mm_hashes == []
    assert freeable(s) == ["a"]  # r1 computed past it after the step

    plan, result = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 1, "r2": 210}
    assert encoded(plan) == ["b"] and plan.free_mm_hashes == ["a"]  # evicted under pressure
    assert [r.req_id for r in result.finished] == ["r1", "r2"]
    assert s.encoder_cache.num_used_tokens == 200

    plan = s.schedule()
    assert plan.is_empty and plan.free_mm_hashes == [] and plan.finished_req_ids == ["r1", "r2"]


def test_same_hash_in_one_step_is_encoded_once_and_freeable_entry_is_reused() -> None:
    s = Scheduler(config())
    s.add_request(make_request("r1", 60, images=[("h", 0, 50)], max_tokens=1))
    s.add_request(make_request("r2", 60, images=[("h", 0, 50)], max_tokens=1))
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 60, "r2": 60} and encoded(plan) == ["h"]
    assert (s.encoder_cache.num_queries, s.encoder_cache.num_hits) == (2, 1)
    assert freeable(s) == ["h"] and s.encoder_cache.num_used_tokens == 50

    s.add_request(make_request("r3", 55, images=[("h", 5, 50)], max_tokens=1))
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r3": 55} and plan.encoder_items == []  # revived, no encode
    assert plan.free_mm_hashes == []
    assert (s.encoder_cache.num_queries, s.encoder_cache.num_hits) == (3, 2)
    assert freeable(s) == ["h"]


def test_entry_in_use_by_a_running_request_is_shared_by_a_later_one() -> None:
    s = Scheduler(config(max_num_batched_tokens=60))
    s.add_request(make_request("r1", 100, images=[("h", 50, 40)], max_tokens=2))
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 60} and encoded(plan) == ["h"]

    s.add_request(make_request("r2", 45, images=[("h", 0, 40)], max_tokens=1))
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 40, "r2": 20} and plan.encoder_items == []
    assert users(s, "h") == {"r2"} and freeable(s) == []  # r1 released it, r2 still needs it
    assert (s.encoder_cache.num_queries, s.encoder_cache.num_hits) == (2, 1)

    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 1, "r2": 25} and plan.encoder_items == []
    assert freeable(s) == ["h"]


def test_freeable_entries_are_evicted_oldest_first_only_under_pressure() -> None:
    s = Scheduler(config(encoder_cache_tokens=300))
    for req_id, mm_hash in [("r1", "a"), ("r2", "b"), ("r3", "c")]:
        s.add_request(make_request(req_id, 110, images=[(mm_hash, 0, 100)], max_tokens=1))
    plan, _ = run_step(s)
    assert encoded(plan) == ["a", "b", "c"] and plan.free_mm_hashes == []
    assert freeable(s) == ["a", "b", "c"] and s.encoder_cache.num_free_tokens == 0

    s.add_request(make_request("r4", 110, images=[("a", 0, 100)], max_tokens=1))
    plan, _ = run_step(s)
    assert plan.encoder_items == [] and plan.free_mm_hashes == []  # a full cache alone evicts nothing
    assert freeable(s) == ["b", "c", "a"]  # "a" was revived, then released again: now the newest

    s.add_request(make_request("r5", 160, images=[("d", 0, 150)], max_tokens=1))
    plan, _ = run_step(s)
    assert encoded(plan) == ["d"] and plan.free_mm_hashes == ["b", "c"]
    assert freeable(s) == ["a", "d"] and s.encoder_cache.num_used_tokens == 250

    s.add_request(make_request("r6", 60, images=[("e", 0, 50)], max_tokens=1))
    plan, _ = run_step(s)
    assert encoded(plan) == ["e"] and plan.free_mm_hashes == []  # 50 free tokens: no eviction needed
    assert freeable(s) == ["a", "d", "e"]

    s.add_request(make_request("r7", 110, images=[("a", 10, 100)], max_tokens=1))
    plan, _ = run_step(s)
    assert plan.encoder_items == [] and plan.free_mm_hashes == []  # "b" and "c" were reported once


def test_disabled_encoder_cache_encodes_per_use_and_still_shares_concurrent_uses() -> None:
    s = Scheduler(config(encoder_cache_tokens=0, max_num_batched_tokens=60))
    s.add_request(make_request("r1", 60, images=[("h", 0, 50)], max_tokens=2))
    plan, _ = run_step(s)
    assert encoded(plan) == ["h"]
    assert "h" not in s.encoder_cache and freeable(s) == []  # evicted as soon as released

    s.add_request(make_request("r2", 55, images=[("h", 5, 50)], max_tokens=1))
    plan, _ = run_step(s)
    assert plan.free_mm_hashes == ["h"] and encoded(plan) == ["h"]  # dropped, then encoded again
    assert plan.num_scheduled_tokens == {"r1": 1, "r2": 55}

    # two requests running together share one encode, even mid-image
    s.add_request(make_request("r3", 100, images=[("g", 50, 40)], max_tokens=1))
    plan, _ = run_step(s)
    assert plan.free_mm_hashes == ["h"] and encoded(plan) == ["g"]
    assert plan.num_scheduled_tokens == {"r3": 60} and users(s, "g") == {"r3"}
    s.add_request(make_request("r4", 45, images=[("g", 0, 40)], max_tokens=1))
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r3": 40, "r4": 20} and plan.encoder_items == []
    assert users(s, "g") == {"r4"}
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r4": 25} and plan.encoder_items == []
    assert "g" not in s.encoder_cache
    assert s.schedule().free_mm_hashes == ["g"]


def test_an_item_blocked_by_the_compute_budget_is_queried_once() -> None:
    s = Scheduler(config(encoder_compute_budget_tokens=600))
    s.add_request(make_request("r1", 596, images=[("a", 10, 576)], max_tokens=3))
    s.add_request(make_request("r2", 596, images=[("b", 10, 576)], max_tokens=3))
    run_step(s)
    run_step(s)
    assert s.encoder_cache.num_hits == 0
    assert s.encoder_cache.num_queries == 2  # two items, two queries (actual: 3)


def test_same_image_twice_in_one_prompt_is_encoded_once() -> None:
    s = Scheduler(config(encoder_cache_tokens=0, max_num_batched_tokens=80))
    s.add_request(make_request("r1", 120, images=[("h", 0, 50), ("h", 60, 50)], max_tokens=1))
    plan1, _ = run_step(s)
    plan2, _ = run_step(s)
    assert plan1.num_scheduled_tokens == {"r1": 80} and plan2.num_scheduled_tokens == {"r1": 40}
    assert encoded(plan1) + encoded(plan2) == ["h"]  # actual: ["h", "h"], with plan2 freeing "h" first


# ---------------------------------------------------------------------------- randomized soak


def test_randomized_soak_loses_nothing_and_keeps_worker_store_in_step() -> None:
    rng = random.Random(20240611)
    capacity, compute_budget, token_budget, max_num_seqs = 700, 400, 256, 12
    s = Scheduler(
        config(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=token_budget,
            max_model_len=2048,
            encoder_cache_tokens=capacity,
            encoder_compute_budget_tokens=compute_budget,
        )
    )
    pool = {f"img{i}": rng.randint(50, 300) for i in range(6)}

    specs: list[Request] = []
    for i in range(300):
        images: list[Image] = []
        offset = rng.randint(0, 40)
        for _ in range(rng.randint(0, 2)):
            mm_hash = rng.choice(sorted(pool))  # with replacement: one prompt may hold an image twice
            images.append((mm_hash, offset, pool[mm_hash]))
            offset += pool[mm_hash] + rng.randint(0, 40)
        prompt_len = max(1, offset + rng.randint(0, 20))
        request = make_request(f"q{i}", prompt_len, images, max_tokens=rng.randint(1, 8), eos_token_ids=(0,))
        assert s.admission_error(prompt_len, request.sampling.max_tokens, [n for _, _, n in images]) is None
        specs.append(request)
    total_tokens = sum(r.num_prompt_tokens + r.sampling.max_tokens for r in specs)

    worker = worker_for(s, next_token=lambda _req_id, _token_ids: rng.randint(0, 30))
    finished: dict[str, FinishReason] = {}
    sent: Counter[str] = Counter()
    reported: Counter[str] = Counter()
    next_req = work_steps = 0
    while next_req < len(specs) or s.has_work:
        for _ in range(rng.randint(0, 3)):
            if next_req < len(specs):
                s.add_request(specs[next_req])
                next_req += 1
        if s.requests and rng.random() < 0.05:
            req_id = rng.choice(sorted(s.requests))
            aborted = s.abort(req_id)
            assert aborted is not None and aborted.finish_reason is FinishReason.ABORT
            finished[req_id] = FinishReason.ABORT

        had_work = s.has_work
        plan = s.schedule()
        work_steps += had_work
        assert bool(plan.num_scheduled_tokens) == had_work  # no livelock: work means progress
        assert plan.num_batched_tokens <= token_budget and len(plan.num_scheduled_tokens) <= max_num_seqs
        assert sum(item.num_tokens for _, item in plan.encoder_items) <= compute_budget
        assert s.encoder_cache.num_used_tokens <= capacity
        sent.update(new_ids(plan))
        reported.update(plan.finished_req_ids)

        # the stand-in worker frees first, then encodes; it refuses (StepError) to encode what it
        # holds, and a chunk whose placeholders need an output it does not hold
        assert set(plan.free_mm_hashes) <= worker.outputs.keys()  # nothing freed that it lacks
        sched, frames = to_scheduler_output(plan, s.kv_cache)
        output = worker.execute(sched, frames)
        assert worker.outputs.keys() == {h for h in pool if h in s.encoder_cache}
        result = s.postprocess(plan, output)
        for request in result.finished:
            assert request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            assert 1 <= len(request.output_token_ids) <= request.sampling.max_tokens
            finished[request.req_id] = request.finish_reason
        assert s.encoder_cache.num_used_tokens <= capacity
        assert work_steps <= total_tokens

    reported.update(s.schedule().finished_req_ids)
    assert sorted(finished) == sorted(r.req_id for r in specs)  # no request lost
    assert set(sent.values()) == {1} and reported == sent  # each sent once, forgotten once
    assert s.requests == {} and s.num_running == 0 and s.num_waiting == 0
    assert all(not u for u in s.encoder_cache._users.values())  # every held entry is freeable
    assert s.encoder_cache.can_allocate(capacity) and s.encoder_cache.num_used_tokens == 0
    assert Counter(finished.values())[FinishReason.ABORT] > 0
