"""EncoderCacheManager: sharing, freeable reuse, exact eviction orders."""

from __future__ import annotations

import random

from engine.encoder_cache_manager import EncoderCacheManager


def check(m: EncoderCacheManager) -> None:
    assert sum(m._num_tokens.values()) == m.num_used_tokens <= m.capacity_tokens
    assert m.num_free_tokens == m.capacity_tokens - m.num_used_tokens
    assert set(m._freeable) == {h for h, users in m._users.items() if not users}
    assert m._num_freeable_tokens == sum(m._num_tokens[h] for h in m._freeable)
    pairs_by_entry = {(r, h) for h, users in m._users.items() for r in users}
    pairs_by_req = {(r, h) for r, hs in m._req_entries.items() for h in hs}
    assert pairs_by_entry == pairs_by_req


def test_two_requests_share_one_entry() -> None:
    m = EncoderCacheManager(10)
    assert not m.lookup("a", "r1")
    assert m.can_allocate(4)
    m.allocate("a", 4, "r1")
    assert m.lookup("a", "r2")
    assert (m.num_queries, m.num_hits, m.num_hit_tokens) == (2, 1, 4)  # the hit reused 4 embeddings
    assert m.num_used_tokens == 4 and m.num_free_tokens == 6
    m.release("r1", "a")
    assert not m.can_allocate(7)  # "a" still used by r2: nothing to evict
    m.release("r2", "a")
    assert m.can_allocate(7)
    assert m.take_evicted() == ["a"]
    check(m)


def test_freeable_entry_is_reused_and_leaves_eviction_order() -> None:
    m = EncoderCacheManager(10)
    m.allocate("a", 5, "r1")
    m.allocate("b", 5, "r1")
    m.release_all("r1")  # a then b become freeable
    assert "a" in m and m.num_used_tokens == 10
    assert m.lookup("a", "r2")  # revived: no longer freeable
    assert m.num_hit_tokens == 5
    check(m)
    assert m.can_allocate(5)
    assert m.take_evicted() == ["b"]
    assert not m.can_allocate(6)  # only "a" (in use) is left
    assert m.take_evicted() == []
    check(m)


def test_evicts_oldest_freeable_first() -> None:
    m = EncoderCacheManager(10)
    for h, n in [("a", 2), ("b", 3), ("c", 2), ("d", 3)]:
        m.allocate(h, n, "r-" + h)
    # freeable order is release order, not allocation order
    for h in ["c", "a", "d", "b"]:
        m.release("r-" + h, h)
    assert m.can_allocate(3)  # c (2) is not enough, c + a (4) is
    assert m.take_evicted() == ["c", "a"]
    m.allocate("e", 3, "r-e")
    assert m.can_allocate(3)
    assert m.take_evicted() == ["d"]
    check(m)


def test_dynamic_resolution_sizes_evict_by_embeddings_not_entries() -> None:
    """Qwen-like items (a 224x224 thumbnail is 64 embeddings, a 1024x768 screenshot 1,012): room for a
    large item is made by evicting exactly as many small freeable entries as needed, oldest first, and
    never an entry in use, however old."""
    m = EncoderCacheManager(1400)
    for h, n in [("in-use", 64), ("t1", 64), ("t2", 64), ("big", 1012), ("t3", 64)]:
        m.allocate(h, n, "r-" + h)
    for h in ["t1", "t2", "big", "t3"]:
        m.release("r-" + h, h)
    assert m.num_free_tokens == 132
    assert m.can_allocate(200)  # 68 more: t1 alone frees 64, t1 + t2 free 128
    assert m.take_evicted() == ["t1", "t2"]
    m.allocate("mid", 200, "r-mid")
    assert m.can_allocate(1000)  # 940 more: "big" (1,012) alone is enough, t3 stays
    assert m.take_evicted() == ["big"]
    assert "in-use" in m and "t3" in m
    m.allocate("shot", 1000, "r-shot")
    assert not m.can_allocate(200)  # only t3 (64) is freeable: evicting it would not make room
    assert m.take_evicted() == [] and "t3" in m
    check(m)


def test_can_allocate_evicts_nothing_when_it_cannot_succeed() -> None:
    m = EncoderCacheManager(10)
    m.allocate("a", 3, "r1")
    m.allocate("b", 4, "r2")
    m.release_all("r1")
    # free 3 + freeable 3 = 6 < 7: no eviction at all
    assert not m.can_allocate(7)
    assert m.take_evicted() == [] and "a" in m
    assert m.lookup("a", "r3")
    check(m)


def test_item_larger_than_capacity() -> None:
    m = EncoderCacheManager(10)
    m.allocate("a", 2, "r1")
    m.release_all("r1")
    assert not m.can_allocate(11)
    assert m.take_evicted() == [] and "a" in m
    assert m.can_allocate(10)
    assert m.take_evicted() == ["a"]


def test_each_eviction_reported_once() -> None:
    m = EncoderCacheManager(4)
    m.allocate("a", 4, "r1")
    m.release("r1", "a")
    m.release("r1", "a")  # idempotent: "a" is freeable once, not twice
    assert m.can_allocate(4)
    m.allocate("b", 4, "r2")
    m.release_all("r2")
    assert m.can_allocate(4)
    assert m.take_evicted() == ["a", "b"]
    assert m.take_evicted() == []
    m.allocate("a", 4, "r3")  # a new entry under an old key
    m.release_all("r3")
    m.reset()
    assert m.take_evicted() == ["a"]
    check(m)


def test_release_all_frees_every_entry_of_the_request() -> None:
    m = EncoderCacheManager(10)
    m.allocate("a", 2, "r1")
    m.allocate("b", 2, "r1")
    assert m.lookup("b", "r2")
    m.release_all("r1")
    m.release_all("r1")
    m.release_all("unknown")
    assert m.can_allocate(8)  # only "a" is freeable
    assert m.take_evicted() == ["a"]
    assert "b" in m
    check(m)


def test_reset_evicts_freeable_only() -> None:
    m = EncoderCacheManager(10)
    for h in "abc":
        m.allocate(h, 2, "r-" + h)
    m.release_all("r-c")
    m.release_all("r-a")
    m.reset()
    assert m.take_evicted() == ["c", "a"]
    assert "b" in m and m.num_used_tokens == 2
    check(m)


def test_discard_evicts_a_failed_steps_entry_and_reports_it() -> None:
    m = EncoderCacheManager(10)
    m.allocate("a", 4, "r1")  # an earlier step's entry, freeable
    m.release_all("r1")
    m.allocate("b", 4, "r2")  # the failed step's entry, shared by r3 in the same step
    assert m.lookup("b", "r3")
    m.release_all("r2")
    m.release_all("r3")
    m.discard("b")
    check(m)
    assert "b" not in m and "a" in m and m.num_used_tokens == 4
    assert m.take_evicted() == ["b"]
    assert not m.lookup("b", "r4")  # encoded again
    m.discard("b")  # no longer held: nothing happens
    assert m.take_evicted() == []
    check(m)


def test_discard_with_caching_disabled() -> None:
    m = EncoderCacheManager(0)
    m.allocate("a", 4, "r1")
    m.release_all("r1")  # evicted at zero users already
    m.discard("a")
    assert m.take_evicted() == ["a"]
    check(m)


def test_random_operations_keep_invariants() -> None:
    rng = random.Random(7)
    m = EncoderCacheManager(12)
    held_by_worker: set[str] = set()  # what a worker holding exactly the allocated tensors has
    for _ in range(5000):
        op = rng.random()
        h, req = f"h{rng.randrange(10)}", f"r{rng.randrange(6)}"
        if op < 0.5:
            if not m.lookup(h, req):
                n = 1 + int(h[1:]) % 5
                if m.can_allocate(n):
                    for e in m.take_evicted():
                        held_by_worker.remove(e)
                    m.allocate(h, n, req)
                    held_by_worker.add(h)
        elif op < 0.8:
            m.release(req, h)
        elif op < 0.97:
            m.release_all(req)
        else:
            m.reset()
        for e in m.take_evicted():
            held_by_worker.remove(e)
        assert held_by_worker == set(m._num_tokens)
        check(m)
