"""The ``shared-storage`` encoder-cache store on a real folder: values round-trip whole, a reader never
sees a partial value, the folder stays within its byte bound (oldest first, never the value just
written), crashed writers' temporary files are swept, keys cannot leave the folder, and a folder that
cannot be used raises ``ECStoreError``."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from wire.ec_store import ECConfig, ECRole, ECStoreError, open_store
from wire.ec_store.shared_storage import STALE_TMP_S, SUFFIX, SharedStorageStore


def values_on_disk(folder: Path) -> dict[str, bytes]:
    return {p.name.removesuffix(SUFFIX): p.read_bytes() for p in folder.glob(f"*{SUFFIX}")}


def set_mtime(store: SharedStorageStore, key: str, mtime: float) -> None:
    os.utime(store.path(key), (mtime, mtime))


# ---------------------------------------------------------------------------- values


def test_put_then_get_round_trips_and_exists_answers_per_key(tmp_path: Path) -> None:
    store = SharedStorageStore(tmp_path / "ec", max_bytes=0)
    value = bytes(range(256)) * 10
    assert store.put("abc123", value) is True
    assert store.get("abc123") == value
    assert store.get("missing") is None
    assert store.exists(["missing", "abc123", "other"]) == [False, True, False]
    assert store.exists([]) == []
    assert values_on_disk(tmp_path / "ec") == {"abc123": value}


def test_open_store_builds_a_shared_storage_store_from_its_config(tmp_path: Path) -> None:
    config = ECConfig("shared-storage", ECRole.BOTH, storage_path=str(tmp_path / "new" / "ec"))
    store = open_store(config)
    assert isinstance(store, SharedStorageStore) and (tmp_path / "new" / "ec").is_dir()
    with pytest.raises(ValueError, match="unknown encoder-cache connector"):
        open_store(ECConfig("nfs", ECRole.BOTH))


def test_put_of_an_existing_key_replaces_the_value(tmp_path: Path) -> None:
    store = SharedStorageStore(tmp_path, max_bytes=0)
    store.put("k", b"first")
    store.put("k", b"second value")
    assert store.get("k") == b"second value"
    assert sorted(os.listdir(tmp_path)) == [f"k{SUFFIX}"]  # no temporary file left behind


def test_a_value_still_being_written_is_not_visible(tmp_path: Path) -> None:
    store = SharedStorageStore(tmp_path, max_bytes=0)
    # what a producer interrupted before its rename leaves: only the temporary name exists
    (tmp_path / ".k.0123456789abcdef.tmp").write_bytes(b"half a val")
    assert store.exists(["k"]) == [False]
    assert store.get("k") is None


def test_concurrent_writers_of_one_key_leave_one_complete_value(tmp_path: Path) -> None:
    a_store, b_store, reader = (SharedStorageStore(tmp_path, max_bytes=0) for _ in range(3))
    values = {b"a" * 300_000, b"b" * 500_000}
    seen: set[bytes | None] = set()
    done = threading.Event()

    def write(store: SharedStorageStore, value: bytes) -> None:
        for _ in range(30):
            assert store.put("k", value)

    def read() -> None:
        while not done.is_set():
            seen.add(reader.get("k"))

    reading = threading.Thread(target=read)
    writers = [
        threading.Thread(target=write, args=(s, v))
        for s, v in zip((a_store, b_store), sorted(values), strict=True)
    ]
    reading.start()
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    reading.join()
    assert reader.get("k") in values
    assert seen <= values | {None}  # never a torn or partial value
    assert sorted(os.listdir(tmp_path)) == [f"k{SUFFIX}"]


# ---------------------------------------------------------------------------- byte bound


def test_bound_removes_the_oldest_values_first(tmp_path: Path) -> None:
    store = SharedStorageStore(tmp_path, max_bytes=100)
    now = time.time()
    for i, key in enumerate(["old", "mid", "new"]):
        store.put(key, bytes(30))
        set_mtime(store, key, now - 1000 + i)
    store.put("latest", bytes(30))  # 120 bytes: one value must go
    assert sorted(values_on_disk(tmp_path)) == ["latest", "mid", "new"]

    store.put("big", bytes(70))  # 160 bytes: the two oldest left go
    assert sorted(values_on_disk(tmp_path)) == ["big", "latest"]


def test_bound_never_removes_the_value_just_written(tmp_path: Path) -> None:
    store = SharedStorageStore(tmp_path, max_bytes=100)
    store.put("a", bytes(40))
    store.put("b", bytes(40))
    future = time.time() + 1000  # the others look newer than the value about to be written
    set_mtime(store, "a", future)
    set_mtime(store, "b", future + 1)
    store.put("c", bytes(40))
    assert sorted(values_on_disk(tmp_path)) == ["b", "c"]  # "c" was the oldest, but it was just written


def test_a_value_filling_the_bound_exactly_replaces_everything_else(tmp_path: Path) -> None:
    store = SharedStorageStore(tmp_path, max_bytes=100)
    store.put("a", bytes(40))
    store.put("b", bytes(40))
    assert store.put("c", bytes(100)) is True
    assert sorted(values_on_disk(tmp_path)) == ["c"]


def test_a_value_larger_than_the_bound_is_refused_and_nothing_is_removed(tmp_path: Path) -> None:
    store = SharedStorageStore(tmp_path, max_bytes=100)
    store.put("a", bytes(60))
    assert store.put("huge", bytes(101)) is False
    assert store.exists(["huge", "a"]) == [False, True]
    assert sorted(os.listdir(tmp_path)) == [f"a{SUFFIX}"]


def test_unbounded_store_keeps_every_value(tmp_path: Path) -> None:
    store = SharedStorageStore(tmp_path, max_bytes=0)
    for i in range(20):
        store.put(f"k{i}", bytes(1000))
    assert len(values_on_disk(tmp_path)) == 20


def test_stale_temporary_files_are_removed_on_the_next_put_and_fresh_ones_kept(tmp_path: Path) -> None:
    store = SharedStorageStore(tmp_path, max_bytes=0)  # swept even without a bound
    stale, fresh = tmp_path / ".x.dead.tmp", tmp_path / ".y.live.tmp"
    stale.write_bytes(b"left by a crashed producer")
    fresh.write_bytes(b"another producer is writing this")
    old = time.time() - STALE_TMP_S - 60
    os.utime(stale, (old, old))
    store.put("k", b"v")
    assert not stale.exists() and fresh.exists()
    assert store.get("k") == b"v"


def test_temporary_files_do_not_count_against_the_bound(tmp_path: Path) -> None:
    store = SharedStorageStore(tmp_path, max_bytes=100)
    (tmp_path / ".y.live.tmp").write_bytes(bytes(500))
    store.put("a", bytes(50))
    store.put("b", bytes(50))
    assert sorted(values_on_disk(tmp_path)) == ["a", "b"]


# ---------------------------------------------------------------------------- keys and failures


@pytest.mark.parametrize("key", ["../x", "a/b", "", "/etc/passwd", ".hidden", "a" * 129, "a b", "a\x00"])
def test_keys_that_could_leave_the_folder_are_refused(tmp_path: Path, key: str) -> None:
    store = SharedStorageStore(tmp_path / "ec", max_bytes=0)
    with pytest.raises(ValueError, match="not a store key"):
        store.put(key, b"v")
    with pytest.raises(ValueError, match="not a store key"):
        store.get(key)
    with pytest.raises(ValueError, match="not a store key"):
        store.exists(["ok", key])
    assert list(tmp_path.rglob("*")) == [tmp_path / "ec"]  # nothing written anywhere


def test_a_folder_path_that_is_a_file_cannot_be_opened(tmp_path: Path) -> None:
    (tmp_path / "ec").write_bytes(b"not a folder")
    with pytest.raises(ECStoreError, match="cannot create"):
        SharedStorageStore(tmp_path / "ec", max_bytes=0)


def test_get_on_a_folder_replaced_by_a_file_raises_store_error(tmp_path: Path) -> None:
    store = SharedStorageStore(tmp_path / "ec", max_bytes=0)
    store.put("k", b"v")
    shutil.rmtree(tmp_path / "ec")
    (tmp_path / "ec").write_bytes(b"not a folder")
    with pytest.raises(ECStoreError):
        store.get("k")


def test_put_on_a_removed_folder_raises_store_error(tmp_path: Path) -> None:
    store = SharedStorageStore(tmp_path / "ec", max_bytes=0)
    shutil.rmtree(tmp_path / "ec")
    with pytest.raises(ECStoreError, match="cannot write"):
        store.put("k", b"v")


def test_put_on_a_folder_replaced_by_a_file_raises_store_error(tmp_path: Path) -> None:
    store = SharedStorageStore(tmp_path / "ec", max_bytes=0)
    shutil.rmtree(tmp_path / "ec")
    (tmp_path / "ec").write_bytes(b"not a folder")
    with pytest.raises(ECStoreError):
        store.put("k", b"v")


def test_exists_wraps_io_errors_like_get(tmp_path: Path) -> None:
    folder = tmp_path
    while len(str(folder)) < 3950:  # the folder itself is usable; <folder>/<128-char key> is too long
        folder = folder / ("d" * 200)
    store = SharedStorageStore(folder, max_bytes=0)
    key = "a" * 128
    with pytest.raises(ECStoreError):
        store.get(key)
    with pytest.raises(ECStoreError):
        store.exists([key])
