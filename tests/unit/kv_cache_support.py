"""Helpers of the KVCacheManager tests: a request as the manager reads it, the manager's invariants
checked after every operation, and what the scheduler does to admit and grow a request."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from wire.protocol import MMFeature

IMG = 99  # placeholder token id


@dataclass
class Req:
    req_id: str
    prompt_token_ids: list[int]
    mm_features: list[MMFeature] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


def image(mm_hash: str, offset: int, num_tokens: int) -> MMFeature:
    return MMFeature(mm_hash=mm_hash, offset=offset, num_tokens=num_tokens)


def check(m: KVCacheManager) -> None:
    pool = m._pool
    refs = Counter(b for table in m._tables.values() for b in table)
    for table in m._tables.values():
        assert len(set(table)) == len(table)  # K1: no table holds a block twice
    for b in range(m.num_blocks):
        assert pool.ref_count(b) == refs[b]  # K1
        assert (pool.ref_count(b) == 0) == (b in pool._free)  # P1
    assert len(pool._free) == m.num_free_blocks
    assert m.num_free_blocks + pool.num_used_blocks == m.num_blocks  # P6
    assert m.usage == (pool.num_used_blocks / m.num_blocks if m.num_blocks else 0.0)
    hashed = {b: h for b, h in enumerate(pool._hash_of) if h is not None}
    assert {h: b for b, h in hashed.items()} == pool._block_of  # P3
    assert len(hashed) == len(pool._block_of)
    for req_id, table in m._tables.items():
        n = m._num_cached_blocks[req_id]
        assert n <= len(table)  # K3
        if m.enable_prefix_caching:
            assert n <= len(m._block_hashes[req_id])
    for b, content in pool._content.items():  # P7
        assert pool._hash_of[b] is not None and b in pool._children[content.parent]
    assert sum(map(len, pool._children.values())) == len(pool._content)
    for req_id, partial in m._partial_hits.items():  # K5 (allocate_slots checks the block still has it)
        assert req_id not in m._tables and 0 < partial.num_tokens < m.block_size
    if not m.enable_prefix_caching:  # K4
        assert not pool._block_of and not any(m._block_hashes.values())


def snapshot(m: KVCacheManager) -> object:
    pool = m._pool
    return (
        list(pool._free),
        list(pool._ref_counts),
        list(pool._hash_of),
        dict(pool._block_of),
        {r: list(t) for r, t in m._tables.items()},
        {r: list(h) for r, h in m._block_hashes.items()},
        dict(m._num_cached_blocks),
    )


def admit(m: KVCacheManager, req: Req, num_new_tokens: int | None = None) -> list[int] | None:
    """What the scheduler does for a waiting request; then the step computes the tokens."""
    computed, num_hit = m.get_computed_blocks(req)
    req.num_computed_tokens = num_hit
    n = req.num_tokens - num_hit if num_new_tokens is None else num_new_tokens
    assert m.can_allocate(req, n, computed)
    new = m.allocate_slots(req, n, computed)
    assert new is not None
    req.num_computed_tokens += n
    check(m)
    return new


def grow(m: KVCacheManager, req: Req, num_new_tokens: int) -> list[int] | None:
    can = m.can_allocate(req, num_new_tokens)
    new = m.allocate_slots(req, num_new_tokens)
    assert can == (new is not None)
    if new is not None:
        req.num_computed_tokens += num_new_tokens
    check(m)
    return new
