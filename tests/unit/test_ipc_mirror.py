"""IpcMirror: exact decisions and eviction orders, pins, capacity edges."""

from __future__ import annotations

import pytest

from app.inputs.ipc_mirror import IpcMirror, MirrorDecision, MirrorEntry

HIT, STORE, UNCACHED = MirrorDecision.HIT, MirrorDecision.STORE, MirrorDecision.UNCACHED


def filled(capacity: int, *sizes: tuple[str, int]) -> IpcMirror:
    m = IpcMirror(capacity)
    decisions, evicted = m.record_request([(h, n, 10 * n) for h, n in sizes])
    assert decisions == [STORE] * len(sizes) and evicted == []
    return m


def test_store_then_hit_and_lru_eviction_order() -> None:
    m = filled(10, ("a", 3), ("b", 3), ("c", 3))
    assert m.lookup_and_pin("a") == MirrorEntry(3, 30)
    m.unpin("a")
    assert m.keys() == ["a", "b", "c"]  # phase 1 does not touch
    assert m.record_request([("a", 3, 30)]) == ([HIT], [])
    assert m.keys() == ["b", "c", "a"]
    # needs 4 free bytes: b (3) then c (3) go, LRU first
    assert m.record_request([("d", 5, 50)]) == ([STORE], ["b", "c"])
    assert m.keys() == ["a", "d"] and m.num_bytes == 8 and len(m) == 2
    assert (m.num_queries, m.num_hits) == (1, 1)


def test_pin_protects_from_eviction() -> None:
    m = filled(10, ("a", 3), ("b", 3), ("c", 3))
    assert m.lookup_and_pin("a") is not None
    assert m.lookup_and_pin("a") is not None  # two requests pin it
    assert m.record_request([("d", 3, 30)]) == ([STORE], ["b"])
    m.unpin("a")
    assert m.record_request([("e", 3, 30)]) == ([STORE], ["c"])
    m.unpin("a")
    assert m.record_request([("f", 3, 30)]) == ([STORE], ["a"])
    assert m.keys() == ["d", "e", "f"]
    with pytest.raises(AssertionError):
        m.unpin("a")


def test_uncached_when_too_large_or_everything_pinned() -> None:
    m = filled(10, ("a", 4), ("b", 4))
    assert m.record_request([("big", 11, 110)]) == ([UNCACHED], [])
    m.lookup_and_pin("a")
    m.lookup_and_pin("b")
    # 5 bytes need 3 freed; every entry is pinned: nothing evicted needlessly
    assert m.record_request([("c", 5, 50)]) == ([UNCACHED], [])
    assert m.record_request([("d", 2, 20)]) == ([STORE], [])  # 2 fit without eviction
    assert m.keys() == ["a", "b", "d"]
    m.unpin("b")
    # fit is decided before evicting: d (2) + b (4) free 6 >= needed 5
    assert m.record_request([("c", 5, 50)]) == ([STORE], ["b", "d"])


def test_partial_victims_are_not_evicted_when_fit_fails() -> None:
    m = filled(10, ("a", 2), ("b", 4), ("c", 4))
    m.lookup_and_pin("b")
    m.lookup_and_pin("c")
    assert m.record_request([("d", 9, 90)]) == ([UNCACHED], [])
    assert m.keys() == ["a", "b", "c"]


def test_capacity_zero_disables() -> None:
    m = IpcMirror(0)
    assert m.record_request([("a", 1, 10), ("a", 1, 10), ("z", 0, 0)]) == ([UNCACHED] * 3, [])
    assert m.lookup_and_pin("a") is None
    assert m.keys() == [] and m.num_bytes == 0 and m.capacity_bytes == 0
    assert (m.num_queries, m.num_hits) == (1, 0)


def test_duplicate_key_in_one_request() -> None:
    m = IpcMirror(10)
    assert m.record_request([("a", 4, 40), ("a", 4, 40)]) == ([STORE, HIT], [])
    assert m.record_request([("big", 11, 0), ("big", 11, 0)]) == ([UNCACHED, UNCACHED], [])


def test_same_request_entries_are_not_evicted_within_the_call() -> None:
    m = filled(10, ("a", 3), ("b", 3), ("c", 3))
    # a is touched (HIT), x (4) needs 3 freed: b goes; y (4) needs 4 freed but only c (3) may go,
    # a and x belong to this request: UNCACHED, and c stays
    decisions, evicted = m.record_request([("a", 3, 30), ("x", 4, 40), ("y", 4, 40)])
    assert decisions == [HIT, STORE, UNCACHED] and evicted == ["b"]
    assert m.keys() == ["c", "a", "x"]
    # a new request may evict them
    assert m.record_request([("y", 4, 40)]) == ([STORE], ["c", "a"])


def test_invalidate_and_reset_keep_pins() -> None:
    m = filled(10, ("a", 3), ("b", 3), ("c", 3))
    m.lookup_and_pin("b")
    m.invalidate(["b", "zz"])
    assert m.keys() == ["a", "c"] and m.num_bytes == 6 and "b" not in m
    m.reset()
    assert m.keys() == [] and m.num_bytes == 0
    m.unpin("b")  # still balances
    assert m.record_request([("b", 3, 30)]) == ([STORE], [])
