"""Bookkeeping of encoder outputs, counted in embeddings (tokens). The tensors live in the workers.

The scheduler owns one ``EncoderCacheManager``. Per multimodal item it asks, in this order::

    lookup(mm_hash, req_id)        already encoded (maybe freeable)? then share it, no encoder run
    can_allocate(num_tokens)       room, possibly after evicting freeable entries oldest-first?
    allocate(mm_hash, n, req_id)   reserve the room; the worker encodes the item this step
    release(req_id, mm_hash)       the request no longer needs the embeddings (they were consumed)
    release_all(req_id)            the request finished or was aborted

and once per step ``take_evicted()`` becomes ``SchedulerOutput.free_mm_hashes``: workers drop exactly
those tensors, so the worker's encoder store holds exactly the keys held here.

If the worker fails a step, ``discard`` drops the entries that step was to encode (after its requests
released them): no later request may share an output that was maybe never written, and the worker
is told to drop whatever it did store.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    # Invariants (checked by the unit tests after every call):
    #   I1  sum(self._num_tokens.values()) == self._num_used_tokens <= self._capacity_tokens
    #   I2  an entry is held iff it is a key of _num_tokens (and of _users);
    #       an entry is freeable iff it is held and has no users, iff it is a key of _freeable
    #   I3  sum of the freeable entries' sizes == self._num_freeable_tokens
    #   I4  mm_hash in _users[h] <=> mm_hash in _req_entries[req_id] (the two indexes agree)
    #   I5  every eviction appends its key to _evicted once, and take_evicted() hands each append out
    #       once; an evicted key is no longer held (allocating it again makes a new entry, which the
    #       worker encodes after it dropped the old tensor: frees run before the step's encodes)
    #   I6  capacity 0 disables caching: space is not bounded, entries are still shared by requests
    #       running together, but an entry is evicted as soon as it has no users (never freeable)
    def __init__(self, capacity_tokens: int) -> None:
        assert capacity_tokens >= 0
        self._capacity_tokens = capacity_tokens
        self.enabled = capacity_tokens > 0
        self._num_tokens: dict[str, int] = {}  # held entries: mm_hash -> number of embeddings
        self._users: dict[str, set[str]] = {}  # held entries: mm_hash -> req_ids using it
        # zero-user entries in the order they became freeable (oldest first = first to evict)
        self._freeable: OrderedDict[str, None] = OrderedDict()
        # req_id -> mm_hashes it uses; a dict keeps the order release_all frees them in deterministic
        self._req_entries: dict[str, dict[str, None]] = {}
        self._num_used_tokens = 0
        self._num_freeable_tokens = 0
        self._evicted: list[str] = []
        self.num_queries = 0
        self.num_hits = 0
        self.num_hit_tokens = 0  # embeddings the hits reused: vision-encoder output not computed again

    @property
    def capacity_tokens(self) -> int:
        return self._capacity_tokens

    @property
    def num_used_tokens(self) -> int:
        """Tokens held by all entries, freeable ones included (with caching disabled it may exceed
        the zero capacity: entries in use are never refused)."""
        return self._num_used_tokens

    @property
    def num_free_tokens(self) -> int:
        return self._capacity_tokens - self._num_used_tokens

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._num_tokens

    def lookup(self, mm_hash: str, req_id: str, *, count_query: bool = True) -> bool:
        """Called when a request's chunk first covers an item it does not use yet. On a hit ``req_id``
        becomes a user of the entry (which is then no longer freeable) and the encoder does not run
        again. ``count_query=False`` for a repeated lookup of an item still waiting for room, so the
        query counter counts items, not attempts."""
        self.num_queries += count_query
        users = self._users.get(mm_hash)
        if users is None:
            return False
        if not users:  # reviving a freeable entry: it leaves the eviction order (I2, I3)
            del self._freeable[mm_hash]
            self._num_freeable_tokens -= self._num_tokens[mm_hash]
        users.add(req_id)
        self._req_entries.setdefault(req_id, {})[mm_hash] = None
        self.num_hits += 1
        self.num_hit_tokens += self._num_tokens[mm_hash]
        return True

    def can_allocate(self, num_tokens: int) -> bool:
        """True when ``num_tokens`` fit now, possibly after evicting freeable entries oldest-first.
        Evicts only when the allocation then succeeds: a False answer leaves the cache untouched, so
        a request that cannot be scheduled this step costs nobody their reusable entries."""
        if not self.enabled:
            return True
        if num_tokens > self._capacity_tokens:
            return False
        if num_tokens <= self.num_free_tokens:
            return True
        if num_tokens > self.num_free_tokens + self._num_freeable_tokens:
            return False
        while num_tokens > self.num_free_tokens:
            oldest = next(iter(self._freeable))
            self._evict(oldest)
        return True

    def allocate(self, mm_hash: str, num_tokens: int, req_id: str) -> None:
        """Reserve room for a new entry used by ``req_id``; call after ``can_allocate`` said True."""
        assert mm_hash not in self._num_tokens, f"{mm_hash} already held"
        assert num_tokens >= 0
        assert not self.enabled or num_tokens <= self.num_free_tokens, (
            "allocate without room (call can_allocate)"
        )
        self._num_tokens[mm_hash] = num_tokens
        self._users[mm_hash] = {req_id}
        self._req_entries.setdefault(req_id, {})[mm_hash] = None
        self._num_used_tokens += num_tokens  # I1 holds: we asserted the room above

    def release(self, req_id: str, mm_hash: str) -> None:
        """``req_id`` no longer needs the entry. At zero users it becomes freeable: it stays held and
        reusable by ``lookup`` until space is needed. Idempotent."""
        users = self._users.get(mm_hash)
        if users is None or req_id not in users:
            return
        users.discard(req_id)
        entries = self._req_entries[req_id]
        del entries[mm_hash]
        if not entries:
            del self._req_entries[req_id]
        if not users:  # the newest freeable entry goes last: evicted after every older one
            self._freeable[mm_hash] = None
            self._num_freeable_tokens += self._num_tokens[mm_hash]
            if not self.enabled:
                self._evict(mm_hash)

    def release_all(self, req_id: str) -> None:
        """The request finished or was aborted: release every entry it uses."""
        for mm_hash in list(self._req_entries.get(req_id, ())):
            self.release(req_id, mm_hash)

    def users(self, mm_hash: str) -> list[str]:
        """The requests using the entry now (none if it is freeable or not held)."""
        return list(self._users.get(mm_hash, ()))

    def discard(self, mm_hash: str) -> None:
        """The step that was to encode ``mm_hash`` failed: evict the entry now, so a later request
        encodes the item again (``take_evicted`` reports it: the worker drops a partial output). Its
        users, the failed step's requests, must have released it. No-op if it is no longer held."""
        if mm_hash in self._num_tokens:
            self._evict(mm_hash)

    def take_evicted(self) -> list[str]:
        """The keys evicted since the previous call, in eviction order; each is reported once."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def reset(self) -> None:
        """Evict every freeable entry (reported by ``take_evicted``); entries in use stay."""
        for mm_hash in list(self._freeable):
            self._evict(mm_hash)

    def _evict(self, mm_hash: str) -> None:
        # only freeable entries are ever evicted: a user's embeddings must survive until released
        assert not self._users[mm_hash], f"evicting {mm_hash} while in use"
        num_tokens = self._num_tokens.pop(mm_hash)
        del self._users[mm_hash]
        del self._freeable[mm_hash]
        self._num_used_tokens -= num_tokens
        self._num_freeable_tokens -= num_tokens
        self._evicted.append(mm_hash)
