"""Paged-KV block bookkeeping with image-aware prefix caching. Plain Python: the K/V tensors live in
the worker, which indexes them by the block ids handed out here.

The scheduler owns one ``KVCacheManager``. Per request it calls, in this order::

    get_computed_blocks(req)                   waiting request: full blocks already cached (no refs)
    record_prefix_lookup(n_query, n_hit)       once per admission (a blocked head of line is not
                                               counted again)
    can_allocate / allocate_slots(req, n, computed_ids)   first call starts the table with computed_ids
    allocate_slots(req, n)                     every later step: grow the table for n more tokens
    free(req_id)                               finished, aborted or preempted

and once per step ``take_newly_cached()``: the blocks this step registered in the prefix cache. If the
worker fails the step, ``uncache`` takes them back (their K/V was never written for certain) after the
step's requests were freed; blocks registered by earlier, successful steps stay cached.

A block's identity is a hash chain: block i's hash covers block i-1's hash, its token ids and the
multimodal items whose placeholders it overlaps (``block_extra_keys``), so equal hashes mean equal
K/V: the same image at the same place reuses K/V, while a different image behind identical
placeholder tokens, or the same image shifted, never does.

A block is registered in the prefix cache in the step that computes its last token (at
``allocate_slots``), so a request admitted later in the same step may already share it: the worker
must write a step's K/V of a layer before attention of that layer reads it. Registering at schedule
time rather than when the step's output arrives is what lets that request share the block; the price is
the rollback above.

Hits are token-granular (``prefix_match="token"``; docs/architecture.md, "KV cache and prefix
caching"): after its full blocks, a request's next block may match the first tokens of a block cached
after the same parent (the same tokens and items there). Those K/V are copied into the request's own
first new block, which it goes on filling: ``take_kv_copies()`` gives the step's copies, which the
worker makes before the step's forward. A block registered in the step being planned is never copied
from (its K/V is written by that step's forward, after the copies).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import blake3

from engine.block_pool import BlockContent, BlockHash, BlockPool, ParentKey
from wire.protocol import MMFeature

_HASH_DOMAIN = b"mmserve.kv_block.v1"
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
PARTIAL_CANDIDATES = 64  # blocks after one parent compared for a partial hit, the newest first
PrefixMatch = Literal["token", "block"]


@dataclass(frozen=True)
class PartialHit:
    """The first ``num_tokens`` tokens of a request's next block are those of cached block ``block_id``."""

    block_id: int
    block_hash: BlockHash  # it still carries it when the request is allocated (nothing took it since)
    num_tokens: int


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[tuple[str, int], ...],
    cache_salt: str | None = None,
) -> BlockHash:
    """blake3 over a length-prefixed encoding of the parent hash (tagged, so "no parent" differs from
    every parent, and a first block's cache salt from every other first block), the block's token ids
    and the extra keys (mm_hash, placeholder offset). Only a first block takes the salt: every later
    block covers it through its parent."""
    hasher = blake3.blake3(_HASH_DOMAIN)
    if parent is None and cache_salt is not None:
        salt = cache_salt.encode("utf-8")
        hasher.update(b"\x02" + _U64.pack(len(salt)) + salt)
    elif parent is None:
        hasher.update(b"\x00")
    else:
        hasher.update(b"\x01" + _U64.pack(len(parent)) + parent)
    hasher.update(_U64.pack(len(token_ids)))
    hasher.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    hasher.update(_U64.pack(len(extra_keys)))
    for mm_hash, offset in extra_keys:
        encoded = mm_hash.encode("utf-8")
        hasher.update(_U64.pack(len(encoded)) + encoded + _I64.pack(offset))
    return hasher.digest()


def block_extra_keys(
    mm_features: Sequence[MMFeature], block_start: int, block_end: int
) -> tuple[tuple[str, int], ...]:
    """``(mm_hash, offset - block_start)`` of every feature whose placeholder range overlaps
    ``[block_start, block_end)``, in feature order. The relative offset may be negative (an image that
    began in an earlier block); it pins which part of the image's embeddings the block holds."""
    return tuple(
        (f.mm_hash, f.offset - block_start)
        for f in mm_features
        if f.offset < block_end and f.end > block_start
    )


class KVRequest(Protocol):
    """What the manager reads from a request (``engine.request.Request`` satisfies it)."""

    req_id: str
    num_computed_tokens: int
    cache_salt: str | None  # folded into the first block's hash: other salts share no block

    @property
    def num_tokens(self) -> int: ...  # prompt + generated

    @property
    def all_token_ids(self) -> Sequence[int]: ...  # prompt + generated

    @property
    def mm_features(self) -> Sequence[MMFeature]: ...  # placements in the prompt


class KVCacheManager:
    # Invariants (checked by the unit tests after every call), on top of the pool's P1-P6:
    #   K1  a block's ref_count == the number of tables in _tables that hold it; no table holds a
    #       block twice
    #   K2  _block_hashes[r][i] is the hash of request r's block i, chained from block 0; only full
    #       blocks are hashed, and the list only grows until free(r) drops it
    #   K3  _num_cached_blocks[r] <= len(_tables[r]): table blocks [0, n) were offered to the prefix
    #       cache; unless reset_prefix_cache ran since, each such block's hash names a block (this one,
    #       or another that holds the same K/V)
    #   K4  prefix caching disabled: no hash is ever computed or registered
    #   K5  a partial hit is pending only for a request without a table (a head of line that waits
    #       keeps it until its next lookup); its block still carries its hash when it is allocated
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        prefix_match: PrefixMatch = "token",
    ) -> None:
        assert block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_match = prefix_match
        self._partial_hits: dict[str, PartialHit] = {}  # found by get_computed_blocks, not yet allocated
        # (source block, destination block, tokens) to copy before the step runs, since take_kv_copies()
        self._kv_copies: list[tuple[int, int, int]] = []
        self._pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._block_hashes: dict[str, list[BlockHash]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # (block id, hash) registered since the last take_newly_cached(), in registration order
        self._newly_cached: list[tuple[int, BlockHash]] = []
        self.num_prefix_queries_tokens = 0
        self.num_prefix_hits_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0, cached-free ones included (they are reusable)."""
        return self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one request."""
        return self._pool.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    def block_ids(self, req_id: str) -> list[int]:
        return list(self._tables.get(req_id, ()))

    def get_computed_blocks(self, req: KVRequest) -> tuple[list[int], int]:
        """Called when a waiting request (new or resumed after preemption) is about to be scheduled:
        the longest run of the request's full blocks, from block 0, whose hashes are cached, and the
        number of tokens hit: theirs, plus a partial hit's in the next block (token-granular matches).
        At least one token is left to compute (its logits are needed). Takes no references: call
        ``allocate_slots`` with these ids before any other allocation."""
        assert req.req_id not in self._tables, f"{req.req_id} already holds blocks"
        self._partial_hits.pop(req.req_id, None)
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_blocks = max(0, req.num_tokens - 1) // self.block_size
        hashes = self._hashes(req, max_hit_blocks)
        block_ids = []
        for block_hash in hashes[:max_hit_blocks]:
            block_id = self._pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        num_hit = len(block_ids) * self.block_size
        partial = self._partial_hit(req, hashes, len(block_ids)) if self.prefix_match == "token" else None
        if partial is None:
            return block_ids, num_hit
        self._partial_hits[req.req_id] = partial
        return block_ids, num_hit + partial.num_tokens

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Called once per admission with the prompt length and the tokens ``get_computed_blocks`` hit."""
        self.num_prefix_queries_tokens += num_query_tokens
        self.num_prefix_hits_tokens += num_hit_tokens

    def can_allocate(
        self, req: KVRequest, num_new_tokens: int, computed_block_ids: Sequence[int] = ()
    ) -> bool:
        """True iff ``allocate_slots`` with the same arguments would succeed now."""
        num_new_blocks, num_revived = self._plan(req, num_new_tokens, computed_block_ids)
        return num_new_blocks + num_revived <= self._pool.num_free_blocks

    def num_new_blocks(self, req: KVRequest, num_new_tokens: int) -> int:
        """Blocks a running request's table needs for ``num_new_tokens`` more tokens."""
        return self._plan(req, num_new_tokens, ())[0]

    def allocate_slots(
        self, req: KVRequest, num_new_tokens: int, computed_block_ids: Sequence[int] = ()
    ) -> list[int] | None:
        """Grow the request's table to cover ``req.num_computed_tokens + num_new_tokens`` tokens.

        On the request's first call ``computed_block_ids`` (from ``get_computed_blocks``, which
        ``req.num_computed_tokens`` already counts) start the table, one reference each. New blocks
        come from the free queue, least recently freed first. Returns the ids appended to the table
        (the computed ones included), or None, changing nothing, when the free blocks do not suffice.
        Then registers every block that is full once these tokens are computed in the prefix cache."""
        num_new_blocks, num_revived = self._plan(req, num_new_tokens, computed_block_ids)
        if num_new_blocks + num_revived > self._pool.num_free_blocks:
            return None
        req_id = req.req_id
        table = self._tables.get(req_id)
        appended = list(computed_block_ids)
        partial = None
        if table is None:
            if appended:  # still the blocks get_computed_blocks found: no allocation ran in between
                hashes = self._hashes(req, len(appended))
                assert all(self._pool.hash_of(b) == h for b, h in zip(appended, hashes, strict=False)), (
                    "computed blocks were evicted since get_computed_blocks"
                )
            partial = self._partial_hits.pop(req_id, None)
            assert partial is None or self._pool.hash_of(partial.block_id) == partial.block_hash, (
                "the partial hit's block was evicted since get_computed_blocks"
            )
            self._pool.acquire(appended)
            table = self._tables[req_id] = []
            self._num_cached_blocks[req_id] = len(appended)  # they carry their hashes already
        new_blocks = self._pool.take(num_new_blocks)
        # (the source may be taken here, even as the destination itself: the copy runs before the step
        # writes any block, and a block copied onto itself keeps its K/V)
        if partial is not None and new_blocks[0] != partial.block_id:
            self._kv_copies.append((partial.block_id, new_blocks[0], partial.num_tokens))
        appended += new_blocks
        table += appended
        if self.enable_prefix_caching:
            num_tokens = min(req.num_computed_tokens + num_new_tokens, req.num_tokens)
            self._cache_full_blocks(req, table, num_tokens // self.block_size)
        return appended

    def free(self, req_id: str) -> None:
        """The request finished, was aborted or preempted: each of its blocks loses a reference.
        Blocks reaching ref_count 0 join the free queue tail-first, so a request's last blocks are
        evicted before its prefix (more likely shared); they keep their hashes until evicted. Also
        drops the request's block hashes (a resumed request recomputes them). Idempotent; call it for
        every request ``get_computed_blocks`` saw, even one that never got blocks."""
        table = self._tables.pop(req_id, [])
        self._partial_hits.pop(req_id, None)
        self._block_hashes.pop(req_id, None)
        self._num_cached_blocks.pop(req_id, None)
        self._pool.release(reversed(table))

    def take_newly_cached(self) -> list[tuple[int, BlockHash]]:
        """The (block id, hash) pairs registered in the prefix cache since the previous call; called
        once per step by ``schedule()``."""
        newly_cached, self._newly_cached = self._newly_cached, []
        return newly_cached

    def take_kv_copies(self) -> list[tuple[int, int, int]]:
        """The (source block, destination block, tokens) copies of the partial hits allocated since the
        previous call; called once per step by ``schedule()``. The worker copies the K/V of the
        source's first tokens into the destination's, every layer, before the step's forward."""
        copies, self._kv_copies = self._kv_copies, []
        return copies

    def uncache(self, cached_blocks: Sequence[tuple[int, BlockHash]]) -> None:
        """The step that registered ``cached_blocks`` (``take_newly_cached``) failed: no later request
        may hit them. Call after freeing the step's requests, which are the only holders of these
        blocks (a block is registered by the request computing it, and shared in the same step only
        by requests admitted in that step); the blocks stay in the free queue, unhashed."""
        for block_id, block_hash in cached_blocks:
            self._pool.uncache(block_id, block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every block hash, those of blocks in use included (their K/V stays where it is for
        the requests holding it, but no later request shares it, and blocks already offered to the
        cache are not offered again). Always succeeds, so always True."""
        self._pool.reset()
        self._newly_cached.clear()
        return True

    # ------------------------------------------------------------------ internals

    def _plan(
        self, req: KVRequest, num_new_tokens: int, computed_block_ids: Sequence[int]
    ) -> tuple[int, int]:
        """(blocks to take from the free queue for new content, computed blocks that are cached-free
        and leave the free queue when acquired)."""
        table = self._tables.get(req.req_id)
        if table is None:
            partial = self._partial_hits.get(req.req_id)
            num_partial = partial.num_tokens if partial is not None else 0
            assert req.num_computed_tokens == len(computed_block_ids) * self.block_size + num_partial, (
                "on the first allocation num_computed_tokens counts exactly the computed blocks and the "
                "partial hit"
            )
            num_held = len(computed_block_ids)
            num_revived = self._pool.num_free_among(computed_block_ids)
        else:
            assert not computed_block_ids, "computed blocks are only passed on the first allocation"
            num_held = len(table)
            num_revived = 0
        num_tokens = req.num_computed_tokens + num_new_tokens
        num_blocks = -(-num_tokens // self.block_size)
        return max(0, num_blocks - num_held), num_revived

    def _hashes(self, req: KVRequest, num_blocks: int) -> list[BlockHash]:
        """The request's block hashes, extended to at least ``num_blocks`` full blocks (K2)."""
        hashes = self._block_hashes.setdefault(req.req_id, [])
        if len(hashes) >= num_blocks:
            return hashes
        token_ids = req.all_token_ids
        size = self.block_size
        assert num_blocks * size <= len(token_ids), "hashing a block that is not full"
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            start, end = i * size, (i + 1) * size
            extra_keys = block_extra_keys(req.mm_features, start, end)
            parent = hash_block(parent, token_ids[start:end], extra_keys, req.cache_salt if i == 0 else None)
            hashes.append(parent)
        return hashes

    def _cache_full_blocks(self, req: KVRequest, table: list[int], num_full_blocks: int) -> None:
        num_cached = self._num_cached_blocks[req.req_id]
        if num_full_blocks <= num_cached:
            return
        hashes = self._hashes(req, num_full_blocks)
        size = self.block_size
        token_ids = req.all_token_ids
        for i in range(num_cached, num_full_blocks):
            content = None
            if self.prefix_match == "token":
                start = i * size
                items = block_extra_keys(req.mm_features, start, start + size)
                content = BlockContent(_parent(req, hashes, i), tuple(token_ids[start : start + size]), items)
            if self._pool.cache(table[i], hashes[i], content):
                self._newly_cached.append((table[i], hashes[i]))
        self._num_cached_blocks[req.req_id] = num_full_blocks

    def _partial_hit(self, req: KVRequest, hashes: list[BlockHash], num_blocks: int) -> PartialHit | None:
        """The cached block after the request's ``num_blocks`` hit ones whose first tokens (and items
        among them) are most of the request's next ones, short of its last token; None if none is."""
        start = num_blocks * self.block_size
        limit = min(self.block_size - 1, req.num_tokens - 1 - start)
        if limit <= 0:
            return None
        wanted = req.all_token_ids[start : start + limit]
        items = block_extra_keys(req.mm_features, start, start + self.block_size)
        written_this_step = {b for b, _ in self._newly_cached}
        best: PartialHit | None = None
        for block_id, content in self._pool.children(_parent(req, hashes, num_blocks), PARTIAL_CANDIDATES):
            if block_id in written_this_step:
                continue
            num_tokens = _match_length(wanted, items, content)
            if num_tokens and (best is None or num_tokens > best.num_tokens):
                block_hash = self._pool.hash_of(block_id)
                assert block_hash is not None  # (P7)
                best = PartialHit(block_id, block_hash, num_tokens)
        return best


def _parent(req: KVRequest, hashes: Sequence[BlockHash], index: int) -> ParentKey:
    """What block ``index`` of the request follows: the previous block's hash, or its cache salt."""
    return hashes[index - 1] if index else ("root", req.cache_salt)


def _match_length(wanted: Sequence[int], items: tuple[tuple[str, int], ...], content: BlockContent) -> int:
    """How many of a block's first tokens ``content`` shares with ``wanted`` (a request's next tokens,
    whose block's ``block_extra_keys`` are ``items``): equal token ids, and the same items over them (a
    different image behind the same placeholders, or one placed elsewhere, ends the match where it
    starts)."""
    num_tokens = 0
    for mine, theirs in zip(wanted, content.token_ids, strict=False):
        if mine != theirs:
            break
        num_tokens += 1
    while num_tokens:
        differing = {i for i in items if i[1] < num_tokens} ^ {i for i in content.items if i[1] < num_tokens}
        if not differing:
            break
        num_tokens = max(0, min(offset for _, offset in differing))
    return num_tokens
