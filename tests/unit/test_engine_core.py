"""EngineCore on the stand-in worker (tests/standin_worker.py, which keeps the worker's books and
refuses what the worker would): admission through the per-sender receiver cache, the mirror's
operations applied before any rejection, routing of outputs per client, stats, and the wire form of a
step."""

from __future__ import annotations

import pytest

from engine.executor import WorkerLost
from engine.kv_cache_manager import KVCacheManager
from engine.request import MMItem
from engine.step_plan import StepPlan
from engine.step_wire import to_scheduler_output
from tests.standin_worker import StandinWorker
from tests.unit.engine_core_support import (
    NUM_PIXEL_BYTES,
    PIXELS,
    add,
    engine_core,
    frames,
    key_only_frames,
    run_until_idle,
)
from wire.protocol import (
    Abort,
    ErrorInfo,
    FinishReason,
    Logprob,
    RequestOutput,
    ResetCaches,
    TensorRef,
    TokenLogprobs,
)

# ---------------------------------------------------------------------------- receiver cache


def test_stored_item_is_resolved_key_only_later_and_encoded_once() -> None:
    core, worker = engine_core()
    assert core.add_request(b"a", add("r1", "X"), frames()) == {}
    cache = core.receiver_caches.for_sender(b"a")
    assert cache.keys() == ["X"] and cache.num_bytes == NUM_PIXEL_BYTES
    run_until_idle(core)

    # the same image again, key only: resolved from the receiver cache, its encoder output reused
    assert core.add_request(b"a", add("r2", "X", with_tensors=False), key_only_frames()) == {}
    request = core.scheduler.requests["r2"]
    item = request.mm_items["X"]
    assert item.dtypes_shapes == {"pixel_values": ("float32", (1, 3, 4, 4))} and item.num_bytes == 192
    outputs = run_until_idle(core)
    assert [o.finish_reason for o in outputs[b"a"]] == [None, FinishReason.LENGTH]

    assert worker.encoder_inputs == ["X"]
    assert worker.tensor_frames == [bytes(NUM_PIXEL_BYTES)]  # the pixel frame crossed once
    first_sched = worker.steps[0].sched
    assert first_sched.encoder_inputs[0].tensors == PIXELS  # renumbered from 1 in the step's frames
    stats = core.stats()
    assert stats.counters["encoder_runs_total"] == 1
    assert stats.counters["encoder_cache_queries_total"] == 2
    assert stats.counters["encoder_cache_hits_total"] == 1


def test_concurrent_requests_with_one_image_share_one_encode() -> None:
    core, worker = engine_core()
    core.add_request(b"a", add("r1", "X"), frames())
    core.add_request(b"a", add("r2", "X", with_tensors=False), key_only_frames())
    outputs = core.step()
    assert [o.req_id for o in outputs[b"a"]] == ["r1", "r2"]
    assert worker.steps[0].sched.num_scheduled_tokens == {"r1": 20, "r2": 20}
    run_until_idle(core)
    assert worker.encoder_inputs == ["X"] and len(worker.tensor_frames) == 1


def test_evictions_are_applied_before_the_features() -> None:
    core, _ = engine_core()
    core.add_request(b"a", add("r1", "X"), frames())
    core.add_request(b"a", add("r2", "Y"), frames())
    cache = core.receiver_caches.for_sender(b"a")
    assert cache.keys() == ["X", "Y"]

    core.add_request(b"a", add("r3", "X", evicted=["X"]), frames())  # evicted, then stored again
    assert cache.keys() == ["Y", "X"] and cache.num_bytes == 2 * NUM_PIXEL_BYTES

    core.add_request(b"a", add("r4", None, evicted=["Y"]), key_only_frames())
    assert cache.keys() == ["X"]

    outputs = core.add_request(b"a", add("r5", "X", with_tensors=False, evicted=["X"]), key_only_frames())
    [out] = outputs[b"a"]
    assert out.req_id == "r5" and out.error is not None and out.error.missing_mm_hashes == ["X"]
    assert cache.keys() == [] and "r5" not in core.scheduler.requests


def test_key_only_feature_missing_from_the_receiver_cache_is_reported() -> None:
    core, _ = engine_core()
    outputs = core.add_request(b"a", add("r1", "X", with_tensors=False), key_only_frames())
    assert list(outputs) == [b"a"]
    [out] = outputs[b"a"]
    assert out.req_id == "r1" and out.finish_reason is FinishReason.ABORT and out.new_token_ids == []
    assert out.error is not None and out.error.code == "mm_cache_miss" and out.error.http_status == 400
    assert out.error.missing_mm_hashes == ["X"]
    assert not core.has_work and core.scheduler.requests == {}
    assert core.stats().counters["mm_ipc_cache_resends_total"] == 1


def test_receiver_cache_is_partitioned_per_sender() -> None:
    core, _ = engine_core()
    assert core.add_request(b"a", add("ra", "X"), frames()) == {}
    outputs = core.add_request(b"b", add("rb", "X", with_tensors=False), key_only_frames())
    [out] = outputs[b"b"]
    assert out.error is not None and out.error.code == "mm_cache_miss"
    assert out.error.missing_mm_hashes == ["X"]
    assert core.receiver_caches.for_sender(b"a").keys() == ["X"]
    assert core.receiver_caches.for_sender(b"b").keys() == []


def test_admission_error_still_applies_the_mirror_operations() -> None:
    core, _ = engine_core(max_model_len=64)
    core.add_request(b"a", add("r0", "OLD"), frames())
    outputs = core.add_request(b"a", add("r1", "X", prompt_len=60, max_tokens=5, evicted=["OLD"]), frames())
    [out] = outputs[b"a"]
    assert out.req_id == "r1" and out.finish_reason is FinishReason.ABORT
    assert out.error is not None and out.error.code == "context_length_exceeded"
    assert "maximum context length is 64" in out.error.message
    # rejected, but the receiver cache followed the mirror: OLD evicted, X stored
    assert core.receiver_caches.for_sender(b"a").keys() == ["X"]
    assert "r1" not in core.scheduler.requests

    outputs = core.add_request(b"a", add("r2", "Y", num_image_tokens=600), frames())
    [out] = outputs[b"a"]
    assert out.error is not None and out.error.code == "mm_item_too_large"
    assert core.receiver_caches.for_sender(b"a").keys() == ["X", "Y"]
    assert list(core.scheduler.requests) == ["r0"]


def test_reset_caches_clears_the_senders_partition_and_freeable_encoder_entries() -> None:
    core, worker = engine_core()
    core.add_request(b"a", add("ra", "X"), frames())
    core.add_request(b"b", add("rb", "Y"), frames())
    run_until_idle(core)
    assert "X" in core.scheduler.encoder_cache and "Y" in core.scheduler.encoder_cache

    assert core.reset_caches(b"a", ResetCaches()) == {}
    assert core.receiver_caches.for_sender(b"a").keys() == []
    assert core.receiver_caches.for_sender(b"b").keys() == ["Y"]
    assert core.step() == {}  # nothing to run, but the worker must drop the evicted tensors
    sched = worker.steps[-1].sched
    assert sched.num_scheduled_tokens == {} and sched.free_mm_hashes == ["X", "Y"]
    assert worker.outputs == {}


# ---------------------------------------------------------------------------- requests and outputs


def test_abort_from_another_client_is_ignored() -> None:
    core, worker = engine_core()
    core.add_request(b"a", add("r1", max_tokens=10), [])
    core.step()
    assert core.abort(b"b", Abort(["r1"])) == {}
    assert "r1" in core.scheduler.requests
    core.step()
    assert worker.steps[-1].sched.num_scheduled_tokens == {"r1": 1}

    # the owner's abort ends it with a final output (the API then releases what the request held)
    assert core.abort(b"a", Abort(["r1", "unknown"])) == {
        b"a": [RequestOutput("r1", finish_reason=FinishReason.ABORT)]
    }
    assert not core.has_work
    assert core.step() == {}
    assert worker.steps[-1].sched.finished_req_ids == ["r1"] and worker.requests == {}


def test_outputs_are_routed_per_client() -> None:
    core, worker = engine_core()
    core.add_request(b"a", add("ra", prompt_len=5, max_tokens=2, num_top_logprobs=0), [])
    core.add_request(b"b", add("rb", prompt_len=7, max_tokens=1), [])
    outputs = core.step()
    assert set(outputs) == {b"a", b"b"}
    [out_a], [out_b] = outputs[b"a"], outputs[b"b"]
    assert (out_a.req_id, out_a.new_token_ids, out_a.finish_reason, out_a.num_prompt_tokens) == (
        "ra",
        [5],  # the stand-in counts on from the prompt's last token
        None,
        5,
    )
    assert (out_b.req_id, out_b.new_token_ids, out_b.finish_reason, out_b.num_prompt_tokens) == (
        "rb",
        [7],
        FinishReason.LENGTH,
        7,
    )
    assert out_a.logprobs == [TokenLogprobs(Logprob(5, -0.5), [])] and out_b.logprobs is None

    outputs = core.step()
    assert list(outputs) == [b"a"]
    [out_a] = outputs[b"a"]
    assert (out_a.new_token_ids, out_a.finish_reason) == ([6], FinishReason.LENGTH)
    assert worker.steps[-1].sched.finished_req_ids == ["rb"]


QUEUE, PREFILL = "request_queue_time_seconds", "request_prefill_time_seconds"


def test_stats_counters_gauges_and_drained_observations() -> None:
    worker = StandinWorker(encoder_seconds=0.25, forward_seconds=0.01, delay_s={1: 0.05, 2: 0.05})
    core, _ = engine_core(worker, max_num_seqs=2, encoder_cache_tokens=100)
    core.add_request(b"a", add("r1", "X", max_tokens=3), frames())
    core.add_request(b"a", add("r2", "X", with_tensors=False, max_tokens=3), key_only_frames())
    core.add_request(b"a", add("r3", prompt_len=4, max_tokens=3), [])
    stats = core.stats()
    assert stats.gauges == {
        "encoder_cache_usage_tokens": 0.0,
        "encoder_cache_capacity_tokens": 100.0,
        "num_requests_running": 0.0,
        "num_requests_waiting": 3.0,
        "kv_cache_usage_ratio": 0.0,
        "num_requests_awaiting_grammar": 0.0,
    }
    assert stats.observations == {}

    core.step()
    core.step()
    stats = core.stats()
    assert stats.counters["engine_steps_total"] == 2
    assert stats.counters["worker_busy_seconds_total"] == pytest.approx(0.1)  # as the worker reported
    assert stats.counters["encoder_runs_total"] == 1
    assert stats.counters["encoder_cache_queries_total"] == 2
    assert stats.counters["encoder_cache_hits_total"] == 1
    assert stats.gauges["encoder_cache_usage_tokens"] == 16.0
    assert (stats.gauges["num_requests_running"], stats.gauges["num_requests_waiting"]) == (2.0, 1.0)
    # r1 and r2 ran at once, in the first step, which took the worker 50 ms; their first tokens came
    # with its answer
    queued, prefill = (stats.observations.pop(k) for k in (QUEUE, PREFILL))
    assert len(queued) == 2 and all(0 <= t < 0.05 for t in queued), queued
    assert len(prefill) == 2 and all(t >= 0.05 for t in prefill), prefill
    assert stats.observations == {
        "num_requests_per_step": [2, 2],
        "num_batched_tokens_per_step": [40, 2],
        "encoder_seconds": [0.25],
        "forward_seconds": [0.01, 0.01],
    }
    assert core.stats().observations == {}  # drained by the previous snapshot

    run_until_idle(core)
    stats = core.stats()
    assert stats.counters["engine_steps_total"] == 6
    assert stats.observations["num_requests_per_step"] == [2, 1, 1, 1]
    # r3 waited for a slot through both 50 ms steps
    [r3_queued], [r3_prefill] = stats.observations[QUEUE], stats.observations[PREFILL]
    assert r3_queued >= 0.1 and r3_prefill >= 0, (r3_queued, r3_prefill)
    assert (stats.gauges["num_requests_running"], stats.gauges["num_requests_waiting"]) == (0.0, 0.0)


def test_to_scheduler_output_numbers_tensor_frames_from_one() -> None:
    a0, a1, b0 = memoryview(b"a0"), memoryview(b"a1-"), memoryview(b"b0--")
    item_a = MMItem(
        "image",
        4,
        dtypes_shapes={"pixel_values": ("float32", (1, 2)), "image_sizes": ("int64", (1, 2))},
        buffers={"pixel_values": a0, "image_sizes": a1},
    )
    item_b = MMItem("image", 6, {"pixel_values": ("bfloat16", (3,))}, {"pixel_values": b0})
    plan = StepPlan(
        step_id=7,
        new_requests=[],
        num_scheduled_tokens={"r1": 10},
        encoder_items=[("A", item_a), ("B", item_b)],
        free_mm_hashes=["Z"],
        finished_req_ids=["r0"],
    )
    sched, out_frames = to_scheduler_output(
        plan, KVCacheManager(num_blocks=4, block_size=16, enable_prefix_caching=False)
    )
    assert [(e.mm_hash, e.modality, e.tensors) for e in sched.encoder_inputs] == [
        (
            "A",
            "image",
            {
                "pixel_values": TensorRef("float32", (1, 2), 1),
                "image_sizes": TensorRef("int64", (1, 2), 2),
            },
        ),
        ("B", "image", {"pixel_values": TensorRef("bfloat16", (3,), 3)}),
    ]
    assert len(out_frames) == 3
    assert all(got is want for got, want in zip(out_frames, [a0, a1, b0], strict=True))  # no copies
    assert (sched.step_id, sched.num_scheduled_tokens, sched.free_mm_hashes, sched.finished_req_ids) == (
        7,
        {"r1": 10},
        ["Z"],
        ["r0"],
    )


# ---------------------------------------------------------------------------- faults


def test_failed_step_fails_its_requests_and_a_retry_recomputes_everything() -> None:
    worker = StandinWorker(block_size=4, fail_steps={1: "CUDA error"})
    core, _ = engine_core(worker, enable_prefix_caching=True)
    core.add_request(b"a", add("r1", "X"), frames())
    outputs = core.step()
    [out] = outputs[b"a"]
    assert out.req_id == "r1" and out.finish_reason is FinishReason.ABORT and out.new_token_ids == []
    assert out.error is not None and out.error.code == "internal_error" and out.error.http_status == 500
    assert "CUDA error" in out.error.message
    assert not core.has_work and core.stats().counters["engine_failed_steps_total"] == 1

    # the same prompt and image again (key only: the receiver cache kept the item)
    core.add_request(b"a", add("r2", "X", with_tensors=False), key_only_frames())
    outputs = run_until_idle(core)
    sched = worker.steps[1].sched
    assert sched.new_requests[0].num_computed_tokens == 0  # no prefix hit on the failed step's blocks
    assert [e.mm_hash for e in sched.encoder_inputs] == ["X"]  # encoded again
    assert sched.free_mm_hashes == ["X"] and sched.finished_req_ids == ["r1"]  # the worker forgets too
    assert outputs[b"a"][0].num_cached_tokens == 0 and outputs[b"a"][-1].finish_reason is FinishReason.LENGTH

    core.add_request(b"a", add("r3", "X", with_tensors=False), key_only_frames())
    run_until_idle(core)
    sched = [s for s, _ in worker.steps if "r3" in s.num_scheduled_tokens][0]
    # r2's blocks do hit: its 4 full ones and 3 tokens of its 5th, copied (the last token is computed)
    assert sched.new_requests[0].num_computed_tokens == 19
    [(source, destination, num_copied)] = sched.kv_copies
    assert num_copied == 3 and source != destination and destination == sched.new_requests[0].block_ids[4]
    assert sched.encoder_inputs == []


def test_failed_step_spares_requests_it_did_not_run() -> None:
    core, _ = engine_core(StandinWorker(fail_steps={1: "CUDA error"}), max_num_seqs=1)
    core.add_request(b"a", add("r1", None), frames())
    core.add_request(b"b", add("r2", None), frames())
    outputs = core.step()
    assert list(outputs) == [b"a"] and outputs[b"a"][0].error is not None
    outputs = run_until_idle(core)
    assert list(outputs) == [b"b"] and all(o.error is None for o in outputs[b"b"])
    assert outputs[b"b"][-1].finish_reason is FinishReason.LENGTH


def test_lost_worker_propagates_and_fail_all_ends_every_request() -> None:
    core, _ = engine_core(StandinWorker(lose_steps={2}), max_num_seqs=1)
    core.add_request(b"a", add("r1", "X", max_tokens=5), frames())
    core.add_request(b"b", add("r2", None), frames())
    core.step()
    with pytest.raises(WorkerLost):
        core.step()
    error = ErrorInfo("The model worker is unavailable.", "worker_unavailable", http_status=503)
    outputs = core.fail_all(error)
    assert outputs == {
        b"a": [RequestOutput("r1", finish_reason=FinishReason.ABORT, error=error)],
        b"b": [RequestOutput("r2", finish_reason=FinishReason.ABORT, error=error)],  # it was waiting
    }
    assert not core.has_work and core.stats().gauges["num_requests_running"] == 0


def test_drain_refuses_new_requests_after_applying_their_mirror_decisions() -> None:
    core, _ = engine_core()
    core.add_request(b"a", add("r1", "X", max_tokens=3), frames())
    core.step()
    core.drain()
    [out] = core.add_request(b"a", add("r2", "Y", evicted=["X"]), frames())[b"a"]
    assert out.req_id == "r2" and out.error is not None
    assert (out.error.code, out.error.http_status) == ("server_shutting_down", 503)
    assert core.receiver_caches.for_sender(b"a").keys() == ["Y"]
    outputs = run_until_idle(core)  # the request held runs to the end
    assert outputs[b"a"][-1].req_id == "r1" and outputs[b"a"][-1].finish_reason is FinishReason.LENGTH


def test_messages_taken_in_while_a_step_is_in_flight() -> None:
    """``launch`` sends without waiting; until ``finish`` the engine takes in messages: an abort of a
    request in the step ends it at once (the step's token for it is dropped, its blocks are reused only
    by a later step), a new request joins the step after, and ``finish`` gives the step's outputs."""
    worker = StandinWorker()
    core, _ = engine_core(worker)
    core.add_request(b"a", add("r1", prompt_len=4, max_tokens=3), [])
    core.add_request(b"a", add("r2", prompt_len=4, max_tokens=3), [])
    core.step()  # both prefilled, one token each
    launched = core.launch()
    assert launched.sent and worker.steps[-1].sched.num_scheduled_tokens == {"r1": 1, "r2": 1}
    assert core.abort(b"a", Abort(["r2"])) == {b"a": [RequestOutput("r2", finish_reason=FinishReason.ABORT)]}
    core.add_request(b"a", add("r3", prompt_len=4, max_tokens=1), [])
    outputs = core.finish(launched)
    assert [(o.req_id, len(o.new_token_ids)) for o in outputs[b"a"]] == [("r1", 1)]  # nothing for r2
    core.step()
    sched = worker.steps[-1].sched
    assert sched.finished_req_ids == ["r2"] and [r.req_id for r in sched.new_requests] == ["r3"]
