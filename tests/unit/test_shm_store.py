"""The API's shared-memory object store: items written once, read back in place, never overwritten while
a request may still read them, references released on every way a request ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from app.inputs.shm_store import ShmObjectStore
from wire.shm_ring import HEADER_BYTES, ShmRingReader
from workers.families.processing import ItemLayout, ProcessedItem
from workers.frames import tensors_from_shm

ITEM_BYTES = 3 * 32 * 32 * 4  # one pixel_values tensor below


def item(seed: int, side: int = 32) -> ProcessedItem:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.rand((1, 3, side, side), generator=generator)
    return ProcessedItem(
        {"pixel_values": pixels, "grid": torch.tensor([[1, 2, 3]])}, ItemLayout(9, (1, 2, 3))
    )


@pytest.fixture
def store() -> Iterator[ShmObjectStore]:
    # room for three items (payload + grid, each chunk-aligned, plus headers)
    store = ShmObjectStore(capacity_bytes=3 * (ITEM_BYTES + 2 * HEADER_BYTES), max_object_bytes=1 << 20)
    yield store
    store._check()
    store.close()


def read_back(ref_store: ShmObjectStore, mm_hash: str) -> dict[str, torch.Tensor]:
    entry = ref_store.lookup(mm_hash)
    assert entry is not None
    reader = ShmRingReader()
    try:
        tensors = {
            name: t.clone() for name, t in tensors_from_shm(entry.ref, reader.payload(entry.ref)).items()
        }
    finally:
        reader.close()
        ref_store.release(entry)
    return tensors


def test_put_then_a_reader_sees_the_same_tensors(store: ShmObjectStore) -> None:
    original = item(1)
    entry = store.put("a", original)
    assert entry is not None and entry.layout == ItemLayout(9, (1, 2, 3))
    store.release(entry)
    tensors = read_back(store, "a")
    assert tensors.keys() == original.tensors.keys()
    for name, tensor in original.tensors.items():
        assert torch.equal(tensors[name], tensor) and tensors[name].dtype == tensor.dtype


def test_a_second_put_of_the_same_key_reuses_the_item(store: ShmObjectStore) -> None:
    first = store.put("a", item(1))
    second = store.put("a", item(2))
    assert first is not None and second is not None and first.ref == second.ref
    assert store.writer.refcount(first.ref.item_id) == 2


def test_an_item_in_use_is_never_overwritten(store: ShmObjectStore) -> None:
    held = [store.put(key, item(i)) for i, key in enumerate("abc")]
    assert all(held)
    store.hold("req-1", [entry.ref.item_id for entry in held if entry])
    assert store.put("d", item(4)) is None  # no room: every item is referenced
    store.finish("req-1")
    entry = store.put("d", item(4))
    assert entry is not None and "a" not in store  # the oldest went, once nothing read it
    store.release(entry)
    assert torch.equal(read_back(store, "b")["pixel_values"], item(1).tensors["pixel_values"])


def test_engine_lost_releases_what_the_engine_held(store: ShmObjectStore) -> None:
    entries = [store.put(key, item(i)) for i, key in enumerate("ab")]
    ids = [entry.ref.item_id for entry in entries if entry]
    store.hold("req-1", ids[:1])
    store.hold("req-2", ids[1:])
    store.engine_lost()
    assert [store.writer.refcount(i) for i in ids] == [0, 0]
    store.finish("req-1")  # a late final output releases nothing twice
    assert [store.writer.refcount(i) for i in ids] == [0, 0]


def test_too_large_items_take_the_normal_path() -> None:
    store = ShmObjectStore(capacity_bytes=1 << 20, max_object_bytes=ITEM_BYTES - 1)
    try:
        assert store.put("a", item(1)) is None and "a" not in store
    finally:
        store.close()


def test_an_invalidated_key_written_again_survives_its_old_chunk(store: ShmObjectStore) -> None:
    old = store.put("a", item(1))
    assert old is not None
    store.release(old)
    store.invalidate(["a"])
    new = store.put("a", item(1))  # a second chunk of the same key
    assert new is not None and new.ref.item_id != old.ref.item_id
    store.release(new)
    for i, key in enumerate("bc"):  # frees the old chunk of "a" first
        entry = store.put(key, item(10 + i))
        assert entry is not None
        store.release(entry)
    found = store.lookup("a")
    assert found is not None and found.ref.item_id == new.ref.item_id
    store.release(found)


def test_clear_forgets_items_but_keeps_referenced_chunks(store: ShmObjectStore) -> None:
    entry = store.put("a", item(1))
    assert entry is not None
    store.clear()
    assert store.lookup("a") is None
    assert store.writer.holds(entry.ref.item_id)
    store.release(entry)
