"""Processor cache: LRU by bytes with exact eviction orders, disabled at 0, oversize never cached."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from app.inputs.processor_cache import ProcessorCache


@dataclass(frozen=True)
class Item:
    """Stands in for ProcessedItem: the cache only reads ``num_bytes``."""

    num_bytes: int
    num_tokens: int = 576


def keys(cache: ProcessorCache) -> list[str]:
    return [key for key in ("a", "b", "c", "d", "e") if key in cache]


def test_put_get_and_counters() -> None:
    cache = ProcessorCache(100)
    assert cache.get("a") is None
    item = Item(40)
    cache.put("a", item)
    assert cache.get("a") is item
    assert cache.get("b") is None
    assert (cache.num_queries, cache.num_hits) == (3, 1)
    assert cache.num_bytes == 40 and len(cache) == 1
    cache._check()


def test_evicts_least_recently_used_until_it_fits() -> None:
    cache = ProcessorCache(100)
    cache.put("a", Item(30))
    cache.put("b", Item(30))
    cache.put("c", Item(30))
    assert cache.get("a") is not None  # order now b, c, a
    cache.put("d", Item(50))  # needs 50, 10 free: evicts b then c
    assert keys(cache) == ["a", "d"]
    assert cache.num_bytes == 80
    cache.put("e", Item(30))  # evicts a (d is newer)
    assert keys(cache) == ["d", "e"]
    assert cache.num_bytes == 80
    cache._check()


def test_exact_fit_evicts_nothing() -> None:
    cache = ProcessorCache(100)
    cache.put("a", Item(60))
    cache.put("b", Item(40))
    assert keys(cache) == ["a", "b"] and cache.num_bytes == 100


def test_membership_does_not_refresh_lru_order_or_count() -> None:
    cache = ProcessorCache(60)
    cache.put("a", Item(30))
    cache.put("b", Item(30))
    assert "a" in cache
    cache.put("c", Item(30))  # "a" is still the oldest
    assert keys(cache) == ["b", "c"]
    assert cache.num_queries == 0


def test_put_existing_key_replaces_and_refreshes() -> None:
    cache = ProcessorCache(100)
    cache.put("a", Item(30))
    cache.put("b", Item(30))
    cache.put("a", Item(50))
    assert cache.num_bytes == 80
    cache.put("c", Item(20))
    assert keys(cache) == ["a", "b", "c"]
    cache.put("d", Item(20))  # evicts b, the least recently used
    assert keys(cache) == ["a", "c", "d"]
    cache._check()


def test_item_larger_than_capacity_is_not_cached_and_evicts_nothing() -> None:
    cache = ProcessorCache(100)
    cache.put("a", Item(60))
    cache.put("b", Item(101))
    assert keys(cache) == ["a"] and cache.num_bytes == 60
    assert cache.get("b") is None


def test_capacity_zero_disables() -> None:
    cache = ProcessorCache(0)
    assert not cache.enabled
    cache.put("a", Item(0))
    cache.put("b", Item(10))
    assert cache.get("a") is None and cache.get("b") is None
    assert len(cache) == 0 and cache.num_bytes == 0
    assert (cache.num_queries, cache.num_hits) == (0, 0)


def test_clear_keeps_counters() -> None:
    cache = ProcessorCache(100)
    cache.put("a", Item(10))
    cache.get("a")
    cache.clear()
    assert len(cache) == 0 and cache.num_bytes == 0
    assert cache.get("a") is None
    assert (cache.num_queries, cache.num_hits) == (2, 1)


def test_negative_capacity_rejected() -> None:
    with pytest.raises(ValueError):
        ProcessorCache(-1)


def test_real_processed_item_sizes_by_tensor_bytes() -> None:
    torch = pytest.importorskip("torch")
    from workers.families.processing import ItemLayout, ProcessedItem

    item = ProcessedItem({"pixel_values": torch.zeros(1, 3, 4, 4)}, ItemLayout(1))
    assert item.num_bytes == 3 * 4 * 4 * 4
    cache = ProcessorCache(item.num_bytes)
    cache.put("a", item)
    assert cache.get("a") is item
