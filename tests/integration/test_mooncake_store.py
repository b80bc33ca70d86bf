"""MooncakeStore against a real mooncake_master and holder on 127.0.0.1 (see wire/ec_store/mooncake.py
for the semantics asserted here)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.mooncake_fixtures import LEASE_TTL_MS, MooncakeCluster, hung, mooncake_cluster, mooncake_cluster_at
from wire.ec_store import ECStoreError
from wire.ec_store.mooncake import MooncakeStore

pytestmark = pytest.mark.slow
__all__ = ["mooncake_cluster"]  # the fixture, imported for pytest

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def opened(address: str, **kwargs: object) -> Iterator[MooncakeStore]:
    store = MooncakeStore(address, **kwargs)  # type: ignore[arg-type]
    try:
        yield store
    finally:
        store.close()


def test_round_trip_small_and_5mb(mooncake_cluster: MooncakeCluster) -> None:
    small, big = b"\x00tiny\xff", os.urandom(5 << 20)
    with opened(mooncake_cluster.address) as store:
        assert store.put("rt-small", small) and store.put("rt-big", big)
        assert store.get("rt-small") == small
        assert store.get("rt-big") == big


def test_missing_key_is_none_and_exists_on_a_mix(mooncake_cluster: MooncakeCluster) -> None:
    with opened(mooncake_cluster.address) as store:
        assert store.get("mix-absent") is None
        assert store.put("mix-a", b"a") and store.put("mix-b", b"b")
        assert store.exists(["mix-a", "mix-absent", "mix-b", "mix-absent-2"]) == [True, False, True, False]
        assert store.exists([]) == []
        assert store.put("mix-empty", b"") is False  # mooncake cannot hold an empty value


def test_two_writers_of_a_key_first_wins_and_readers_see_one_whole_value(
    mooncake_cluster: MooncakeCluster,
) -> None:
    first, second = os.urandom(1 << 20), os.urandom(1 << 20)
    with opened(mooncake_cluster.address) as a, opened(mooncake_cluster.address) as b:
        assert a.put("tw-seq", first) and b.put("tw-seq", second)  # the second is idempotent success
        assert b.get("tw-seq") == first
        values = [os.urandom(3 << 20), os.urandom(3 << 20)]
        results: list[bool] = []
        barrier = threading.Barrier(2)

        def write(store: MooncakeStore, value: bytes) -> None:
            barrier.wait()
            results.append(store.put("tw-race", value))

        threads = [threading.Thread(target=write, args=(s, v)) for s, v in zip((a, b), values, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == [True, True]
        got = a.get("tw-race")
        assert got in values


def test_value_outlives_the_client_that_put_it(mooncake_cluster: MooncakeCluster) -> None:
    value = os.urandom(256 << 10)
    with opened(mooncake_cluster.address, global_segment_size_bytes=0) as producer:
        assert producer.put("outlive", value)
    with opened(mooncake_cluster.address) as consumer:
        assert consumer.exists(["outlive"]) == [True]
        assert consumer.get("outlive") == value


def test_store_does_not_import_torch(mooncake_cluster: MooncakeCluster) -> None:
    code = (
        "import sys\nfrom wire.ec_store.mooncake import MooncakeStore\n"
        f"s = MooncakeStore({mooncake_cluster.address!r}); assert s.put('nt', b'x'); s.close()\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, timeout=60)


def test_full_store_refuses_puts_until_leases_expire(tmp_path: Path) -> None:
    chunk = 2 << 20
    with (
        mooncake_cluster_at(tmp_path, segment_bytes=16 << 20) as cluster,
        opened(cluster.address, local_buffer_size_bytes=32 << 20) as store,
    ):
        assert store.put("too-big", os.urandom(20 << 20)) is False  # larger than all the held memory
        keys: list[str] = []
        refused = 0
        for i in range(16):  # 32 MiB offered to 16 MiB, every value kept leased by an exists
            if store.put(f"full-{i}", os.urandom(chunk)):
                keys.append(f"full-{i}")
            else:
                refused += 1
            store.exists(keys)
        assert refused > 0
        assert store.get(keys[0]) is not None  # leased values were not evicted
        time.sleep(LEASE_TTL_MS / 1000 + 0.2)
        deadline = time.monotonic() + 10
        while not store.put("after-leases", os.urandom(chunk)):  # eviction runs in the background
            assert time.monotonic() < deadline, "puts still refused long after the leases expired"
            time.sleep(0.2)
        assert store.get("after-leases") is not None


def _bounded(call: Callable[[], object], limit_s: float = 10.0) -> float:
    start = time.monotonic()
    with pytest.raises(ECStoreError):
        call()
    took = time.monotonic() - start
    assert took < limit_s
    return took


def test_master_killed_every_call_raises_in_bounded_time(tmp_path: Path) -> None:
    with mooncake_cluster_at(tmp_path) as cluster:
        store = MooncakeStore(cluster.address, retry_after_s=0.0)  # no backoff: each call really tries
        backed_off = MooncakeStore(cluster.address, retry_after_s=30.0)
        assert store.put("mk", b"v") and backed_off.exists(["mk"]) == [True]
        cluster.master.kill()
        for call in (
            lambda: store.exists(["mk", "other"]),
            lambda: store.get("mk"),
            lambda: store.put("mk2", b"w"),
            lambda: MooncakeStore(cluster.address),
        ):
            _bounded(call)
        _bounded(lambda: backed_off.get("mk"))
        for call in (lambda: backed_off.exists(["mk"]), lambda: backed_off.put("mk3", b"x")):
            assert _bounded(call) < 5.0  # within the 30 s backoff: no new attempt
        start = time.monotonic()
        store.close()
        backed_off.close()
        assert time.monotonic() - start < 10
        with pytest.raises(ECStoreError, match="closed"):
            store.get("mk")


def test_hung_master_calls_time_out(tmp_path: Path) -> None:
    with mooncake_cluster_at(tmp_path) as cluster:
        store = MooncakeStore(cluster.address, rpc_timeout_ms=1000, retry_after_s=0.0)
        try:
            assert store.put("hung", b"v")
            with hung(cluster.master):
                for call in (
                    lambda: store.exists(["hung"]),
                    lambda: store.get("hung"),
                    lambda: store.put("h2", b"w"),
                ):
                    assert _bounded(call) < 10  # two RPC timeouts of 1 s at most, on a busy machine
        finally:
            store.close()


def test_hung_holder_transfer_times_out(tmp_path: Path) -> None:
    with mooncake_cluster_at(tmp_path) as cluster, opened(cluster.address, transfer_timeout_s=2) as store:
        assert store.put("held", os.urandom(1 << 20))
        with hung(cluster.holder):
            start = time.monotonic()
            with contextlib.suppress(ECStoreError):
                assert store.get("held") is None  # or the error: the value could not be read
            assert time.monotonic() - start < 10
