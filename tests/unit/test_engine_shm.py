"""The engine with shared-memory references (``--mm-processor-cache-type shm``): a valid reference is
admitted as is and reaches the worker as a reference (no frames, nothing stored in the receiver cache);
a stale or corrupt one is refused with the safety net's ``missing_mm_hashes`` and counted, so the API
re-sends that item with its payload."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import msgspec
import pytest

from tests.unit.engine_core_support import engine_core
from wire.protocol import AddRequest, FinishReason, MMFeature, SamplingParams, ShmItemRef, ShmTensor
from wire.shm_ring import ShmRingWriter, ring_name

PIXELS = {"pixel_values": ShmTensor("float32", (1, 3, 4, 4), 0)}


@pytest.fixture
def ring() -> Iterator[ShmRingWriter]:
    writer = ShmRingWriter(ring_name(os.getpid(), f"test-{uuid.uuid4().hex[:8]}"), 1 << 16)
    yield writer
    writer.close()


def shm_ref(ring: ShmRingWriter, key: str) -> ShmItemRef:
    slot = ring.allocate(192, key).slot
    assert slot is not None
    return ring.ref(slot, PIXELS)


def request(req_id: str, *refs: tuple[str, ShmItemRef]) -> AddRequest:
    features = [MMFeature(h, offset=2 + 20 * i, num_tokens=16, shm=ref) for i, (h, ref) in enumerate(refs)]
    return AddRequest(req_id, list(range(60)), SamplingParams(max_tokens=2), mm_features=features)


def test_a_valid_reference_reaches_the_worker_as_a_reference(ring: ShmRingWriter) -> None:
    core, worker = engine_core()
    ref = shm_ref(ring, "h1")
    assert core.add_request(b"a", request("r1", ("h1", ref)), []) == {}
    core.step()
    (sched, frames), *_ = worker.steps
    assert [(e.mm_hash, e.shm, e.tensors) for e in sched.encoder_inputs] == [("h1", ref, {})]
    assert frames == [] and "h1" in worker.outputs  # nothing crossed as a frame; read from the ring
    assert len(core.receiver_caches.for_sender(b"a")) == 0  # the ring holds it, not the engine


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda ref: msgspec.structs.replace(ref, item_id=ref.item_id + 1),  # a reused chunk's id
        lambda ref: msgspec.structs.replace(ref, offset=1 << 20),  # out of range
        lambda ref: msgspec.structs.replace(ref, size=ref.size + 64),
        lambda ref: msgspec.structs.replace(ref, ring="mmserve.1.no-such-ring"),
        lambda ref: msgspec.structs.replace(ref, ring="../etc/passwd"),
        lambda ref: msgspec.structs.replace(
            ref, tensors={"pixel_values": ShmTensor("float32", (1, 3, 8, 8), 0)}
        ),
    ],
    ids=["id", "offset", "size", "ring", "name", "tensor"],
)
def test_a_stale_reference_is_refused_with_its_hash_and_counted(ring: ShmRingWriter, corrupt) -> None:
    core, _ = engine_core()
    good, bad = shm_ref(ring, "good"), corrupt(shm_ref(ring, "bad"))
    outputs = core.add_request(b"a", request("r1", ("good", good), ("bad", bad)), [])
    (output,) = outputs[b"a"]
    assert output.finish_reason is FinishReason.ABORT
    assert output.error is not None and output.error.missing_mm_hashes == ["bad"]
    assert core.stats().counters["mm_shm_stale_refs_total"] == 1
    assert core.stats().counters.get("mm_ipc_cache_resends_total", 0) == 0
    assert not core.has_work
