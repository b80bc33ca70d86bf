"""The engine's receiver cache: processed multimodal items kept so the API can send a key only.

It runs no eviction policy of its own. The API's ``IpcMirror`` decides every eviction and every
insertion; each ``AddRequest`` carries them and ``apply`` performs them in message order::

    API mirror:   record_request(items) -> decisions, evicted      (one synchronous step)
                       │  AddRequest(evicted_mm_hashes, mm_features[store / key only])
    engine:       apply(evicted, features) -> items, missing       (before anything can reject it)

Because both sides see the same operations in the same order, ``keys()`` here equals the mirror's
``keys()`` (same order) after every message, and a key-only feature is always found. ``missing`` is the
safety net for a broken invariant: the engine reports those hashes back instead of guessing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

V = TypeVar("V")


class ReceiverCache(Generic[V]):
    # Invariants:
    #   self._num_bytes == sum of the sizes of the held items
    #   _items is in LRU -> MRU order: put and get move a key to the end, exactly as the mirror's
    #   record_request moves it (STORE inserts at the end, HIT touches); nothing else reorders it
    def __init__(self) -> None:
        self._items: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._num_bytes = 0

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._items

    def keys(self) -> list[str]:
        """Held keys, least recently used first."""
        return list(self._items)

    def evict(self, mm_hashes: Iterable[str]) -> None:
        """Drop the given keys; keys not held are ignored."""
        for mm_hash in mm_hashes:
            entry = self._items.pop(mm_hash, None)
            if entry is not None:
                self._num_bytes -= entry[1]

    def put(self, mm_hash: str, item: V, num_bytes: int) -> None:
        """Insert or replace ``mm_hash`` as the most recently used entry."""
        self.evict((mm_hash,))
        self._items[mm_hash] = (item, num_bytes)
        self._num_bytes += num_bytes

    def get(self, mm_hash: str) -> V | None:
        """The item, touched (moved to most recently used); None when not held."""
        entry = self._items.get(mm_hash)
        if entry is None:
            return None
        self._items.move_to_end(mm_hash)
        return entry[0]

    def peek(self, mm_hash: str) -> V | None:
        """The item, not touched (another API process's borrowed use must not reorder this partition,
        which mirrors its own API's decisions only); None when not held."""
        entry = self._items.get(mm_hash)
        return entry[0] if entry is not None else None

    def clear(self) -> None:
        self._items.clear()
        self._num_bytes = 0

    def apply(
        self,
        evicted_mm_hashes: Sequence[str],
        features: Sequence[tuple[str, V | None, int, bool]],
    ) -> tuple[list[V | None], list[str]]:
        """Apply one AddRequest's cache operations, in the order the API's mirror decided them.

        Called once per AddRequest, before anything that could reject or drop the request (otherwise
        the mirror, which already recorded the decisions, would run ahead of this cache). First the
        evictions, then per feature ``(mm_hash, item_or_None, num_bytes, store)`` in prompt order: a
        given item is stored (as most recent) when ``store`` and used as is; a key-only feature is
        looked up and touched. Returns the resolved items in feature order and the hashes of key-only
        features that were not held (always empty while the mirror invariant holds).
        """
        self.evict(evicted_mm_hashes)
        resolved: list[V | None] = []
        missing: list[str] = []
        for mm_hash, item, num_bytes, store in features:
            if item is None:
                item = self.get(mm_hash)
                if item is None:
                    missing.append(mm_hash)
            elif store:
                self.put(mm_hash, item, num_bytes)
            # an UNCACHED item (given, not stored) touches nothing: the mirror does not hold it either
            resolved.append(item)
        return resolved, missing


class ReceiverCachePartitions(Generic[V]):
    """One receiver cache per API process (ZeroMQ sender identity): each API's mirror mirrors only
    its own partition, so several API processes never evict each other's entries."""

    def __init__(self) -> None:
        self._caches: dict[bytes, ReceiverCache[V]] = {}

    def for_sender(self, identity: bytes) -> ReceiverCache[V]:
        """The sender's partition, created empty on its first message."""
        cache = self._caches.get(identity)
        if cache is None:
            cache = self._caches[identity] = ReceiverCache()
        return cache

    def find(self, identity: bytes, mm_hash: str) -> V | None:
        """A borrowed item (``MMFeature.borrowed``): from the sender's own partition if it holds it, else
        from any other, touching none; None when no partition holds it."""
        own = self._caches.get(identity)
        if own is not None and (item := own.peek(mm_hash)) is not None:
            return item
        for cache in self._caches.values():
            if (item := cache.peek(mm_hash)) is not None:
                return item
        return None

    def drop(self, identity: bytes) -> None:
        """Forget a sender's partition (the API process went away); unknown identities are ignored."""
        self._caches.pop(identity, None)

    @property
    def num_bytes(self) -> int:
        return sum(cache.num_bytes for cache in self._caches.values())
