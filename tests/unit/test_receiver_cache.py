"""ReceiverCache: obeys the mirror's evictions and keeps the same LRU order; no policy of its own."""

from __future__ import annotations

from engine.receiver_cache import ReceiverCache, ReceiverCachePartitions


def test_put_get_touch_order() -> None:
    c: ReceiverCache[str] = ReceiverCache()
    c.put("a", "A", 3)
    c.put("b", "B", 2)
    c.put("c", "C", 1)
    assert c.keys() == ["a", "b", "c"] and c.num_bytes == 6 and len(c) == 3
    assert c.get("a") == "A"
    assert c.keys() == ["b", "c", "a"]
    assert c.get("zz") is None
    c.put("b", "B2", 5)  # replace: most recent, size updated
    assert c.keys() == ["c", "a", "b"] and c.num_bytes == 9
    assert "b" in c and "zz" not in c


def test_evict_ignores_missing_and_clear() -> None:
    c: ReceiverCache[str] = ReceiverCache()
    c.put("a", "A", 3)
    c.put("b", "B", 2)
    c.evict(["zz", "a", "a"])
    assert c.keys() == ["b"] and c.num_bytes == 2
    c.clear()
    assert c.keys() == [] and c.num_bytes == 0 and len(c) == 0


def test_no_eviction_policy_of_its_own() -> None:
    c: ReceiverCache[str] = ReceiverCache()
    for i in range(100):
        c.put(f"k{i}", "x", 1000)
    assert len(c) == 100 and c.num_bytes == 100_000


def test_apply_evicts_first_then_features_in_order() -> None:
    c: ReceiverCache[str] = ReceiverCache()
    c.put("a", "A", 1)
    c.put("b", "B", 1)
    c.put("c", "C", 1)
    items, missing = c.apply(
        ["a"],
        [
            ("b", None, 1, False),  # key only: touched
            ("d", "D", 2, True),  # stored as most recent
            ("e", "E", 9, False),  # uncached: used, not stored
            ("d", None, 2, False),  # same request, second use: hit
            ("a", None, 1, False),  # evicted above: missing
        ],
    )
    assert items == ["B", "D", "E", "D", None]
    assert missing == ["a"]
    assert c.keys() == ["c", "b", "d"] and c.num_bytes == 4


def test_partitions_per_sender() -> None:
    p: ReceiverCachePartitions[str] = ReceiverCachePartitions()
    p.for_sender(b"api-1").put("a", "A", 3)
    p.for_sender(b"api-2").put("a", "A", 4)
    assert p.for_sender(b"api-1").keys() == ["a"]
    assert p.num_bytes == 7
    p.for_sender(b"api-1").evict(["a"])
    assert "a" in p.for_sender(b"api-2")
    p.drop(b"api-2")
    p.drop(b"unknown")
    assert p.num_bytes == 0 and len(p.for_sender(b"api-2")) == 0
