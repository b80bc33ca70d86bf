"""The encoder-only instance's scheduler (``--encoder-only``) over a real shared-storage store: every item
of a request is encoded once (or found in the store) and saved, and the request ends without a token in
the step that completed it; FCFS under the compute budget; abort, failed steps and admission."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

from engine.core import EngineCore
from engine.ec_connector import ECConnectorScheduler
from engine.encode_scheduler import EncodeOnlyScheduler
from engine.step_plan import StepPlan, StepResult
from tests.standin_worker import StandinWorker
from tests.unit.engine_core_support import PIXELS, engine_core, frames
from tests.unit.scheduler_support import config, encoded, make_request, run_step
from wire.ec_store import ECRole
from wire.ec_store.shared_storage import SharedStorageStore
from wire.protocol import (
    Abort,
    AddRequest,
    FinishReason,
    MMFeature,
    RequestOutput,
    SamplingParams,
)


@pytest.fixture
def store(tmp_path: Path) -> SharedStorageStore:
    return SharedStorageStore(tmp_path / "ec", max_bytes=0)


def encoder(
    store: SharedStorageStore, role: ECRole = ECRole.PRODUCER, **overrides: int
) -> EncodeOnlyScheduler:
    return EncodeOnlyScheduler(config(**overrides), ECConnectorScheduler(store, role))


def finished(result: StepResult) -> list[tuple[str, FinishReason | None, list[int]]]:
    return [(r.req_id, r.finish_reason, r.output_token_ids) for r in result.finished]


def saves(plan: StepPlan) -> list[str]:
    return plan.ec_meta.save_mm_hashes if plan.ec_meta is not None else []


# ---------------------------------------------------------------------------- scheduling


def test_items_are_encoded_once_and_the_request_ends_in_that_step(store: SharedStorageStore) -> None:
    s = encoder(store)
    s.add_request(make_request("r1", 80, images=[("a", 5, 20), ("b", 30, 20), ("a", 55, 20)]))
    plan, result = run_step(s)
    assert encoded(plan) == ["a", "b"] and plan.num_scheduled_tokens == {"r1": 0}
    assert plan.new_requests == [] and plan.load_mm_hashes == []
    assert finished(result) == [("r1", FinishReason.LENGTH, [])]
    assert not s.has_work and s.requests == {}
    assert s.encoder_cache.num_used_tokens == 40  # kept (freeable) for the next request


def test_an_item_already_in_the_store_is_not_encoded(store: SharedStorageStore) -> None:
    store.put("a", b"encoded by another producer")
    s = encoder(store)
    s.add_request(make_request("r1", 60, images=[("a", 5, 20), ("b", 30, 20)]))
    plan, result = run_step(s)
    assert encoded(plan) == ["b"] and saves(plan) == []
    assert finished(result) == [("r1", FinishReason.LENGTH, [])]


def test_a_cached_item_the_store_lost_is_saved_again(store: SharedStorageStore) -> None:
    s = encoder(store)
    s.add_request(make_request("r1", 30, images=[("a", 5, 20)]))
    run_step(s)
    assert store.get("a") == b"output of a"  # saved by the (stand-in) worker

    s.add_request(make_request("r2", 30, images=[("a", 5, 20)]))
    plan, result = run_step(s)  # in the cache and in the store: nothing to do
    assert plan.encoder_items == [] and plan.ec_meta is None and finished(result)[0][0] == "r2"

    store.path("a").unlink()  # evicted from the store; the worker still holds the output
    s.add_request(make_request("r3", 30, images=[("a", 5, 20)]))
    plan, result = run_step(s)
    assert plan.encoder_items == [] and saves(plan) == ["a"]
    assert store.get("a") == b"output of a"  # saved again from the worker's encoder store
    assert finished(result) == [("r3", FinishReason.LENGTH, [])]


def test_the_compute_budget_splits_a_request_and_later_requests_do_not_overtake(
    store: SharedStorageStore,
) -> None:
    s = encoder(store, encoder_compute_budget_tokens=400)
    s.add_request(make_request("r1", 700, images=[("a", 0, 300), ("b", 350, 300)]))
    s.add_request(make_request("r2", 120, images=[("c", 0, 100)]))  # would fit the 100 left in step 1
    plan, result = run_step(s)
    assert encoded(plan) == ["a"] and plan.num_scheduled_tokens == {"r1": 0} and result.finished == []
    assert s.num_running == 1 and s.num_waiting == 1

    plan, result = run_step(s)
    assert encoded(plan) == ["b", "c"] and plan.num_scheduled_tokens == {"r1": 0, "r2": 0}
    assert [r.req_id for r in result.finished] == ["r1", "r2"]


def test_max_num_seqs_bounds_the_requests_of_a_step(store: SharedStorageStore) -> None:
    s = encoder(store, max_num_seqs=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 30, images=[(f"h{i}", 5, 20)]))
    plan, result = run_step(s)
    assert encoded(plan) == ["h0", "h1"] and len(result.finished) == 2
    plan, result = run_step(s)
    assert encoded(plan) == ["h2"] and [r.req_id for r in result.finished] == ["r2"]


def test_a_text_only_request_ends_in_its_first_step(store: SharedStorageStore) -> None:
    s = encoder(store)
    s.add_request(make_request("r1", 30))
    plan, result = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 0} and finished(result) == [("r1", FinishReason.LENGTH, [])]


def test_abort_releases_what_the_request_held(store: SharedStorageStore) -> None:
    s = encoder(store, encoder_compute_budget_tokens=400)
    s.add_request(make_request("r1", 700, images=[("a", 0, 300), ("b", 350, 300)]))
    run_step(s)  # "a" encoded, "b" waits
    aborted = s.abort("r1")
    assert aborted is not None and aborted.finish_reason is FinishReason.ABORT
    assert s.abort("r1") is None and not s.has_work
    assert list(s.encoder_cache._freeable) == ["a"]  # no user left: reusable, evictable

    s.add_request(make_request("r2", 30, images=[("b", 5, 300)]))
    plan, _ = run_step(s)
    assert encoded(plan) == ["b"]


def test_a_failed_step_fails_its_requests_and_forgets_its_encodes(store: SharedStorageStore) -> None:
    s = encoder(store)
    s.add_request(make_request("r1", 30, images=[("a", 5, 20)]))
    s.add_request(make_request("r2", 30, images=[("b", 5, 20)]))
    plan = s.schedule()
    failed = s.fail_step(plan)
    assert [(r.req_id, r.finish_reason) for r in failed] == [
        ("r1", FinishReason.ABORT),
        ("r2", FinishReason.ABORT),
    ]
    assert not s.has_work and "a" not in s.encoder_cache and "b" not in s.encoder_cache

    s.add_request(make_request("r3", 30, images=[("a", 5, 20)]))
    plan, result = run_step(s)
    assert plan.free_mm_hashes == ["a", "b"] and encoded(plan) == ["a"]  # the worker drops, then encodes
    assert finished(result)[0][:2] == ("r3", FinishReason.LENGTH)


def test_admission_refuses_an_item_over_the_budgets(store: SharedStorageStore) -> None:
    s = encoder(store, encoder_compute_budget_tokens=400, encoder_cache_tokens=300, max_model_len=64)
    error = s.admission_error(10, 1, [500])
    assert error is not None and error.code == "mm_item_too_large" and error.http_status == 400
    assert "--encoder-compute-budget-tokens" in error.message
    error = s.admission_error(10, 1, [350])
    assert error is not None and "--encoder-cache-tokens" in error.message
    assert s.admission_error(1000, 1, [300]) is None  # no language model here: no context length limit
    assert encoder(store, encoder_cache_tokens=0).admission_error(10, 1, [2048]) is None  # cache off


def test_a_full_queue_is_refused_with_429(store: SharedStorageStore) -> None:
    s = encoder(store, max_waiting_requests=1)
    s.add_request(make_request("r1", 30))
    error = s.admission_error(10, 1, [])
    assert error is not None and (error.code, error.http_status) == ("too_many_requests", 429)


def test_a_waiting_item_is_one_encoder_cache_query(store: SharedStorageStore) -> None:
    s = encoder(store, encoder_compute_budget_tokens=400)
    s.add_request(make_request("r1", 700, images=[("a", 0, 300), ("b", 350, 300)]))
    run_step(s)
    run_step(s)
    assert s.encoder_cache.num_queries == 2


# ---------------------------------------------------------------------------- engine core


def add(req_id: str, *mm_hashes: str) -> AddRequest:
    features = [MMFeature(h, 2 + 20 * i, 16, tensors=PIXELS) for i, h in enumerate(mm_hashes)]
    return AddRequest(req_id, list(range(2 + 20 * len(mm_hashes))), SamplingParams(max_tokens=16), features)


def encode_only_core(
    store: SharedStorageStore, fail_steps: Mapping[int, str] | None = None
) -> tuple[EngineCore, StandinWorker]:
    """An --encoder-only instance: its worker has no language model and saves what it encodes; a
    failing step fails in the encoder (nothing saved)."""
    worker = StandinWorker(
        has_language_model=False,
        ec_store=store,
        ec_role=ECRole.PRODUCER,
        fail_steps=fail_steps,
        fail_stage="encoder",
    )
    return engine_core(worker, ECConnectorScheduler(store, ECRole.PRODUCER))


def test_engine_answers_once_the_items_are_in_the_store(store: SharedStorageStore) -> None:
    core, worker = encode_only_core(store)
    assert core.add_request(b"a", add("r1", "X", "Y"), frames()) == {}
    outputs = core.step()
    assert outputs == {b"a": [RequestOutput("r1", [], None, FinishReason.LENGTH, num_prompt_tokens=42)]}
    assert store.get("X") == b"output of X" and store.get("Y") == b"output of Y"
    assert [e.mm_hash for e in worker.steps[0].sched.encoder_inputs] == ["X", "Y"]
    assert not core.has_work and core.stats().counters["encoder_runs_total"] == 2


def test_engine_abort_and_failed_step(store: SharedStorageStore) -> None:
    core, worker = encode_only_core(store, fail_steps={1: "CUDA error"})
    core.add_request(b"a", add("r1", "X"), frames())
    [out] = core.step()[b"a"]
    assert out.finish_reason is FinishReason.ABORT and out.error is not None and out.error.http_status == 500
    assert store.exists(["X"]) == [False]

    core.add_request(b"a", add("r2", "X"), frames())
    core.add_request(b"b", add("r3", "Z"), frames())
    assert core.abort(b"b", Abort(["r3"])) == {b"b": [RequestOutput("r3", finish_reason=FinishReason.ABORT)]}
    [out] = core.step()[b"a"]
    assert out.req_id == "r2" and out.finish_reason is FinishReason.LENGTH and out.error is None
    assert [e.mm_hash for e in worker.steps[1].sched.encoder_inputs] == ["X"]  # encoded again, Z never
    assert store.exists(["X", "Z"]) == [True, False]
