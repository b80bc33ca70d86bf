"""The API's key-only mirror of the engine's receiver cache, and the only place its evictions are chosen.

Invariant: **the mirror says "cached" => the engine has it** (docs/architecture.md, "IPC mirror").
It holds by construction::

    phase 1  lookup_and_pin(h)        before any await: a hit pins h (no LRU change)
             ... await fetch / HF processor for the misses; other requests run phases 1 and 2 ...
    phase 2  record_request(items)    decisions + evicted keys, then in the SAME synchronous step
             socket.send(AddRequest)  (the socket is ordered: engine order == decision order)
             unpin(h) for each phase-1 hit

Its only user is ``EngineClient`` (app/inputs/engine_client.py): phase 1 is its ``lookup_and_pin``, phase 2 is
one call of its ``send_request``.

The engine's ``ReceiverCache.apply`` replays exactly these operations (evictions first, then STORE
inserts / HIT touches in prompt order), so both sides hold the same keys in the same LRU order.

Phase 2's decisions are authoritative. A phase-1 hit can turn into STORE/UNCACHED if the mirror was
reset or the key invalidated in between; the caller checks its pinned hits are still ``in`` the mirror
(synchronously, right before ``record_request``) and otherwise re-prepares those items with payloads.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

P = TypeVar("P")


@dataclass(frozen=True)
class MirrorEntry(Generic[P]):
    num_bytes: int
    # What a key-only request still needs to place the item without its tensors (the API keeps its
    # ``ItemLayout``: placeholder count, grid, a video's frame times); the mirror only keeps it.
    layout: P


class MirrorItem(NamedTuple, Generic[P]):
    """One item of a request, as ``record_request`` decides it."""

    mm_hash: str
    num_bytes: int
    layout: P


class MirrorDecision(enum.Enum):
    HIT = "hit"  # the engine holds it: send the key only
    STORE = "store"  # send the payload; the engine stores it
    UNCACHED = "uncached"  # send the payload; the engine must not store it


class IpcMirror(Generic[P]):
    # Invariants:
    #   M1  self._num_bytes == sum of entry sizes <= self._capacity_bytes
    #   M2  _entries is in LRU -> MRU order and changes only in record_request (insert/touch/evict),
    #       invalidate and reset; each of those reaches the engine in the same order (a message)
    #   M3  a key with _pins[key] > 0 is never evicted (phase 1 promised the request it stays)
    #   M4  _pins holds positive counts only; reset/invalidate keep pins (unpin must still balance)
    def __init__(self, capacity_bytes: int) -> None:
        assert capacity_bytes >= 0
        self._capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, MirrorEntry[P]] = OrderedDict()
        self._pins: dict[str, int] = {}
        self._num_bytes = 0
        self.num_queries = 0
        self.num_hits = 0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._entries

    def keys(self) -> list[str]:
        """Held keys, least recently used first (the engine's receiver cache has the same list)."""
        return list(self._entries)

    def lookup_and_pin(self, mm_hash: str) -> MirrorEntry | None:
        """Phase 1, before the request awaits anything. On a hit the entry is pinned until ``unpin``.

        The LRU order is NOT touched here: a touch is an operation the engine must replay, and the
        engine only learns of this request when its message is sent, after other requests' messages
        may have gone out. Touching now would reorder the mirror ahead of the engine; touching in
        phase 2 (record_request) puts the touch at the request's place in socket order."""
        self.num_queries += 1
        entry = self._entries.get(mm_hash)
        if entry is None:
            return None
        self._pins[mm_hash] = self._pins.get(mm_hash, 0) + 1
        self.num_hits += 1
        return entry

    def unpin(self, mm_hash: str) -> None:
        """Release one phase-1 pin: after the request's message was sent, or preparation abandoned."""
        count = self._pins.get(mm_hash, 0)
        assert count > 0, f"unpin of {mm_hash} without a pin"
        if count == 1:
            del self._pins[mm_hash]
        else:
            self._pins[mm_hash] = count - 1

    def record_request(
        self, items: Sequence[MirrorItem[P] | tuple[str, int, P]]
    ) -> tuple[list[MirrorDecision], list[str]]:
        """Phase 2: decide each ``(mm_hash, num_bytes, layout)`` in prompt order.

        Must run in the same synchronous step that hands the message to the socket: the returned
        evicted keys go in the message as ``evicted_mm_hashes`` (the engine applies them before the
        features), and the decisions say which features carry payload and ``store``.
        """
        decisions: list[MirrorDecision] = []
        evicted: list[str] = []
        # Keys this request already touched or inserted in this call are protected like pins. The
        # engine applies ALL evictions of the message before ANY of its features: evicting such a key
        # for a later item would make the engine evict it first and then store/expect it, so a HIT
        # key would be missing and a STORE key held by the engine but not by the mirror.
        protected: set[str] = set()
        for mm_hash, num_bytes, layout in items:
            if mm_hash in self._entries:
                self._entries.move_to_end(mm_hash)  # the engine's get() touches it the same way
                protected.add(mm_hash)
                decisions.append(MirrorDecision.HIT)
                continue
            victims = self._choose_victims(num_bytes, protected)
            if victims is None:
                decisions.append(MirrorDecision.UNCACHED)
                continue
            for victim in victims:
                self._num_bytes -= self._entries.pop(victim).num_bytes
                evicted.append(victim)
            self._entries[mm_hash] = MirrorEntry(num_bytes, layout)
            self._num_bytes += num_bytes
            protected.add(mm_hash)
            decisions.append(MirrorDecision.STORE)
        return decisions, evicted

    def _choose_victims(self, num_bytes: int, protected: set[str]) -> list[str] | None:
        """LRU-first unpinned, unprotected keys whose removal makes ``num_bytes`` fit, or None when
        nothing would make it fit. Fit is decided before anything is evicted, so an item that ends up
        UNCACHED costs no entries."""
        if self._capacity_bytes == 0 or num_bytes > self._capacity_bytes:
            return None  # never cached on either side
        num_needed = self._num_bytes + num_bytes - self._capacity_bytes
        victims: list[str] = []
        for key, entry in self._entries.items():
            if num_needed <= 0:
                break
            if key in protected or key in self._pins:
                continue
            victims.append(key)
            num_needed -= entry.num_bytes
        return victims if num_needed <= 0 else None

    def invalidate(self, mm_hashes: Iterable[str]) -> None:
        """Safety net: the engine reported it lacks these keys; forget them (pins are kept)."""
        for mm_hash in mm_hashes:
            entry = self._entries.pop(mm_hash, None)
            if entry is not None:
                self._num_bytes -= entry.num_bytes

    def reset(self) -> None:
        """Empty the mirror: a new engine epoch, or a ResetCaches message sent in the same step. Pins
        stay as counts so every outstanding ``unpin`` still balances."""
        self._entries.clear()
        self._num_bytes = 0
