"""The API's processor cache: mm_hash -> processed item, LRU bounded in bytes
(docs/architecture.md, "Processor cache").

On a hit the HF processor does not run. Lives on the API's event loop: ``get``/``put`` are called from
there only (not thread-safe). Invariants, checked by ``_check`` in tests:
- ``num_bytes`` == sum of the cached items' ``num_bytes`` <= ``capacity_bytes``;
- an item larger than the capacity is never cached; capacity 0 caches nothing and counts nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.families.processing import ProcessedItem


class ProcessorCache:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        # Oldest first; a hit or an insert moves the key to the end.
        self._items: OrderedDict[str, ProcessedItem] = OrderedDict()
        self._num_bytes = 0
        self._num_queries = 0
        self._num_hits = 0

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    @property
    def num_bytes(self) -> int:
        """Bytes of all cached items' tensors."""
        return self._num_bytes

    @property
    def num_queries(self) -> int:
        return self._num_queries

    @property
    def num_hits(self) -> int:
        return self._num_hits

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, mm_hash: object) -> bool:
        """Membership without touching the LRU order or the counters."""
        return mm_hash in self._items

    def get(self, mm_hash: str) -> ProcessedItem | None:
        """The cached item for ``mm_hash`` (now the most recently used), else None. Counts the query."""
        if not self.enabled:
            return None
        self._num_queries += 1
        item = self._items.get(mm_hash)
        if item is None:
            return None
        self._num_hits += 1
        self._items.move_to_end(mm_hash)
        return item

    def put(self, mm_hash: str, item: ProcessedItem) -> None:
        """Insert (or replace) ``mm_hash`` as most recently used, evicting least recently used items
        until it fits. An item larger than the whole capacity is not cached (and evicts nothing)."""
        item_bytes = item.num_bytes
        if not self.enabled or item_bytes > self.capacity_bytes:
            return
        old = self._items.pop(mm_hash, None)
        if old is not None:
            self._num_bytes -= old.num_bytes
        while self._num_bytes + item_bytes > self.capacity_bytes:
            _, evicted = self._items.popitem(last=False)
            self._num_bytes -= evicted.num_bytes
        self._items[mm_hash] = item
        self._num_bytes += item_bytes

    def clear(self) -> None:
        """Drop every item; the counters keep counting (they are totals for metrics)."""
        self._items.clear()
        self._num_bytes = 0

    def _check(self) -> None:
        assert self._num_bytes == sum(item.num_bytes for item in self._items.values())
        assert self._num_bytes <= self.capacity_bytes
