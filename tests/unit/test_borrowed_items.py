"""A media id's item borrowed from another API process's receiver-cache partition: resolved from any
partition that holds it without touching one (each mirrors only its own API's decisions), else from its
encoder output alone when the encoder cache holds it (held by the request until it ends), and reported
missing, not counted as a safety-net resend, when neither holds it."""

from __future__ import annotations

import msgspec

from engine.scheduler import Scheduler
from tests.unit.engine_core_support import add, engine_core, frames, key_only_frames, run_until_idle
from wire.protocol import AddRequest, FinishReason


def borrowed(req_id: str, mm_hash: str) -> AddRequest:
    msg = add(req_id, mm_hash, with_tensors=False)
    features = [msgspec.structs.replace(f, borrowed=True) for f in msg.mm_features]
    return msgspec.structs.replace(msg, mm_features=features)


def test_a_borrowed_item_comes_from_another_partition_untouched() -> None:
    core, worker = engine_core()
    core.add_request(b"a", add("r1", "X"), frames())
    core.add_request(b"a", add("r2", "Y"), frames())
    run_until_idle(core)
    before = core.receiver_caches.for_sender(b"a").keys()
    assert core.add_request(b"b", borrowed("r3", "X"), key_only_frames()) == {}
    assert core.receiver_caches.for_sender(b"a").keys() == before == ["X", "Y"]  # X not made recent
    assert core.receiver_caches.for_sender(b"b").keys() == []  # nor stored in b's partition
    outputs = run_until_idle(core)
    assert [o.finish_reason for o in outputs[b"b"]] == [None, FinishReason.LENGTH]
    assert worker.encoder_inputs == ["X", "Y"]  # X's encoder output reused


def test_a_borrowed_item_no_partition_holds_is_missing_but_no_resend() -> None:
    core, _ = engine_core()
    [out] = core.add_request(b"b", borrowed("r1", "X"), key_only_frames())[b"b"]
    assert out.error is not None and out.error.code == "mm_cache_miss"
    assert out.error.missing_mm_hashes == ["X"]
    assert core.stats().counters["mm_ipc_cache_resends_total"] == 0
    assert not core.has_work


def test_a_borrowed_item_only_the_encoder_cache_holds_rests_on_its_entry_through_preemption() -> None:
    core, worker = engine_core()
    core.add_request(b"a", add("r1", "X", store=False), frames())  # encoded, not kept as an item
    run_until_idle(core)
    assert core.receiver_caches.for_sender(b"a").keys() == [] and "X" in core.scheduler.encoder_cache
    assert core.add_request(b"b", borrowed("r2", "X"), key_only_frames()) == {}
    request = core.scheduler.requests["r2"]
    assert request.encoder_only_hashes == {"X"} and "X" not in request.mm_items
    core.step()
    scheduler = core.scheduler
    assert isinstance(scheduler, Scheduler)
    scheduler._preempt(request)  # recomputed from scratch later: X's output must still be there
    scheduler.reset_caches()  # evicts every freeable entry
    assert "X" in scheduler.encoder_cache and request.encoder_hashes_in_use == {"X"}
    outputs = run_until_idle(core)
    assert outputs[b"b"][-1].finish_reason is FinishReason.LENGTH and outputs[b"b"][-1].error is None
    assert worker.encoder_inputs == ["X"]  # encoded once, for r1
    scheduler.reset_caches()  # released at the end: freeable, so evicted now
    assert "X" not in scheduler.encoder_cache
