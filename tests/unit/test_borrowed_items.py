"""A media id's item borrowed from another API process's receiver-cache partition: resolved from any
partition that holds it without touching one (each mirrors only its own API's decisions), and reported
missing, not counted as a safety-net resend, when none holds it."""

from __future__ import annotations

import msgspec

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
