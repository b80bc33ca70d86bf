"""The API's side of the shared-memory object store (``--mm-processor-cache-type shm``;
docs/architecture.md, "Shared-memory object store").

One ring per API process (``wire/shm_ring.py``), which this process alone writes. The store keeps only
each item's small metadata (where it lies, its placeholder count and grid); the tensors live in the ring,
where the worker reads them in place. A reference count keeps an item from being overwritten while any
request may still read it::

    lookup / put          +1   the request being prepared holds the item (like a mirror pin)
    hold(req_id, ids)          after the send: the engine now holds those references
    finish(req_id)        -1   the engine's final output for the request arrived (finished, aborted,
                               refused, failed): neither the engine nor the worker reads it again
    release(entry)        -1   a request abandoned before it was sent
    engine_lost()         -1   for every request held by an engine that died (its worker is gone too)

The ring frees oldest chunks first, and only chunks at zero references. Used from the event loop only.
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from app.settings import GIB
from wire.protocol import ShmItemRef, ShmTensor
from wire.shm_ring import HEADER_BYTES, RING_TAG_PREFIX, SHM_DIR, ShmRingWriter, ring_name, round_up
from workers.families.processing import ItemLayout, ProcessedItem
from workers.frames import dtype_name


@dataclass(frozen=True)
class ShmEntry:
    ref: ShmItemRef
    layout: ItemLayout


def _layout(item: ProcessedItem) -> tuple[dict[str, ShmTensor], int]:
    """Each tensor's place in the payload (aligned like chunks) and the payload's size."""
    tensors: dict[str, ShmTensor] = {}
    offset = 0
    for name, tensor in item.tensors.items():
        tensors[name] = ShmTensor(dtype_name(tensor.dtype), tuple(tensor.shape), offset)
        offset += round_up(tensor.nbytes)
    return tensors, offset


class ShmObjectStore:
    # Invariants:
    #   S1  every indexed entry's chunk is allocated in the ring (evictions drop the index entry)
    #   S2  writer.refcount(id) == (references held by requests being prepared) + (entries of id in
    #       _held over all requests): nothing the engine or a request may still read is overwritten
    def __init__(self, capacity_bytes: int, max_object_bytes: int) -> None:
        self.max_object_bytes = max_object_bytes
        # tmpfs allocates pages on first write: a ring larger than what /dev/shm has free would die of
        # SIGBUS later, so it is refused now
        shm = os.statvfs(SHM_DIR)
        free_bytes = shm.f_bavail * shm.f_frsize
        if capacity_bytes > free_bytes:
            raise RuntimeError(
                f"--mm-processor-cache-gb asks for a {capacity_bytes / GIB:.2f} GiB shm ring, but "
                f"{SHM_DIR} has {free_bytes / GIB:.2f} GiB free: lower it, or give {SHM_DIR} more room "
                "(docker: shm_size)"
            )
        name = ring_name(os.getpid(), f"{RING_TAG_PREFIX}{uuid.uuid4().hex[:12]}")
        self.writer = ShmRingWriter(name, capacity_bytes // HEADER_BYTES * HEADER_BYTES, directory=SHM_DIR)
        self._index: dict[str, ShmEntry] = {}
        self._held: dict[str, list[int]] = {}  # req_id -> item ids the engine holds for it

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    def lookup(self, mm_hash: str) -> ShmEntry | None:
        """The item's entry, with one reference taken for the caller; None when not in the ring."""
        entry = self._index.get(mm_hash)
        if entry is not None:
            self.writer.acquire(entry.ref.item_id)
        return entry

    def put(self, mm_hash: str, item: ProcessedItem) -> ShmEntry | None:
        """Writes the item into the ring (the one copy of its tensors) and takes one reference for the
        caller; None when it is larger than the object limit or the ring has no free room now."""
        existing = self.lookup(mm_hash)
        if existing is not None:  # a concurrent request processed the same image first
            return existing
        tensors, size = _layout(item)
        if size > self.max_object_bytes:
            return None
        allocation = self.writer.allocate(size, mm_hash)
        for key in allocation.evicted:
            # the index may name a newer chunk of the same key (after an invalidation)
            evicted = self._index.get(key)
            if evicted is not None and not self.writer.holds(evicted.ref.item_id):
                del self._index[key]
        slot = allocation.slot
        if slot is None:
            return None
        payload = torch.frombuffer(slot.payload, dtype=torch.uint8)
        for name, tensor in item.tensors.items():
            start = tensors[name].offset
            source = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            payload[start : start + source.numel()].copy_(source)
        entry = ShmEntry(self.writer.ref(slot, tensors), item.layout)
        self._index[mm_hash] = entry
        return entry

    def release(self, entry: ShmEntry) -> None:
        self.writer.release(entry.ref.item_id)

    def hold(self, req_id: str, item_ids: list[int]) -> None:
        """The request was sent with these references: they are released by ``finish``."""
        if item_ids:
            self._held[req_id] = item_ids

    def finish(self, req_id: str) -> None:
        for item_id in self._held.pop(req_id, ()):
            self.writer.release(item_id)

    def engine_lost(self) -> None:
        for req_id in list(self._held):
            self.finish(req_id)

    def invalidate(self, mm_hashes: Iterable[str]) -> None:
        """The engine found these references stale: forget them (their chunks are freed in turn)."""
        for mm_hash in mm_hashes:
            self._index.pop(mm_hash, None)

    def clear(self) -> None:
        """``POST /reset_mm_cache``: forget every item; chunks still referenced stay until released."""
        self._index.clear()

    def close(self) -> None:
        self.writer.close()

    def _check(self) -> None:
        for entry in self._index.values():
            assert self.writer.holds(entry.ref.item_id)
        held = Counter(item_id for ids in self._held.values() for item_id in ids)
        for item_id, count in held.items():
            assert self.writer.refcount(item_id) >= count
