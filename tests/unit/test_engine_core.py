"""EngineCore with an in-test executor (a deterministic stand-in for the worker process): admission
through the per-sender receiver cache, the mirror's operations applied before any rejection, routing of
outputs per client, stats, and the wire form of a step."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import pytest

from engine.core import EngineCore, to_scheduler_output
from engine.executor import WorkerFailed, WorkerLost
from engine.kv_cache_manager import KVCacheManager
from engine.protocol import (
    Abort,
    AddRequest,
    ErrorInfo,
    FinishReason,
    Logprob,
    MMFeature,
    RequestOutput,
    ResetCaches,
    RunnerOutput,
    SamplingParams,
    SchedulerOutput,
    TensorRef,
    TokenLogprobs,
)
from engine.request import MMItem
from engine.scheduler import SchedulerConfig, StepPlan

PIXELS = {"pixel_values": TensorRef("float32", (1, 3, 4, 4), 1)}
NUM_PIXEL_BYTES = 1 * 3 * 4 * 4 * 4  # 192


def config(**overrides: int | bool) -> SchedulerConfig:
    values = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "max_model_len": 512,
        "encoder_cache_tokens": 1024,
        "encoder_compute_budget_tokens": 512,
        "num_kv_blocks": 1024,  # far more than any test needs
        "enable_prefix_caching": False,
    }
    values.update(overrides)
    return SchedulerConfig(**values)


class RecordingExecutor:
    """Stands in for the worker: records every step and samples ``1000 * step_id + position`` for each
    request whose known tokens are all computed after the step."""

    def __init__(self) -> None:
        self.steps: list[tuple[SchedulerOutput, list[bytes]]] = []
        self.num_tokens: dict[str, int] = {}
        self.num_computed: dict[str, int] = {}
        self.store: set[str] = set()  # the encoder store, by mm_hash

    def execute(self, sched: SchedulerOutput, frames: Sequence[memoryview]) -> RunnerOutput:
        self.steps.append((sched, [bytes(f) for f in frames]))
        for req_id in sched.finished_req_ids:
            del self.num_tokens[req_id], self.num_computed[req_id]
        self.store.difference_update(sched.free_mm_hashes)
        for new in sched.new_requests:
            self.num_tokens[new.req_id] = len(new.prompt_token_ids)
            self.num_computed[new.req_id] = new.num_computed_tokens
        for enc in sched.encoder_inputs:
            assert enc.mm_hash not in self.store
            assert all(1 <= ref.frame <= len(frames) for ref in enc.tensors.values())
            self.store.add(enc.mm_hash)
        req_ids = []
        for req_id, num_tokens in sched.num_scheduled_tokens.items():
            self.num_computed[req_id] += num_tokens
            if self.num_computed[req_id] >= self.num_tokens[req_id]:
                req_ids.append(req_id)
                self.num_tokens[req_id] += 1
        token_ids = [1000 * sched.step_id + i for i in range(len(req_ids))]
        return RunnerOutput(
            step_id=sched.step_id,
            req_ids=req_ids,
            sampled_token_ids=token_ids,
            logprobs=[TokenLogprobs(Logprob(t, -0.5), []) for t in token_ids],
            num_encoded_items=len(sched.encoder_inputs),
            encoder_seconds=0.25 if sched.encoder_inputs else 0.0,
            forward_seconds=0.01,
        )

    @property
    def encoder_inputs(self) -> list[str]:
        return [enc.mm_hash for sched, _ in self.steps for enc in sched.encoder_inputs]

    @property
    def tensor_frames(self) -> list[bytes]:
        return [frame for _, frames in self.steps for frame in frames]


def frames() -> list[memoryview]:
    """The frames of an AddRequest with one image: the message, then the pixel bytes (frame 1)."""
    return [b"msg", memoryview(bytes(NUM_PIXEL_BYTES))]  # type: ignore[list-item]


def key_only_frames() -> list[memoryview]:
    return [b"msg"]  # type: ignore[list-item]


def add(
    req_id: str,
    mm_hash: str | None = None,
    *,
    with_tensors: bool = True,
    store: bool = True,
    prompt_len: int = 20,
    max_tokens: int = 2,
    num_image_tokens: int = 16,
    evicted: Sequence[str] = (),
) -> AddRequest:
    features = []
    if mm_hash is not None:
        features.append(
            MMFeature(
                mm_hash,
                offset=2,
                num_tokens=num_image_tokens,
                tensors=PIXELS if with_tensors else None,
                store=store and with_tensors,
            )
        )
    return AddRequest(
        req_id=req_id,
        prompt_token_ids=list(range(prompt_len)),
        sampling=SamplingParams(max_tokens=max_tokens),
        mm_features=features,
        evicted_mm_hashes=list(evicted),
    )


def run_until_idle(core: EngineCore) -> dict[bytes, list[RequestOutput]]:
    """Steps until no request is left; all outputs per client, in step order."""
    outputs: dict[bytes, list[RequestOutput]] = {}
    for _ in range(100):
        if not core.has_work:
            return outputs
        for client, outs in core.step().items():
            outputs.setdefault(client, []).extend(outs)
    raise AssertionError("engine did not drain")


# ---------------------------------------------------------------------------- receiver cache


def test_stored_item_is_resolved_key_only_later_and_encoded_once() -> None:
    executor = RecordingExecutor()
    core = EngineCore(config(), executor)
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

    assert executor.encoder_inputs == ["X"]
    assert executor.tensor_frames == [bytes(NUM_PIXEL_BYTES)]  # the pixel frame crossed once
    first_sched = executor.steps[0][0]
    assert first_sched.encoder_inputs[0].tensors == PIXELS  # renumbered from 1 in the step's frames
    stats = core.stats()
    assert stats.counters["encoder_runs_total"] == 1
    assert stats.counters["encoder_cache_queries_total"] == 2
    assert stats.counters["encoder_cache_hits_total"] == 1


def test_concurrent_requests_with_one_image_share_one_encode() -> None:
    executor = RecordingExecutor()
    core = EngineCore(config(), executor)
    core.add_request(b"a", add("r1", "X"), frames())
    core.add_request(b"a", add("r2", "X", with_tensors=False), key_only_frames())
    outputs = core.step()
    assert [o.req_id for o in outputs[b"a"]] == ["r1", "r2"]
    assert executor.steps[0][0].num_scheduled_tokens == {"r1": 20, "r2": 20}
    run_until_idle(core)
    assert executor.encoder_inputs == ["X"] and len(executor.tensor_frames) == 1


def test_evictions_are_applied_before_the_features() -> None:
    core = EngineCore(config(), RecordingExecutor())
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
    core = EngineCore(config(), RecordingExecutor())
    outputs = core.add_request(b"a", add("r1", "X", with_tensors=False), key_only_frames())
    assert list(outputs) == [b"a"]
    [out] = outputs[b"a"]
    assert out.req_id == "r1" and out.finish_reason is FinishReason.ABORT and out.new_token_ids == []
    assert out.error is not None and out.error.code == "mm_cache_miss" and out.error.http_status == 400
    assert out.error.missing_mm_hashes == ["X"]
    assert not core.has_work and core.scheduler.requests == {}
    assert core.stats().counters["mm_ipc_cache_resends_total"] == 1


def test_receiver_cache_is_partitioned_per_sender() -> None:
    core = EngineCore(config(), RecordingExecutor())
    assert core.add_request(b"a", add("ra", "X"), frames()) == {}
    outputs = core.add_request(b"b", add("rb", "X", with_tensors=False), key_only_frames())
    [out] = outputs[b"b"]
    assert out.error is not None and out.error.code == "mm_cache_miss"
    assert out.error.missing_mm_hashes == ["X"]
    assert core.receiver_caches.for_sender(b"a").keys() == ["X"]
    assert core.receiver_caches.for_sender(b"b").keys() == []


def test_admission_error_still_applies_the_mirror_operations() -> None:
    core = EngineCore(config(max_model_len=64), RecordingExecutor())
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
    executor = RecordingExecutor()
    core = EngineCore(config(), executor)
    core.add_request(b"a", add("ra", "X"), frames())
    core.add_request(b"b", add("rb", "Y"), frames())
    run_until_idle(core)
    assert "X" in core.scheduler.encoder_cache and "Y" in core.scheduler.encoder_cache

    assert core.reset_caches(b"a", ResetCaches()) == {}
    assert core.receiver_caches.for_sender(b"a").keys() == []
    assert core.receiver_caches.for_sender(b"b").keys() == ["Y"]
    assert core.step() == {}  # nothing to run, but the worker must drop the evicted tensors
    sched = executor.steps[-1][0]
    assert sched.num_scheduled_tokens == {} and sched.free_mm_hashes == ["X", "Y"]
    assert executor.store == set()


# ---------------------------------------------------------------------------- requests and outputs


def test_abort_from_another_client_is_ignored() -> None:
    executor = RecordingExecutor()
    core = EngineCore(config(), executor)
    core.add_request(b"a", add("r1", max_tokens=10), [])
    core.step()
    assert core.abort(b"b", Abort(["r1"])) == {}
    assert "r1" in core.scheduler.requests
    core.step()
    assert executor.steps[-1][0].num_scheduled_tokens == {"r1": 1}

    # the owner's abort ends it with a final output (the API then releases what the request held)
    assert core.abort(b"a", Abort(["r1", "unknown"])) == {
        b"a": [RequestOutput("r1", finish_reason=FinishReason.ABORT)]
    }
    assert not core.has_work
    assert core.step() == {}
    assert executor.steps[-1][0].finished_req_ids == ["r1"] and executor.num_tokens == {}


def test_outputs_are_routed_per_client() -> None:
    executor = RecordingExecutor()
    core = EngineCore(config(), executor)
    core.add_request(b"a", add("ra", prompt_len=5, max_tokens=2), [])
    core.add_request(b"b", add("rb", prompt_len=7, max_tokens=1), [])
    outputs = core.step()
    assert set(outputs) == {b"a", b"b"}
    [out_a], [out_b] = outputs[b"a"], outputs[b"b"]
    assert (out_a.req_id, out_a.new_token_ids, out_a.finish_reason, out_a.num_prompt_tokens) == (
        "ra",
        [1000],
        None,
        5,
    )
    assert (out_b.req_id, out_b.new_token_ids, out_b.finish_reason, out_b.num_prompt_tokens) == (
        "rb",
        [1001],
        FinishReason.LENGTH,
        7,
    )
    assert out_a.logprobs == [TokenLogprobs(Logprob(1000, -0.5), [])]

    outputs = core.step()
    assert list(outputs) == [b"a"]
    [out_a] = outputs[b"a"]
    assert (out_a.new_token_ids, out_a.finish_reason) == ([2000], FinishReason.LENGTH)
    assert executor.steps[-1][0].finished_req_ids == ["rb"]


def test_stats_counters_gauges_and_drained_observations() -> None:
    core = EngineCore(config(max_num_seqs=2, encoder_cache_tokens=100), RecordingExecutor())
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
    }
    assert stats.observations == {}

    core.step()
    core.step()
    stats = core.stats()
    assert stats.counters["engine_steps_total"] == 2
    assert stats.counters["encoder_runs_total"] == 1
    assert stats.counters["encoder_cache_queries_total"] == 2
    assert stats.counters["encoder_cache_hits_total"] == 1
    assert stats.gauges["encoder_cache_usage_tokens"] == 16.0
    assert (stats.gauges["num_requests_running"], stats.gauges["num_requests_waiting"]) == (2.0, 1.0)
    assert stats.observations == {
        "num_requests_per_step": [2, 2],
        "num_batched_tokens_per_step": [40, 2],
        "encoder_seconds": [0.25],
    }
    assert core.stats().observations == {}  # drained by the previous snapshot

    run_until_idle(core)
    stats = core.stats()
    assert stats.counters["engine_steps_total"] == 6
    assert stats.observations["num_requests_per_step"] == [2, 1, 1, 1]
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


class FailingExecutor(RecordingExecutor):
    """Runs a step like the worker would, up to its encodes included, then fails the steps listed in
    ``fail`` (``WorkerFailed``) or ``lose`` (``WorkerLost``)."""

    def __init__(self, fail: Collection[int] = (), lose: Collection[int] = ()) -> None:
        super().__init__()
        self.fail, self.lose = fail, lose

    def execute(self, sched: SchedulerOutput, frames: Sequence[memoryview]) -> RunnerOutput:
        if sched.step_id in self.lose:
            raise WorkerLost("the worker's connection closed")
        output = super().execute(sched, frames)
        if sched.step_id in self.fail:
            raise WorkerFailed(f"worker failed step {sched.step_id}: CUDA error")
        return output


def test_failed_step_fails_its_requests_and_a_retry_recomputes_everything() -> None:
    executor = FailingExecutor(fail={1})
    core = EngineCore(config(enable_prefix_caching=True, block_size=4), executor)
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
    sched = executor.steps[1][0]
    assert sched.new_requests[0].num_computed_tokens == 0  # no prefix hit on the failed step's blocks
    assert [e.mm_hash for e in sched.encoder_inputs] == ["X"]  # encoded again
    assert sched.free_mm_hashes == ["X"] and sched.finished_req_ids == ["r1"]  # the worker forgets too
    assert outputs[b"a"][0].num_cached_tokens == 0 and outputs[b"a"][-1].finish_reason is FinishReason.LENGTH

    core.add_request(b"a", add("r3", "X", with_tensors=False), key_only_frames())
    run_until_idle(core)
    sched = [s for s, _ in executor.steps if "r3" in s.num_scheduled_tokens][0]
    assert sched.new_requests[0].num_computed_tokens == 16  # r2's blocks do hit (4 full of 20 tokens)
    assert sched.encoder_inputs == []


def test_failed_step_spares_requests_it_did_not_run() -> None:
    core = EngineCore(config(max_num_seqs=1), FailingExecutor(fail={1}))
    core.add_request(b"a", add("r1", None), frames())
    core.add_request(b"b", add("r2", None), frames())
    outputs = core.step()
    assert list(outputs) == [b"a"] and outputs[b"a"][0].error is not None
    outputs = run_until_idle(core)
    assert list(outputs) == [b"b"] and all(o.error is None for o in outputs[b"b"])
    assert outputs[b"b"][-1].finish_reason is FinishReason.LENGTH


def test_lost_worker_propagates_and_fail_all_ends_every_request() -> None:
    core = EngineCore(config(max_num_seqs=1), FailingExecutor(lose={2}))
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
    core = EngineCore(config(), RecordingExecutor())
    core.add_request(b"a", add("r1", "X", max_tokens=3), frames())
    core.step()
    core.drain()
    [out] = core.add_request(b"a", add("r2", "Y", evicted=["X"]), frames())[b"a"]
    assert out.req_id == "r2" and out.error is not None
    assert (out.error.code, out.error.http_status) == ("server_shutting_down", 503)
    assert core.receiver_caches.for_sender(b"a").keys() == ["Y"]
    outputs = run_until_idle(core)  # the request held runs to the end
    assert outputs[b"a"][-1].req_id == "r1" and outputs[b"a"][-1].finish_reason is FinishReason.LENGTH
