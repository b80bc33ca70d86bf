"""The scheduler with the encoder-cache connector over a real shared-storage store: an item the store
holds is loaded instead of encoded (no compute budget spent), the store is asked once per request, an
item that can be neither loaded nor encoded ends its request (503) without blocking the queue, a failed
step forgets its loads, and an unreachable store means "encode locally". Then the engine core's 503s."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from engine.core import ENCODER_OUTPUT_UNAVAILABLE, EngineCore
from engine.ec_connector import ECConnectorScheduler
from engine.scheduler import Scheduler
from tests.standin_worker import StandinWorker
from tests.unit.engine_core_support import PIXELS, add, engine_core, frames, key_only_frames, run_until_idle
from tests.unit.scheduler_support import config, encoded, make_request, new_ids, run_step
from wire.ec_store import ECConfig, ECRole
from wire.ec_store.reconnecting import ReconnectingStore
from wire.ec_store.shared_storage import SharedStorageStore
from wire.protocol import AddRequest, FinishReason, MMFeature, SamplingParams


class CountingStore(SharedStorageStore):
    """The real folder store, recording the key lists it was asked about; ``lose_before_load`` keys
    vanish when next read (evicted between the scheduler's lookup and the worker's load)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder, max_bytes=0)
        self.calls: list[list[str]] = []
        self.lose_before_load: set[str] = set()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.calls.append(list(keys))
        return super().exists(keys)

    def get(self, key: str) -> bytes | None:
        if key in self.lose_before_load:
            self.lose_before_load.discard(key)
            self.path(key).unlink()
        return super().get(key)


@pytest.fixture
def store(tmp_path: Path) -> CountingStore:
    return CountingStore(tmp_path / "ec")


def consumer(
    store: CountingStore, *, can_encode: bool, role: ECRole = ECRole.CONSUMER, **overrides
) -> Scheduler:
    return Scheduler(config(can_encode=can_encode, **overrides), ECConnectorScheduler(store, role))


# ---------------------------------------------------------------------------- loads


def test_a_stored_item_loads_in_the_step_even_past_the_compute_budget(store: CountingStore) -> None:
    store.put("b", b"encoded elsewhere")
    s = consumer(store, can_encode=True, encoder_compute_budget_tokens=600)
    s.add_request(make_request("r1", 596, images=[("a", 10, 576)]))
    s.add_request(make_request("r2", 596, images=[("b", 10, 576)]))
    plan, _ = run_step(s)
    # "a" took 576 of the 600 budget; "b" needs no budget: both requests run their whole prompt
    assert plan.num_scheduled_tokens == {"r1": 596, "r2": 596}
    assert (
        plan.ec_meta is not None
        and plan.ec_meta.load_mm_hashes == ["b"]
        and plan.ec_meta.save_mm_hashes == []
    )
    # with a vision tower here, "b"'s tensors come along: encoded if its load fails
    assert encoded(plan) == ["a", "b"]
    assert plan.encoder_items[1][1] is s.requests["r2"].mm_items["b"]


def test_without_a_vision_tower_a_stored_item_loads_and_is_never_sent_to_encode(store: CountingStore) -> None:
    store.put("a", b"v")
    store.put("b", b"v")
    s = consumer(store, can_encode=False, encoder_compute_budget_tokens=600)
    s.add_request(make_request("r1", 596, images=[("a", 10, 576)]))
    s.add_request(make_request("r2", 596, images=[("b", 10, 576)]))
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"r1": 596, "r2": 596}
    assert plan.load_mm_hashes == ["a", "b"] and plan.encoder_items == []
    assert s.encoder_cache.num_used_tokens == 2 * 576

    # held by the encoder cache now: a later request shares it, no lookup and no load
    s.add_request(make_request("r3", 596, images=[("b", 10, 576)]))
    plan, _ = run_step(s)
    assert "r3" in plan.num_scheduled_tokens and plan.ec_meta is None
    assert store.calls == [["a"], ["b"]]


def test_an_item_neither_stored_nor_encodable_ends_its_request_and_the_queue_moves_on(
    store: CountingStore,
) -> None:
    store.put("b", b"v")
    s = consumer(store, can_encode=False)
    s.add_request(make_request("r1", 40, images=[("a", 10, 20)]))
    s.add_request(make_request("r2", 40, images=[("b", 10, 20)]))
    s.add_request(make_request("r3", 12))
    plan, _ = run_step(s)
    assert [r.req_id for r in plan.unavailable] == ["r1"]
    r1 = plan.unavailable[0]
    assert r1.finish_reason is FinishReason.ABORT and "r1" not in s.requests
    assert plan.num_scheduled_tokens == {"r2": 40, "r3": 12} and new_ids(plan) == ["r2", "r3"]
    assert plan.load_mm_hashes == ["b"] and plan.finished_req_ids == []  # r1 never reached the worker
    assert "a" not in s.encoder_cache


def test_the_store_is_asked_once_per_request_for_all_its_missing_items(store: CountingStore) -> None:
    store.put("a", b"v")
    store.put("c", b"v")
    s = consumer(store, can_encode=True, max_num_batched_tokens=32)
    s.add_request(make_request("r1", 100, images=[("a", 4, 20), ("b", 40, 20), ("c", 70, 20)], max_tokens=1))
    loads, encodes = [], []
    while s.has_work:
        plan, _ = run_step(s)
        loads += plan.load_mm_hashes
        encodes += [h for h in encoded(plan) if h not in plan.load_mm_hashes]
    assert store.calls == [["a", "b", "c"]]  # one round trip, in the step that first needed "a"
    assert loads == ["a", "c"] and encodes == ["b"]
    connector = s.connector
    assert connector is not None
    assert (connector.num_lookups, connector.num_lookup_hits, connector.num_lookup_errors) == (3, 2, 0)


def test_items_already_in_the_encoder_cache_are_not_looked_up(store: CountingStore) -> None:
    s = consumer(store, can_encode=True)
    s.add_request(make_request("r1", 40, images=[("a", 10, 20)], max_tokens=1))
    run_step(s)
    s.add_request(make_request("r2", 70, images=[("a", 5, 20), ("b", 40, 20)], max_tokens=1))
    plan, _ = run_step(s)
    assert store.calls == [["a"], ["b"]] and encoded(plan) == ["b"]


def test_a_producer_connector_is_never_asked(store: CountingStore) -> None:
    store.put("a", b"v")
    s = consumer(store, can_encode=True, role=ECRole.PRODUCER)
    assert s.connector is None
    s.add_request(make_request("r1", 40, images=[("a", 10, 20)]))
    plan, _ = run_step(s)
    assert encoded(plan) == ["a"] and plan.ec_meta is None and store.calls == []


def test_a_failed_step_forgets_its_loads_and_a_later_request_loads_again(store: CountingStore) -> None:
    store.put("a", b"v")
    s = consumer(store, can_encode=False)
    s.add_request(make_request("r1", 40, images=[("a", 10, 20)]))
    plan = s.schedule()
    assert plan.load_mm_hashes == ["a"]
    assert [r.req_id for r in s.fail_step(plan)] == ["r1"]
    assert "a" not in s.encoder_cache

    s.add_request(make_request("r2", 40, images=[("a", 10, 20)]))
    plan, _ = run_step(s)
    assert "a" in plan.free_mm_hashes  # the worker drops whatever it loaded
    assert plan.load_mm_hashes == ["a"] and plan.num_scheduled_tokens == {"r2": 40}


# ---------------------------------------------------------------------------- unreachable store


@pytest.mark.parametrize("can_encode", [True, False])
def test_an_unreachable_store_holds_nothing_and_is_counted(tmp_path: Path, can_encode: bool) -> None:
    (tmp_path / "not-a-folder").write_bytes(b"")
    store = ReconnectingStore(
        ECConfig("shared-storage", ECRole.CONSUMER, storage_path=str(tmp_path / "not-a-folder"))
    )
    s = Scheduler(config(can_encode=can_encode), ECConnectorScheduler(store, ECRole.CONSUMER))
    s.add_request(make_request("r1", 70, images=[("a", 5, 20), ("b", 40, 20)]))
    plan, _ = run_step(s)
    assert plan.load_mm_hashes == []
    if can_encode:
        assert encoded(plan) == ["a", "b"] and plan.num_scheduled_tokens == {"r1": 70}
    else:
        assert [r.req_id for r in plan.unavailable] == ["r1"]
    assert s.connector is not None
    assert (s.connector.num_lookups, s.connector.num_lookup_errors, s.connector.num_lookup_hits) == (2, 2, 0)


def test_a_folder_replaced_by_a_file_counts_as_a_lookup_error(tmp_path: Path) -> None:
    store = SharedStorageStore(tmp_path / "ec", max_bytes=0)
    (tmp_path / "ec").rmdir()
    (tmp_path / "ec").write_bytes(b"")
    s = Scheduler(config(), ECConnectorScheduler(store, ECRole.CONSUMER))
    s.add_request(make_request("r1", 40, images=[("a", 10, 20)]))
    plan, _ = run_step(s)
    assert encoded(plan) == ["a"]  # (this part holds: encoded locally)
    assert s.connector is not None and s.connector.num_lookup_errors == 1


def test_an_unavailable_request_leaves_no_load_behind(store: CountingStore) -> None:
    store.put("a", b"v")
    s = consumer(store, can_encode=False)
    s.add_request(make_request("r1", 70, images=[("a", 5, 20), ("b", 40, 20)]))
    plan, _ = run_step(s)
    assert [r.req_id for r in plan.unavailable] == ["r1"]
    assert plan.load_mm_hashes == [] and "a" not in s.encoder_cache


# ---------------------------------------------------------------------------- engine core


def two_images(req_id: str, stored: str, missing: str) -> AddRequest:
    features = [MMFeature(stored, 2, 16, tensors=PIXELS), MMFeature(missing, 20, 16, tensors=PIXELS)]
    return AddRequest(req_id, list(range(40)), SamplingParams(max_tokens=2), mm_features=features)


def lm_only_core(store: SharedStorageStore) -> tuple[EngineCore, StandinWorker]:
    """A --language-model-only instance: its worker loads from the store and cannot encode (a step
    whose item it can neither load nor encode fails with unavailable_mm_hashes, as the worker's)."""
    worker = StandinWorker(has_vision_tower=False, ec_store=store, ec_role=ECRole.CONSUMER)
    return engine_core(worker, ECConnectorScheduler(store, ECRole.CONSUMER))


def test_requests_whose_items_cannot_be_had_get_503_and_others_run(store: CountingStore) -> None:
    store.put("Y", b"v")
    core, worker = lm_only_core(store)
    core.add_request(b"a", add("r1", "X"), frames())
    core.add_request(b"b", add("r2", "Y"), frames())
    outputs = core.step()
    [out] = outputs[b"a"]
    assert out.req_id == "r1" and out.finish_reason is FinishReason.ABORT and out.new_token_ids == []
    assert out.error == ENCODER_OUTPUT_UNAVAILABLE
    assert (out.error.code, out.error.http_status) == ("encoder_output_unavailable", 503)
    sched = worker.steps[0].sched
    assert list(sched.num_scheduled_tokens) == ["r2"] and sched.encoder_inputs == []
    assert sched.ec_meta is not None and sched.ec_meta.load_mm_hashes == ["Y"]
    outputs = run_until_idle(core)
    assert outputs[b"b"][-1].finish_reason is FinishReason.LENGTH and outputs[b"b"][-1].error is None
    assert core.stats().counters["ec_lookups_total"] == 2


def test_a_load_the_worker_could_not_make_fails_the_step_with_503(store: CountingStore) -> None:
    store.put("Y", b"v")
    core, worker = lm_only_core(store)
    core.add_request(b"a", add("r1", "Y"), frames())
    core.add_request(b"a", add("r2", None), frames())
    store.lose_before_load = {"Y"}
    outputs = core.step()
    assert [(o.req_id, o.error) for o in outputs[b"a"]] == [
        ("r1", ENCODER_OUTPUT_UNAVAILABLE),
        ("r2", ENCODER_OUTPUT_UNAVAILABLE),  # every request of the step, as for any failed step
    ]
    assert not core.has_work and core.stats().counters["engine_failed_steps_total"] == 1

    store.put("Y", b"v")  # back: a retry loads it again
    assert core.add_request(b"a", add("r3", "Y", with_tensors=False), key_only_frames()) == {}
    outputs = run_until_idle(core)
    assert outputs[b"a"][-1].finish_reason is FinishReason.LENGTH
    sched = worker.steps[1].sched
    assert sched.free_mm_hashes == ["Y"]  # the worker drops whatever it loaded in the failed step
    assert sched.ec_meta is not None and sched.ec_meta.load_mm_hashes == ["Y"]


def test_a_stored_item_of_an_unavailable_request_is_loaded_before_it_is_shared(store: CountingStore) -> None:
    store.put("A", b"v")
    core, worker = lm_only_core(store)
    core.add_request(b"a", two_images("r1", "A", "B"), frames())
    [out] = core.step()[b"a"]
    assert out.error == ENCODER_OUTPUT_UNAVAILABLE
    assert core.add_request(b"a", add("r2", "A"), frames()) == {}
    outputs = run_until_idle(core)  # (the stand-in raises StepError for a missing encoder output)
    assert outputs[b"a"][-1].finish_reason is FinishReason.LENGTH
