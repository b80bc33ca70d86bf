"""Shared-memory ring: FIFO allocation with wrap-around, referenced chunks never overwritten, stale
references detected by the monotonic item_id in the chunk header, orphaned rings removed."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from wire.protocol import ShmItemRef, ShmTensor
from wire.shm_ring import (
    ShmRingReader,
    ShmRingWriter,
    Slot,
    StaleShmRef,
    chunk_bytes,
    remove_orphans,
    ring_name,
)

MakeRing = Callable[..., ShmRingWriter]


@pytest.fixture
def make_ring(tmp_path: Path) -> Iterator[MakeRing]:
    rings: list[ShmRingWriter] = []

    def make(capacity: int, tag: str = "t") -> ShmRingWriter:
        ring = ShmRingWriter(ring_name(os.getpid(), tag), capacity, directory=str(tmp_path))
        rings.append(ring)
        return ring

    yield make
    for ring in rings:
        ring.close()


@pytest.fixture
def reader(tmp_path: Path) -> Iterator[ShmRingReader]:
    r = ShmRingReader(str(tmp_path))
    yield r
    r.close()


def put(ring: ShmRingWriter, size: int, key: str, fill: int, *, keep: bool = False) -> Slot:
    """Allocate, fill the payload with ``fill`` and (unless ``keep``) drop the caller's count."""
    alloc = ring.allocate(size, key)
    assert alloc.slot is not None, f"{key} did not fit"
    alloc.slot.payload[:] = bytes([fill]) * size
    if not keep:
        ring.release(alloc.slot.item_id)
    ring._check()
    return alloc.slot


def test_chunk_bytes_and_names() -> None:
    assert [chunk_bytes(s) for s in (0, 1, 64, 65, 128)] == [64, 128, 128, 192, 192]
    assert ring_name(12, "api-0_x") == "mmserve.12.api-0_x"
    with pytest.raises(ValueError):
        ring_name(12, "../x")


def test_writer_validates_name_capacity_and_collisions(make_ring: MakeRing, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        ShmRingWriter("other", 640, directory=str(tmp_path))
    with pytest.raises(ValueError):
        ShmRingWriter(ring_name(1, "x"), 100, directory=str(tmp_path))
    make_ring(640)
    with pytest.raises(FileExistsError):
        ShmRingWriter(ring_name(os.getpid(), "t"), 640, directory=str(tmp_path))


def test_wrap_around_keeps_surviving_chunks(make_ring: MakeRing) -> None:
    ring = make_ring(640)
    a = put(ring, 64, "a", 1)  # [0, 128)
    b = put(ring, 128, "b", 2)  # [128, 320)
    c = put(ring, 128, "c", 3, keep=True)  # [320, 512)
    assert (a.offset, b.offset, c.offset) == (0, 128, 320)
    alloc = ring.allocate(128, "d")  # 192 bytes: 128 left at the end, so wrap to 0 after freeing a, b
    assert alloc.slot is not None and alloc.slot.offset == 0 and alloc.evicted == ["a", "b"]
    alloc.slot.payload[:] = b"\x04" * 128
    ring._check()
    assert bytes(c.payload) == b"\x03" * 128 and ring.num_chunks == 2
    assert ring.used_bytes == 2 * 192  # the 128-byte gap at the end is not counted
    assert not ring.holds(a.item_id) and ring.holds(c.item_id)
    assert put(ring, 0, "e", 5).offset == 192  # wrapped: room is [192, 320)
    assert ring.allocate(64, "f").slot is None  # [256, 320) is too small, c is referenced


def test_item_in_use_is_never_overwritten(make_ring: MakeRing) -> None:
    ring = make_ring(256)
    a = put(ring, 64, "a", 7, keep=True)  # [0, 128), referenced
    put(ring, 64, "b", 8)  # [128, 256), freeable but behind a
    alloc = ring.allocate(64, "c")
    assert alloc.slot is None and alloc.evicted == [] and ring.num_chunks == 2
    assert bytes(a.payload) == b"\x07" * 64
    ring.release(a.item_id)
    alloc = ring.allocate(64, "c")
    assert alloc.slot is not None and alloc.slot.offset == 0 and alloc.evicted == ["a"]
    ring._check()


def test_failed_allocation_frees_nothing(make_ring: MakeRing) -> None:
    ring = make_ring(384)
    a = put(ring, 64, "a", 1)  # freeable head
    b = put(ring, 64, "b", 2, keep=True)
    put(ring, 64, "c", 3)
    alloc = ring.allocate(192, "d")  # needs a and b freed; b is referenced
    assert alloc.slot is None and alloc.evicted == []
    assert ring.holds(a.item_id) and ring.holds(b.item_id) and ring.num_chunks == 3
    ring._check()


def test_counts_released_on_finish_and_abort(make_ring: MakeRing) -> None:
    ring = make_ring(256)
    slot = put(ring, 64, "a", 1, keep=True)
    assert ring.refcount(slot.item_id) == 1
    ring.acquire(slot.item_id)  # request 1
    ring.acquire(slot.item_id)  # request 2
    ring.release(slot.item_id)  # the API's own count after sending
    assert ring.refcount(slot.item_id) == 2
    ring.release(slot.item_id)  # request 1 finished
    ring.release(slot.item_id)  # request 2 aborted
    assert ring.refcount(slot.item_id) == 0 and ring.holds(slot.item_id)
    with pytest.raises(ValueError):
        ring.release(slot.item_id)
    for bad in (ring.release, ring.acquire):
        with pytest.raises(ValueError):
            bad(999)
    put(ring, 64, "b", 2)
    assert ring.allocate(64, "c").evicted == ["a"]
    assert ring.refcount(slot.item_id) == 0 and not ring.holds(slot.item_id)
    ring._check()


def test_too_large_item_never_fits(make_ring: MakeRing) -> None:
    ring = make_ring(640)
    put(ring, 64, "a", 1)
    alloc = ring.allocate(577, "big")
    assert alloc.slot is None and alloc.evicted == [] and ring.num_chunks == 1
    alloc = ring.allocate(576, "exact")  # capacity - 64 fits, after freeing everything
    assert alloc.slot is not None and alloc.slot.offset == 0 and alloc.evicted == ["a"]
    with pytest.raises(ValueError):
        ring.allocate(-1, "neg")


def test_reader_sees_the_writers_bytes(make_ring: MakeRing, reader: ShmRingReader) -> None:
    ring = make_ring(640)
    put(ring, 64, "pad", 0)
    alloc = ring.allocate(64 + 16, "x")
    assert alloc.slot is not None
    alloc.slot.payload[:24] = struct.pack("<6f", 0.5, 1, 2, 3, 4, 5)
    alloc.slot.payload[64:80] = struct.pack("<2q", 7, -9)
    tensors = {"pixel_values": ShmTensor("float32", (2, 3), 0), "grid": ShmTensor("int64", (2,), 64)}
    ref = ring.ref(alloc.slot, tensors)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(ref), type=ShmItemRef)
    assert reader.check(wire) is None
    view = reader.payload(wire)
    assert view.readonly and len(view) == 80
    assert view[:24].cast("f").tolist() == [0.5, 1, 2, 3, 4, 5]
    assert view[64:80].cast("q").tolist() == [7, -9]
    with pytest.raises(ValueError):
        ring.ref(alloc.slot, {"t": ShmTensor("float32", (21,), 0)})


def test_stale_reference_detected_by_monotonic_id(make_ring: MakeRing, reader: ShmRingReader) -> None:
    ring = make_ring(256)
    old = ring.ref(put(ring, 64, "a", 1), {})
    put(ring, 64, "b", 2)
    new = ring.ref(put(ring, 64, "c", 3), {})  # frees a, reuses its offset
    assert new.offset == old.offset and new.item_id > old.item_id
    with pytest.raises(StaleShmRef, match=f"holds item {new.item_id}, not {old.item_id}"):
        reader.payload(old)
    assert bytes(reader.payload(new)) == b"\x03" * 64


def test_freed_chunk_is_stale_before_being_overwritten(make_ring: MakeRing, reader: ShmRingReader) -> None:
    ring = make_ring(512)
    refs = [ring.ref(put(ring, 64, k, i + 1), {}) for i, k in enumerate("abcd")]
    alloc = ring.allocate(192, "e")  # [0, 256): frees a and b; b's header is inside e's payload
    assert alloc.slot is not None and alloc.evicted == ["a", "b"]
    assert reader.check(refs[1]) == f"chunk at 128 holds item 0, not {refs[1].item_id}"
    assert reader.check(refs[2]) is None


def test_bad_references(make_ring: MakeRing, reader: ShmRingReader, tmp_path: Path) -> None:
    ring = make_ring(640)
    ref = ring.ref(put(ring, 100, "a", 1), {"t": ShmTensor("uint8", (100,), 0)})
    assert reader.check(ref) is None

    def why(**changes: object) -> str | None:
        return reader.check(msgspec.structs.replace(ref, **changes))

    for name in ("../../etc/passwd", "mmserve.1.a/../b", "other", "mmserve..x"):
        assert why(ring=name) == f"invalid ring name {name!r}"
    assert "cannot be opened" in str(why(ring=ring_name(os.getpid(), "absent")))
    for offset in (-64, 32, 640, 10**9):
        assert "misaligned or outside" in str(why(offset=offset))
    assert "holds item 0" in str(why(offset=576))  # never-written space
    assert "holds 100 bytes, not 101" in str(why(size=101))
    assert "holds item" in str(why(item_id=ref.item_id + 1))
    assert "past the 100-byte payload" in str(why(tensors={"t": ShmTensor("float32", (26,), 0)}))
    assert "past the 100-byte payload" in str(why(tensors={"t": ShmTensor("uint8", (1,), 100)}))
    assert "unknown dtype" in str(why(tensors={"t": ShmTensor("object", (1,), 0)}))
    assert "negative" in str(why(tensors={"t": ShmTensor("uint8", (-1,), 0)}))
    # a header claiming more bytes than the file holds (not a ring this writer made)
    forged = tmp_path / ring_name(1, "forged")
    forged.write_bytes(struct.pack("<QQ", 5, 10**6).ljust(128, b"\0"))
    assert "runs past the end" in str(reader.check(ShmItemRef(forged.name, 0, 5, 10**6, {})))
    (tmp_path / ring_name(1, "empty")).write_bytes(b"")
    assert "not a ring file" in str(reader.check(ShmItemRef(ring_name(1, "empty"), 0, 1, 0, {})))
    os.symlink(forged, tmp_path / ring_name(1, "link"))
    assert "cannot be opened" in str(reader.check(ShmItemRef(ring_name(1, "link"), 0, 5, 10**6, {})))


def test_reader_remaps_a_recreated_ring_and_bounds_open_maps(tmp_path: Path) -> None:
    reader = ShmRingReader(str(tmp_path), max_open=2)
    name = ring_name(os.getpid(), "r")
    ring = ShmRingWriter(name, 256, directory=str(tmp_path))
    old = ring.ref(put(ring, 64, "a", 1), {})
    kept = reader.payload(old)
    ring.close()
    ring.close()  # idempotent
    assert "cannot be opened" in str(reader.check(old)) and name not in reader._maps
    ring = ShmRingWriter(name, 256, directory=str(tmp_path))
    put(ring, 64, "a", 9)
    new = ring.ref(put(ring, 64, "b", 2), {})
    assert bytes(reader.payload(new)) == b"\x02" * 64
    assert bytes(kept) == b"\x01" * 64  # a view handed out earlier outlives the unmapping
    others = [ShmRingWriter(ring_name(os.getpid(), f"o{i}"), 256, directory=str(tmp_path)) for i in range(2)]
    for other in others:
        assert reader.check(other.ref(put(other, 0, "z", 0), {})) is None
    assert len(reader._maps) == 2 and name not in reader._maps
    assert reader.check(new) is None  # mapped again on demand
    for r in (ring, *others):
        r.close()
    reader.close()


def test_dev_shm_ring_is_unlinked_on_close() -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    name = ring_name(os.getpid(), f"test-{uuid.uuid4().hex}")
    ring = ShmRingWriter(name, 1 << 16)
    try:
        assert os.stat(f"/dev/shm/{name}").st_size == 1 << 16
        assert oct(os.stat(f"/dev/shm/{name}").st_mode & 0o777) == "0o600"
        reader = ShmRingReader()
        slot = put(ring, 10, "a", 3)
        assert bytes(reader.payload(ring.ref(slot, {}))) == b"\x03" * 10
        reader.close()
    finally:
        ring.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    assert bytes(slot.payload) == b"\x03" * 10  # a view held across close keeps the mapping alive
    ring.close()


def test_remove_orphans(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{zombie.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    held = ShmRingWriter(ring_name(os.getpid(), "ring-held"), 256, directory=str(tmp_path))
    names = [
        ring_name(dead.pid, "a"),
        ring_name(zombie.pid, "z"),
        ring_name(os.getpid(), "ring-unheld"),  # a live pid (e.g. a container's pid 1 again), no writer
        ring_name(os.getpid(), "live"),
        "mmserve.notapid.x",
        "other.1.x",
        f"mmserve.{dead.pid}",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (time.time() - 120, time.time() - 120))  # left a while ago
    (tmp_path / ring_name(dead.pid, "fresh")).write_bytes(b"x")  # maybe another namespace's, in flight
    try:
        assert remove_orphans(str(tmp_path)) == sorted(names[:3])
    finally:
        zombie.wait()
    assert sorted(os.listdir(tmp_path)) == sorted([*names[3:], held.name, ring_name(dead.pid, "fresh")])
    assert remove_orphans(str(tmp_path)) == []
    held.close()
    assert held.name not in os.listdir(tmp_path)


def test_randomized_against_a_model(make_ring: MakeRing, reader: ShmRingReader) -> None:
    rng = random.Random(1234)
    ring = make_ring(64 * 64)
    live: dict[int, tuple[str, int, ShmItemRef]] = {}  # item_id -> (key, fill byte, ref), oldest first
    counts: dict[int, int] = {}
    stale: list[ShmItemRef] = []
    num_wraps = num_refused = 0
    for step in range(500):
        op = rng.random()
        if op < 0.45 or not live:
            size = rng.choice([0, 1, 63, 64, 65, *[rng.randrange(1, 700)] * 3, rng.randrange(1, 4100)])
            key, fill = f"k{step}", rng.randrange(1, 256)
            alloc = ring.allocate(size, key)
            if alloc.slot is None:
                assert alloc.evicted == []
                num_refused += 1
                assert chunk_bytes(size) > ring.capacity or any(counts.values())
            else:
                freed = list(live)[: len(alloc.evicted)]
                assert alloc.evicted == [live[i][0] for i in freed]
                for item_id in freed:
                    assert counts.pop(item_id) == 0
                    stale.append(live.pop(item_id)[2])
                num_wraps += alloc.slot.offset == 0 and bool(live)
                alloc.slot.payload[:] = bytes([fill]) * size
                live[alloc.slot.item_id] = (key, fill, ring.ref(alloc.slot, {}))
                counts[alloc.slot.item_id] = 1
        elif op < 0.6:
            item_id = rng.choice(list(live))
            ring.acquire(item_id)
            counts[item_id] += 1
        else:
            held = [i for i, n in counts.items() if n]
            if held:
                item_id = rng.choice(held)
                ring.release(item_id)
                counts[item_id] -= 1
        ring._check()
        assert ring.num_chunks == len(live)
        assert ring.used_bytes == sum(chunk_bytes(ref.size) for _, _, ref in live.values())
        for item_id, (_, fill, ref) in live.items():
            assert ring.refcount(item_id) == counts[item_id]
            assert bytes(reader.payload(ref)) == bytes([fill]) * ref.size
        for ref in stale:
            assert reader.check(ref) is not None
    assert len(stale) > 50 and num_wraps >= 5 and num_refused >= 20  # every path was taken
