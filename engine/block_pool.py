"""The paged-KV block pool: reference counts, the free queue (eviction order) and the prefix-cache map
``block hash -> block id``. Plain Python; the K/V tensors live in the worker, indexed by the same ids.

A block moves between the free queue (ref_count 0) and the block tables (ref_count >= 1)::

    free ──take──▶ used ──cache(hash)──▶ used, hashed ──release to 0──▶ free, hashed ("cached-free")
                                               ▲                               │        │
                                               └───acquire (a prefix hit)──────┘        │
    used ◀──take (new content: the hash is evicted)─────────────────────────────────────┘

``uncache`` takes a hash back when the step that was to compute the block's K/V failed.

A hashed block may also carry its ``BlockContent`` (its parent's key, token ids and multimodal items),
indexed by parent: a request whose next block differs from every cached one can still match its first
tokens against the blocks cached after the same parent (``children``, the token-granular prefix match of
docs/architecture.md, "KV cache and prefix caching"). The content goes and comes with the hash.

The ``KVCacheManager`` owns one pool and is its only caller; it keeps the block tables.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

BlockHash = bytes
# what a block follows: the previous block's hash, or for a first block ("root", its cache salt)
ParentKey = BlockHash | tuple[str, str | None]


@dataclass(frozen=True)
class BlockContent:
    """A full block's content, for matching its first tokens: what it follows, its token ids and the
    multimodal items overlapping it as its hash covers them, (mm_hash, offset from the block's start)
    (``block_extra_keys``: an item that began in an earlier block has a negative offset)."""

    parent: ParentKey
    token_ids: tuple[int, ...]
    items: tuple[tuple[str, int], ...]


class BlockPool:
    # Invariants (checked by the unit tests after every call):
    #   P1  every block is in exactly one place: the free queue (ref_count 0), or held by >= 1 block
    #       tables (ref_count > 0); the manager keeps ref_count == the number of tables holding it
    #   P2  the free queue is ordered by when a block became free: its front is the least recently
    #       freed block, the next one ``take`` hands out (and the first cached block to be evicted)
    #   P3  a hash maps to at most one block and that block carries it:
    #       _block_of[h] == b  <=>  _hash_of[b] == h
    #   P4  a free block may keep its hash (cached-free): a prefix hit revives it with its K/V intact;
    #       ``take`` drops the hash before the block gets new content, so a hash never names stale K/V
    #   P5  a block's hash is set once while it is used (its content is then final) and only ``take``,
    #       ``reset`` or ``uncache`` (the step that was to write the content failed) drop it
    #   P6  num_free_blocks + num_used_blocks == num_blocks
    #   P7  a block has a content entry only while it carries a hash, and it is listed under its
    #       content's parent exactly then: _children[c.parent] holds b  <=>  _content[b] == c
    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 0
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # ref_count-0 blocks, least recently freed first; a fresh pool hands out 0, 1, 2, ... in order
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._block_of: dict[BlockHash, int] = {}
        self._content: dict[int, BlockContent] = {}
        self._children: dict[ParentKey, dict[int, None]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that carry a hash, used or free."""
        return len(self._block_of)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def hash_of(self, block_id: int) -> BlockHash | None:
        return self._hash_of[block_id]

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding the K/V named by ``block_hash`` (used or cached-free), or None."""
        return self._block_of.get(block_hash)

    def children(self, parent: ParentKey, limit: int) -> list[tuple[int, BlockContent]]:
        """The ``limit`` hashed blocks last registered with a content that follows ``parent``, newest
        first (a first block's parent may have thousands)."""
        newest = itertools.islice(reversed(self._children.get(parent, {})), limit)
        return [(b, self._content[b]) for b in newest]

    def num_free_among(self, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` sit in the free queue (acquiring them shrinks it)."""
        return sum(1 for b in block_ids if self._ref_counts[b] == 0)

    def acquire(self, block_ids: Iterable[int]) -> None:
        """One more table holds each block. A cached-free block leaves the free queue with its hash
        (P1, P4): this is how a prefix hit revives K/V."""
        for b in block_ids:
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1

    def take(self, num_blocks: int) -> list[int]:
        """Hand out ``num_blocks`` blocks for new content, least recently freed first, each with
        ref_count 1. A cached-free block taken here loses its hash: its K/V is about to be overwritten."""
        assert num_blocks <= len(self._free), "take without room (check num_free_blocks first)"
        taken = []
        for _ in range(num_blocks):
            b, _ = self._free.popitem(last=False)
            self._drop_hash(b)
            self._ref_counts[b] = 1
            taken.append(b)
        return taken

    def release(self, block_ids: Iterable[int]) -> None:
        """One table fewer holds each block; blocks reaching ref_count 0 join the back of the free
        queue in the order given (evicted in that order), keeping their hash."""
        for b in block_ids:
            assert self._ref_counts[b] > 0, f"block {b} released more often than acquired"
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None

    def cache(self, block_id: int, block_hash: BlockHash, content: BlockContent | None = None) -> bool:
        """Register a used block whose content (tokens and images) ``block_hash`` names; True if it
        now carries the hash (and ``content``, if given, for matches of its first tokens). If the hash
        already names a block (this one, or another that computed the same prefix first), the existing
        mapping stays and ``block_id`` stays unhashed (P3)."""
        assert self._ref_counts[block_id] > 0, f"caching free block {block_id}"
        if block_hash in self._block_of:
            return False
        assert self._hash_of[block_id] is None, f"block {block_id} already carries another hash"
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        if content is not None:
            self._content[block_id] = content
            self._children.setdefault(content.parent, {})[block_id] = None
        return True

    def uncache(self, block_id: int, block_hash: BlockHash) -> None:
        """Drop ``block_hash`` from ``block_id`` if the block still carries it (a ``take`` or ``reset``
        since may have dropped it already); the block stays where it is, used or free."""
        if self._hash_of[block_id] == block_hash:
            self._drop_hash(block_id)

    def reset(self) -> None:
        """Forget every hash, used blocks' too: nothing computed so far is found by a lookup again."""
        self._block_of.clear()
        self._hash_of = [None] * self.num_blocks
        self._content.clear()
        self._children.clear()

    def _drop_hash(self, block_id: int) -> None:
        block_hash = self._hash_of[block_id]
        if block_hash is not None:
            del self._block_of[block_hash]
            self._hash_of[block_id] = None
        content = self._content.pop(block_id, None)
        if content is not None:
            siblings = self._children[content.parent]
            del siblings[block_id]
            if not siblings:
                del self._children[content.parent]
