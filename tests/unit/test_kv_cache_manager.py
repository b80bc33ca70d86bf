"""KVCacheManager: exact block ids, sharing through the prefix cache, eviction order, and a seeded soak
that simulates the K/V each block holds to prove every prefix hit is right (what a block's hash covers:
test_kv_block_hashing.py)."""

from __future__ import annotations

import random

import pytest

from engine.kv_cache_manager import KVCacheManager
from tests.unit.kv_cache_support import IMG, Req, admit, check, grow, image, snapshot

# ---------------------------------------------------------------- allocation


def test_chunked_growth_takes_exact_ids_in_order() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = Req("a", list(range(10)))
    assert admit(m, a, 3) == [0]
    assert grow(m, a, 1) == []  # 4 tokens: block 0 exactly full
    assert grow(m, a, 5) == [1, 2]  # 9 tokens
    assert grow(m, a, 1) == []
    b = Req("b", list(range(100, 105)))
    assert admit(m, b) == [3, 4]
    a.output_token_ids.append(7)  # 11 tokens, 10 computed: decode
    assert grow(m, a, 1) == []
    a.output_token_ids.append(7)
    assert grow(m, a, 1) == []  # 12 tokens fill block 2
    a.output_token_ids.append(7)
    assert grow(m, a, 1) == [5]
    assert m.block_ids("a") == [0, 1, 2, 5] and m.block_ids("b") == [3, 4]
    assert m.num_free_blocks == 2 and m.usage == 6 / 8


def test_allocation_failure_has_no_side_effect() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = Req("a", list(range(12)))
    admit(m, a)  # 3 blocks, 2 of them full and cached
    b = Req("b", list(range(8)) + [50] * 6)  # hits a's 2 full blocks; needs 2 more, 1 free
    computed, num_hit = m.get_computed_blocks(b)
    assert (computed, num_hit) == ([0, 1], 8)
    b.num_computed_tokens = num_hit
    before = snapshot(m)
    assert not m.can_allocate(b, 6, computed)
    assert m.allocate_slots(b, 6, computed) is None
    assert snapshot(m) == before and m.block_ids("b") == []
    assert m.allocate_slots(b, 4, computed) == [0, 1, 3]  # a chunk that fits
    check(m)
    before = snapshot(m)
    assert m.allocate_slots(b, 5) is None  # growth that does not fit
    assert snapshot(m) == before


def test_free_returns_blocks_and_drops_references() -> None:
    m = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a, b = Req("a", list(range(10))), Req("b", list(range(10)))
    admit(m, a)
    admit(m, b)
    assert m.block_ids("b") == [0, 1, 3]
    assert [m._pool.ref_count(i) for i in range(6)] == [2, 2, 1, 1, 0, 0]
    m.free("a")
    check(m)
    assert [m._pool.ref_count(i) for i in range(6)] == [1, 1, 0, 1, 0, 0]
    assert m.num_free_blocks == 3 and m.block_ids("a") == []
    m.free("b")
    m.free("b")  # idempotent
    check(m)
    assert m.num_free_blocks == 6 and m.usage == 0.0
    # b's blocks went back tail first, after a's tail block 2
    assert list(m._pool._free) == [4, 5, 2, 3, 1, 0]


# ---------------------------------------------------------------- prefix sharing


def test_same_prompt_shares_full_blocks_only() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = Req("a", list(range(10)))
    admit(m, a)
    b = Req("b", list(range(10)))
    computed, num_hit = m.get_computed_blocks(b)
    assert (computed, num_hit) == ([0, 1], 8)  # block 2 holds 2 tokens: never shared
    assert admit(m, b) == [0, 1, 3]
    assert m._pool.ref_count(0) == m._pool.ref_count(1) == 2 and m._pool.ref_count(3) == 1


def test_hit_leaves_at_least_one_token_to_compute() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    admit(m, Req("a", list(range(8))))
    assert m.get_computed_blocks(Req("b", list(range(8)))) == ([0], 4)
    assert m.get_computed_blocks(Req("c", list(range(9)))) == ([0, 1], 8)
    assert m.get_computed_blocks(Req("d", list(range(4)))) == ([], 0)
    assert m.get_computed_blocks(Req("e", [0, 1, 2, 9, 4, 5, 6, 7, 8])) == ([], 0)


def test_blocks_register_once_full_and_first_mapping_wins() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a, b = Req("a", list(range(10))), Req("b", list(range(10)))
    admit(m, a, 3)  # block 0 not full yet: nothing cached
    assert m.get_computed_blocks(b) == ([], 0)
    admit(m, b)  # b fills its own blocks 1, 2 and registers them first
    assert m.block_ids("b") == [1, 2, 3]
    grow(m, a, 7)  # a's blocks 0 and 4 hold the same K/V; the existing mapping stays
    assert m._pool.hash_of(0) is None and m._pool.hash_of(4) is None
    c = Req("c", list(range(12)))
    assert m.get_computed_blocks(c) == ([1, 2], 8)


def test_decode_growth_caches_full_output_blocks() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = Req("a", [1, 2, 3, 4, 5, 6])
    admit(m, a)
    for token in [7, 8, 9, 10]:  # sampled tokens, each computed in the next step
        a.output_token_ids.append(token)
        grow(m, a, 1)
    assert a.num_computed_tokens == 10
    b = Req("b", list(range(1, 12)))  # a's prompt + outputs, and one more token
    assert m.get_computed_blocks(b) == ([0, 1], 8)
    a.output_token_ids.append(11)
    grow(m, a, 1)
    a.output_token_ids.append(12)
    grow(m, a, 1)  # 12 computed: block 2 (9, 10, 11, 12) is full
    assert m.get_computed_blocks(Req("c", list(range(1, 14)))) == (m.block_ids("a")[:3], 12)


def test_resumed_request_finds_its_own_blocks() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = Req("a", list(range(9)))
    admit(m, a)
    a.output_token_ids += [40, 41, 42]
    grow(m, a, 1)
    grow(m, a, 1)
    table = m.block_ids("a")
    m.free("a")  # preempted
    check(m)
    assert "a" not in m._block_hashes
    a.num_computed_tokens = 0
    computed, num_hit = m.get_computed_blocks(a)
    assert (computed, num_hit) == (table[:2], 8)  # block 2 is not full: 9, 40, 41 (42 not computed)
    assert admit(m, a) == [*table[:2], 3]


def test_prefix_caching_disabled() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(m, Req("a", list(range(10))))
    b = Req("b", list(range(10)))
    assert m.get_computed_blocks(b) == ([], 0)
    assert admit(m, b) == [3, 4, 5]
    m.free("a")
    assert m.get_computed_blocks(Req("c", list(range(10)))) == ([], 0)
    check(m)


def test_counters_and_reset() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    m.record_prefix_lookup(10, 0)
    m.record_prefix_lookup(10, 8)
    assert (m.num_prefix_queries_tokens, m.num_prefix_hits_tokens) == (20, 8)
    a = Req("a", list(range(10)))
    admit(m, a)
    admit(m, Req("b", list(range(5))))
    m.free("b")
    assert m.reset_prefix_cache()
    check(m)
    assert m.get_computed_blocks(Req("c", list(range(10)))) == ([], 0)
    assert m.get_computed_blocks(Req("d", list(range(5)))) == ([], 0)
    grow(m, a, 0)  # a's blocks are not offered again
    assert m._pool.num_cached_blocks == 0


def test_a_failed_steps_registrations_are_taken_back() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = Req("a", list(range(10)))
    admit(m, a, 4)  # a successful step: block 0
    assert m.take_newly_cached() == [(0, m._pool.hash_of(0))]
    grow(m, a, 6)  # the step that fails: blocks 1 (full) and 2 (partial)
    b = Req("b", list(range(10)))
    assert admit(m, b, 1) == [0, 1, 3]  # admitted in the same step, sharing what a just registered
    failed = m.take_newly_cached()
    assert [block for block, _ in failed] == [1]  # only a's new full block; b registered nothing
    assert m.take_newly_cached() == []
    m.free("a")
    m.free("b")
    m.uncache(failed)
    check(m)
    assert m._pool.hash_of(1) is None and m._pool.hash_of(0) is not None
    assert m.get_computed_blocks(Req("c", list(range(10)))) == ([0], 4)  # block 0 stays cached
    assert list(m._pool._free) == [4, 5, 6, 7, 2, 3, 1, 0]  # uncache moves nothing
    m.uncache(failed)  # idempotent
    check(m)


def test_uncache_leaves_a_block_that_was_taken_for_new_content() -> None:
    m = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=True)
    a = Req("a", list(range(5)))
    admit(m, a)
    failed = m.take_newly_cached()
    m.free("a")
    b = Req("b", list(range(50, 58)))
    admit(m, b)  # takes both blocks (1, then 0): their hashes are now b's
    m.uncache(failed)
    check(m)
    assert m.get_computed_blocks(Req("c", list(range(50, 58)) + [1])) == ([1, 0], 8)


def test_no_journal_without_prefix_caching_or_after_reset() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(m, Req("a", list(range(10))))
    assert m.take_newly_cached() == []
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    admit(m, Req("a", list(range(10))))
    m.reset_prefix_cache()
    assert m.take_newly_cached() == []


def test_a_partial_hit_copies_a_blocks_first_tokens_into_the_requests_own() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = Req("a", list(range(12)))
    admit(m, a)  # blocks 0, 1 (hashed), 2 (not full: 12 tokens, the last one computed by the step)
    m.take_newly_cached()  # the next step
    b = Req("b", [0, 1, 2, 3, 4, 5, 50, 51, 52])  # block 1 differs from its third token
    assert m.get_computed_blocks(b) == ([0], 6)
    b.num_computed_tokens = 6
    assert m.allocate_slots(b, 3, [0]) == [0, 3, 4]
    assert m.take_kv_copies() == [(1, 3, 2)] and m.take_kv_copies() == []
    check(m)
    # a block's first tokens behind another parent, or with another image over them, are no hit
    assert m.get_computed_blocks(Req("c", [9, 1, 2, 3, 4, 5, 50])) == ([], 0)
    d = Req("d", [0, 1, 2, 3, 4, IMG, 60, 61], [image("img-x", 5, 1)])
    assert m.get_computed_blocks(d) == ([0], 5)  # up to the image, which a's block 1 does not hold
    m.free("d")
    assert m.get_computed_blocks(Req("e", [0, 1, 2, 3, 4, 5, 50], cache_salt="s")) == ([], 0)
    block_only = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True, prefix_match="block")
    admit(block_only, Req("a", list(range(12))))
    assert block_only.get_computed_blocks(Req("b", [0, 1, 2, 3, 4, 5, 50])) == ([0], 4)


def test_a_block_registered_in_the_step_being_planned_is_no_partial_hit() -> None:
    """Its K/V is written by that step's forward, after the step's copies."""
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    admit(m, Req("a", list(range(9))))  # blocks 0 and 1 registered in this step
    b = Req("b", [0, 1, 2, 3, 4, 5, 50])
    assert m.get_computed_blocks(b) == ([0], 4)  # block 0 is shared (written before attention reads)
    m.free("b")
    m.take_newly_cached()  # the next step
    assert m.get_computed_blocks(b) == ([0], 6)


def test_a_partial_hit_whose_block_is_taken_as_its_own_needs_no_copy() -> None:
    m = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    a = Req("a", list(range(9)))
    admit(m, a)
    m.take_newly_cached()
    m.free("a")  # free queue: 2, 1, 0 (a's blocks tail-first)
    b = Req("b", [0, 1, 2, 3, 4, 5, 50])
    admit(m, b)  # block 0 hit, block 1's first 2 tokens; takes block 2, then ...
    assert m.block_ids("b") == [0, 2] and m.take_kv_copies() == [(1, 2, 2)]
    m.free("b")
    m.take_newly_cached()
    c = Req("c", [0, 1, 2, 3, 4, 5, 60])  # free queue: 1, then b's 2 and 0; block 1 goes first
    admit(m, c)
    assert m.block_ids("c") == [0, 1] and m.take_kv_copies() == []  # block 1 keeps its K/V


# ---------------------------------------------------------------- eviction


def test_cached_free_blocks_are_evicted_least_recently_freed_first() -> None:
    m = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    a, b = Req("a", [1, 2, 3, 4, 5]), Req("b", [7, 8, 9])
    admit(m, a)  # blocks 0, 1 (cached), 2 (partial)
    admit(m, b)  # blocks 3 (cached), 4 (partial)
    m.free("b")  # free queue: 5, 4, 3
    m.free("a")  # free queue: 5, 4, 3, 2, 1, 0
    assert list(m._pool._free) == [5, 4, 3, 2, 1, 0]
    assert m.get_computed_blocks(Req("x", [1, 2, 3, 4, 0])) == ([0, 1], 4)
    assert m.get_computed_blocks(Req("y", [7, 8, 0])) == ([3], 2)
    c = Req("c", [20, 21, 22, 23, 24, 25, 26])
    assert admit(m, c, 6) == [5, 4, 3]  # evicts b's cached block 3, none of a's
    assert m.get_computed_blocks(Req("y2", [7, 8, 0])) == ([], 0)
    assert m.get_computed_blocks(Req("x2", [1, 2, 3, 4, 0])) == ([0, 1], 4)
    assert grow(m, c, 1) == [2]
    d = Req("d", [30, 31, 32])
    assert admit(m, d, 1) == [1]  # a's second block: only the first one still hits
    assert m.get_computed_blocks(Req("x3", [1, 2, 3, 4, 0])) == ([0], 2)


def test_cached_free_computed_blocks_count_against_the_free_pool() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    admit(m, Req("a", [1, 2, 3, 4]))
    m.free("a")  # blocks 0, 1 cached-free
    admit(m, Req("other", [9]))  # takes block 2 (the least recently freed was 2, then 3)
    b = Req("b", [1, 2, 3, 4, 5, 6])
    computed, num_hit = m.get_computed_blocks(b)
    assert (computed, num_hit) == ([0, 1], 4)
    b.num_computed_tokens = num_hit
    # 3 free blocks: reviving 0 and 1 leaves one, and the 2 remaining tokens need one
    assert m.can_allocate(b, 2, computed)
    assert not m.can_allocate(b, 3, computed)
    assert m.allocate_slots(b, 3, computed) is None
    assert m.allocate_slots(b, 2, computed) == [0, 1, 3]
    assert m.num_free_blocks == 0
    check(m)


# ---------------------------------------------------------------- randomised


def test_can_allocate_agrees_with_allocate_slots_in_random_trials() -> None:
    rng = random.Random(7)
    for trial in range(200):
        m = KVCacheManager(
            num_blocks=rng.randint(1, 12), block_size=rng.choice([1, 2, 4]), enable_prefix_caching=True
        )
        live: list[Req] = []
        for i in range(12):
            if live and rng.random() < 0.3:
                m.free(live.pop(rng.randrange(len(live))).req_id)
                check(m)
                continue
            req = Req(f"{trial}-{i}", [rng.randrange(3) for _ in range(rng.randint(1, 16))])
            computed, num_hit = m.get_computed_blocks(req)
            req.num_computed_tokens = num_hit
            n = rng.randint(1, req.num_tokens - num_hit)
            before = snapshot(m)
            can = m.can_allocate(req, n, computed)
            new = m.allocate_slots(req, n, computed)
            assert can == (new is not None)
            if new is None:
                assert snapshot(m) == before
                m.free(req.req_id)  # drops the hashes get_computed_blocks computed
            else:
                live.append(req)
            check(m)


def describe(req: Req) -> list[tuple[object, ...]]:
    """What determines the K/V at each position: the token, and for placeholders which image and
    which of its embeddings."""
    desc: list[tuple[object, ...]] = [(t,) for t in req.all_token_ids]
    for f in req.mm_features:
        for j in range(f.num_tokens):
            desc[f.offset + j] = (desc[f.offset + j][0], f.mm_hash, j)
    return desc


@pytest.mark.parametrize("failure_rate", [0.0, 0.15])
def test_soak_random_requests_never_leak_and_every_hit_holds_the_right_kv(failure_rate: float) -> None:
    """With ``failure_rate``, that share of the steps fail: their K/V is never written, the request
    ends (and is retried from scratch) and the step's registrations are taken back (``uncache``)."""
    rng = random.Random(1234)
    bs = 4
    m = KVCacheManager(num_blocks=48, block_size=bs, enable_prefix_caching=True)
    # content[b]: the K/V block b holds, as the descriptors of every position up to its end (K/V at
    # a position depends on the whole prefix)
    content: dict[int, tuple[tuple[object, ...], ...]] = {}
    prefixes = [[rng.randrange(4) for _ in range(rng.randint(0, 20))] for _ in range(5)]
    max_outputs: dict[str, int] = {}
    waiting: list[Req] = []
    for i in range(1000):
        prompt = list(rng.choice(prefixes))
        features = []
        if rng.random() < 0.4:
            offset, n = len(prompt) + rng.randint(0, 3), rng.randint(1, 10)
            prompt += [rng.randrange(4) for _ in range(offset - len(prompt))] + [IMG] * n
            features.append(image(f"img{rng.randrange(3)}", offset, n))
        prompt += [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        waiting.append(Req(f"r{i}", prompt, features))
        max_outputs[f"r{i}"] = rng.randint(1, 10)
    waiting.reverse()  # pop() serves in arrival order
    running: list[Req] = []
    num_hits = num_failures = num_partial_hits = 0

    def compute(req: Req, n: int) -> None:
        desc = tuple(describe(req))
        start = req.num_computed_tokens
        table = m.block_ids(req.req_id)
        if start % bs:  # the block it goes on filling holds the right K/V so far (a partial hit's copy)
            assert content[table[start // bs]][:start] == desc[:start], "a partial hit on the wrong K/V"
        for i in range(start // bs, -(-(start + n) // bs)):
            content[table[i]] = desc[: min((i + 1) * bs, start + n)]
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:  # the step samples a token
            if len(req.output_token_ids) >= max_outputs[req.req_id]:
                running.remove(req)
                m.free(req.req_id)
            else:
                req.output_token_ids.append(rng.randrange(4))

    def compute_or_fail(req: Req, n: int) -> None:
        newly_cached = m.take_newly_cached()
        if rng.random() >= failure_rate:
            compute(req, n)
            return
        running.remove(req)
        m.free(req.req_id)
        m.uncache(newly_cached)
        req.num_computed_tokens = 0
        waiting.append(req)  # retried as if new
        nonlocal num_failures
        num_failures += 1

    def preempt(req: Req) -> None:
        running.remove(req)
        m.free(req.req_id)
        req.num_computed_tokens = 0
        waiting.append(req)

    while waiting or running:
        op = rng.random()
        if waiting and (op < 0.3 or not running):
            req = waiting[-1]
            computed, num_hit = m.get_computed_blocks(req)
            desc = tuple(describe(req))
            for i, b in enumerate(computed):
                assert content.get(b) == desc[: (i + 1) * bs], "a prefix hit on the wrong K/V"
            num_partial = num_hit - len(computed) * bs
            num_partial_hits += num_partial > 0
            num_hits += num_hit
            req.num_computed_tokens = num_hit
            n = rng.randint(1, req.num_tokens - num_hit)
            before = snapshot(m)
            can = m.can_allocate(req, n, computed)
            new = m.allocate_slots(req, n, computed)
            assert can == (new is not None)
            if new is None:
                assert snapshot(m) == before
                req.num_computed_tokens = 0
                if running:
                    preempt(rng.choice(running))
            else:
                for source, destination, num_copied in m.take_kv_copies():  # before the step's forward
                    assert num_copied == num_partial and destination == m.block_ids(req.req_id)[len(computed)]
                    content[destination] = content[source][: len(computed) * bs + num_copied]
                waiting.pop()
                running.append(req)
                compute_or_fail(req, n)
        elif op < 0.9:
            req = rng.choice(running)
            n = rng.randint(1, req.num_tokens - req.num_computed_tokens)
            before = snapshot(m)
            can = m.can_allocate(req, n)
            new = m.allocate_slots(req, n)
            assert can == (new is not None)
            if new is None:
                assert snapshot(m) == before
                preempt(rng.choice(running))
            else:
                compute_or_fail(req, n)
        else:
            preempt(rng.choice(running))
        check(m)

    assert m.num_free_blocks == m.num_blocks and m.usage == 0.0
    assert not m._tables and not m._block_hashes and not m._num_cached_blocks
    assert num_hits > 1000  # the shared prefixes were actually reused
    assert num_partial_hits > 100  # and the first tokens of blocks
    assert (num_failures > 100) == (failure_rate > 0)
