"""Scheduler with a bounded KV pool, step by step: block tables, prefix-cache admission, preemption of
the most recently admitted request, resumption, and whole-image chunks. No processes."""

from __future__ import annotations

import random

import pytest

from engine.request import RequestStatus
from engine.scheduler import Scheduler
from tests.unit.scheduler_support import config, encoded, make_request, run_step
from wire.protocol import FinishReason

BLOCK = 16


def kv_config(**overrides: int | bool | str) -> object:
    return config(**{"block_size": BLOCK, "enable_prefix_caching": True, **overrides})


def test_blocks_grow_with_the_tokens_and_return_when_finished() -> None:
    s = Scheduler(kv_config(num_kv_blocks=8, max_num_batched_tokens=20))
    s.add_request(make_request("r", 40, max_tokens=9))
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r": 20} and s.kv_cache.block_ids("r") == [0, 1]
    plan, _ = run_step(s)
    assert plan.new_block_ids == {"r": [2]}  # 40 tokens: 3 blocks
    while s.has_work:
        run_step(s)
    assert s.kv_cache.num_free_blocks == 8 and s.kv_cache.usage == 0


def test_running_request_preempts_the_most_recently_admitted() -> None:
    # 6 blocks = 96 tokens. r1 (40 prompt) and r2 (40 prompt) fit with 1 block to spare.
    s = Scheduler(kv_config(num_kv_blocks=6, enable_prefix_caching=False))
    s.add_request(make_request("r1", 40, max_tokens=30))
    s.add_request(make_request("r2", 40, max_tokens=30))
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 40, "r2": 40}
    assert s.kv_cache.num_free_blocks == 0
    preempted_plan = None
    for _ in range(30):
        plan, _ = run_step(s)
        if plan.preempted_req_ids:
            preempted_plan = plan
            break
    assert preempted_plan is not None and preempted_plan.preempted_req_ids == ["r2"]
    r2 = s.requests["r2"]
    assert r2.status is RequestStatus.PREEMPTED and r2.num_computed_tokens == 0
    assert s.waiting[0] is r2 and "r2" not in preempted_plan.num_scheduled_tokens
    outputs_before = list(r2.output_token_ids)
    assert outputs_before, "r2 had produced tokens before it was preempted"
    # r1 runs alone until it finishes; then r2 resumes and recomputes prompt + outputs
    while s.requests.get("r1") is not None:
        plan, _ = run_step(s)
    resumed_plan = plan if plan.resumed_requests else run_step(s)[0]
    assert [r.req_id for r in resumed_plan.resumed_requests] == ["r2"]
    assert resumed_plan.num_scheduled_tokens["r2"] == 40 + len(outputs_before)
    assert r2.output_token_ids[: len(outputs_before)] == outputs_before  # nothing streamed is changed
    while s.has_work:
        run_step(s)
    assert r2.finish_reason is FinishReason.LENGTH and len(r2.output_token_ids) == 30
    assert s.kv_cache.num_free_blocks == 6 and s.num_preemptions == 1


def test_prefix_cache_admits_with_computed_blocks() -> None:
    s = Scheduler(kv_config(num_kv_blocks=32))
    s.add_request(make_request("a", 50, max_tokens=1))
    while s.has_work:
        run_step(s)
    s.add_request(make_request("b", 50, max_tokens=1))
    plan, _ = run_step(s)
    (new,) = plan.new_requests
    assert new.num_cached_tokens == 48  # 3 full blocks; the last token is always computed
    assert plan.num_scheduled_tokens == {"b": 2}
    assert s.kv_cache.num_prefix_queries_tokens == 100 and s.kv_cache.num_prefix_hits_tokens == 48


def test_prefix_cache_covering_an_image_skips_its_encoder_run() -> None:
    s = Scheduler(kv_config(num_kv_blocks=64))
    s.add_request(make_request("a", 100, images=[("img", 10, 40)], max_tokens=1))
    plan, _ = run_step(s)
    assert encoded(plan) == ["img"]
    while s.has_work:
        run_step(s)
    queries = s.encoder_cache.num_queries
    s.add_request(make_request("b", 100, images=[("img", 10, 40)], max_tokens=1))
    plan, _ = run_step(s)
    assert plan.new_requests[0].num_cached_tokens == 96 and encoded(plan) == []
    assert s.encoder_cache.num_queries == queries  # the image was not even looked up


@pytest.mark.parametrize("prefix_match", ["token", "block"])
def test_a_next_turn_whose_hit_ends_just_past_an_image_does_not_encode_it(prefix_match: str) -> None:
    """A conversation's next turn: the last prompt (its image ends 1 token into block 6) and a
    re-rendered answer that differs from the sampled one from its first token. Whole blocks stop at 96,
    before the image's last placeholder, which needs the image encoded again; the hit of block 6's
    first 4 tokens (copied) holds the image whole."""
    s = Scheduler(kv_config(num_kv_blocks=64, prefix_match=prefix_match))
    s.add_request(make_request("a", 100, images=[("img", 60, 37)], max_tokens=16))  # outputs 6, 7, ...
    run_step(s)
    a_table = s.kv_cache.block_ids("a")
    while s.has_work:
        run_step(s)
    s.encoder_cache.reset()  # (as under load: the image's entry is gone by the next turn)
    follow_up = make_request("b", 120, images=[("img", 60, 37)], max_tokens=1)
    follow_up.prompt_token_ids[100:] = [99] * 20
    s.add_request(follow_up)
    plan, _ = run_step(s)
    if prefix_match == "block":
        assert plan.new_requests[0].num_cached_tokens == 96 and encoded(plan) == ["img"]
        assert plan.kv_copies == []
        return
    assert plan.new_requests[0].num_cached_tokens == 100 and encoded(plan) == []
    [(source, destination, num_copied)] = plan.kv_copies
    assert source == a_table[6] and destination not in a_table and num_copied == 4
    assert follow_up.finish_reason is FinishReason.LENGTH


def test_different_image_same_tokens_misses_from_the_image_block_on() -> None:
    s = Scheduler(kv_config(num_kv_blocks=64))
    s.add_request(make_request("a", 100, images=[("img-a", 40, 30)], max_tokens=1))
    while s.has_work:
        run_step(s)
    s.add_request(make_request("b", 100, images=[("img-b", 40, 30)], max_tokens=1))
    plan, _ = run_step(s)
    # blocks 0-1 and block 2's first 8 tokens are text; the image at 40 ends the match
    assert plan.new_requests[0].num_cached_tokens == 40 and encoded(plan) == ["img-b"]


def test_disabled_chunked_mm_input_stops_before_an_image_it_cannot_cover() -> None:
    s = Scheduler(kv_config(num_kv_blocks=64, max_num_batched_tokens=64, disable_chunked_mm_input=True))
    s.add_request(make_request("r", 120, images=[("img", 30, 50)], max_tokens=1))
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r": 30} and encoded(plan) == []
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r": 64} and encoded(plan) == ["img"]  # [30, 94) covers it whole


def test_request_that_can_never_fit_the_pool_is_rejected_at_admission() -> None:
    s = Scheduler(kv_config(num_kv_blocks=4))
    error = s.admission_error(60, 5, [])
    assert error is not None and error.code == "kv_cache_exceeded"
    assert s.admission_error(60, 4, []) is None


def test_no_request_is_lost_under_heavy_preemption() -> None:
    rng = random.Random(3)
    s = Scheduler(kv_config(num_kv_blocks=24, max_num_batched_tokens=64, max_num_seqs=16))
    lengths = {}
    for i in range(120):
        prompt_len, max_tokens = rng.randint(5, 120), rng.randint(1, 40)
        assert s.admission_error(prompt_len, max_tokens, []) is None
        images = [(f"h{rng.randrange(4)}", 2, 20)] if rng.random() < 0.3 and prompt_len > 30 else []
        s.add_request(make_request(f"q{i}", prompt_len, images=images, max_tokens=max_tokens))
        lengths[f"q{i}"] = max_tokens
    finished: dict[str, int] = {}
    for _ in range(20_000):
        if not s.has_work:
            break
        plan, result = run_step(s)
        assert plan.num_scheduled_tokens, "every step with work makes progress"
        for request in result.finished:
            finished[request.req_id] = len(request.output_token_ids)
            # the stand-in counts on from the prompt's 5s: a resumed request's outputs went on unchanged
            assert request.output_token_ids == list(range(6, 6 + len(request.output_token_ids)))
    assert finished == lengths  # every request finished with exactly its max_tokens outputs
    assert s.num_preemptions > 0
    assert s.kv_cache.num_free_blocks == 24 and s.kv_cache.usage == 0
