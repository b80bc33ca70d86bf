"""``ReconnectingStore`` over the real shared-storage store: it opens the backend on first use, turns a
failure into ``ECStoreError`` and then leaves the backend alone for ``retry_after_s`` (one failed call
per interval, not one connection attempt per item), and uses the store again once it is back."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from wire.ec_store import ECConfig, ECRole, ECStore, ECStoreError, open_store
from wire.ec_store import reconnecting as module
from wire.ec_store.reconnecting import ReconnectingStore
from wire.ec_store.shared_storage import SharedStorageStore

RETRY_AFTER_S = 0.2


class Opener:
    """``open_store`` itself, counting how often the backend is opened."""

    def __init__(self) -> None:
        self.num_opens = 0

    def __call__(self, config: ECConfig) -> ECStore:
        self.num_opens += 1
        return open_store(config)


def reconnecting(folder: Path, retry_after_s: float = RETRY_AFTER_S) -> tuple[ReconnectingStore, Opener]:
    opener = Opener()
    config = ECConfig("shared-storage", ECRole.BOTH, storage_path=str(folder))
    return ReconnectingStore(config, retry_after_s=retry_after_s, opener=opener), opener


class Clock:
    """The store's ``time.monotonic``: it moves only when a test waits an interval out, so "not within
    the interval" holds however slowly the test runs."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(module, "time", clock)
    return clock


def wait_out(clock: Clock, store: ReconnectingStore) -> None:
    clock.now += store.retry_after_s + 0.05


def test_the_backend_is_opened_on_first_use_and_kept(tmp_path: Path) -> None:
    store, opener = reconnecting(tmp_path / "ec")
    assert opener.num_opens == 0 and not (tmp_path / "ec").exists()  # nothing before the first call
    assert store.put("k", b"value") is True
    assert store.get("k") == b"value" and store.exists(["k", "x"]) == [True, False]
    assert opener.num_opens == 1
    assert SharedStorageStore(tmp_path / "ec", max_bytes=0).get("k") == b"value"  # really in the folder


def test_a_store_that_cannot_open_is_retried_only_after_the_interval(tmp_path: Path, clock: Clock) -> None:
    folder = tmp_path / "ec"
    folder.write_bytes(b"a file where the folder should be")
    store, opener = reconnecting(folder)
    with pytest.raises(ECStoreError, match="cannot create"):
        store.exists(["k"])
    assert opener.num_opens == 1
    for call in (lambda: store.exists(["k"]), lambda: store.get("k"), lambda: store.put("k", b"v")):
        with pytest.raises(ECStoreError, match="down"):
            call()
    assert opener.num_opens == 1  # no attempt within the interval

    wait_out(clock, store)
    with pytest.raises(ECStoreError, match="cannot create"):  # still broken: one more attempt
        store.get("k")
    assert opener.num_opens == 2

    folder.unlink()
    folder.mkdir()  # the store is back
    with pytest.raises(ECStoreError, match="down"):
        store.get("k")  # but the interval since the last failure has not passed
    wait_out(clock, store)
    assert store.put("k", b"v") is True and store.get("k") == b"v"
    assert opener.num_opens == 3


def test_a_failing_call_drops_the_backend_and_reopens_after_the_interval(
    tmp_path: Path, clock: Clock
) -> None:
    folder = tmp_path / "ec"
    store, opener = reconnecting(folder)
    store.put("k", b"v")
    shutil.rmtree(folder)
    folder.write_bytes(b"the volume went away")
    with pytest.raises(ECStoreError):
        store.get("k")
    with pytest.raises(ECStoreError, match="down"):
        store.get("k")  # the failed backend was dropped; not reopened yet
    assert opener.num_opens == 1

    folder.unlink()
    wait_out(clock, store)
    assert store.get("k") is None  # reopened: an empty folder
    assert store.put("k", b"w") is True and store.get("k") == b"w"
    assert opener.num_opens == 2


def test_a_refused_put_is_not_a_failure(tmp_path: Path) -> None:
    opener = Opener()
    config = ECConfig("shared-storage", ECRole.BOTH, storage_path=str(tmp_path), storage_max_bytes=10)
    store = ReconnectingStore(config, retry_after_s=60.0, opener=opener)
    assert store.put("big", bytes(11)) is False  # over the bound: refused, the store is fine
    assert store.put("small", bytes(5)) is True and store.get("small") == bytes(5)
    assert opener.num_opens == 1


def test_close_drops_the_backend_and_the_next_call_reopens(tmp_path: Path) -> None:
    store, opener = reconnecting(tmp_path / "ec")
    store.put("k", b"v")
    store.close()
    store.close()  # idempotent
    assert store.get("k") == b"v" and opener.num_opens == 2
