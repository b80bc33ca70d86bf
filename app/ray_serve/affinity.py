"""Which replica holds which media (docs/architecture.md, "Replicas on Ray Serve"), as the router sees
it: what each replica last reported (the keys of the media it served most recently, bounded by the
replica) and the router's own placements since (so a repeat sent before the next report still goes
where the first went). Pure bookkeeping, no Ray: the router owns one and calls it from its event loop."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

# How many more requests the replica holding a request's media may have queued than the least loaded
# before the request goes to the least loaded (at 4, a fallback re-encoded and re-prefilled a whole
# history often enough to cost more than it balanced: docs/benchmarks.md, "Replicas on Ray")
IMBALANCE_THRESHOLD = 16


class Placement(StrEnum):
    """How a request was placed, the label of ``mmserve_ray_placements_total``."""

    AFFINITY = "affinity"  # to a replica that holds some of its media
    FALLBACK = "fallback"  # its media is held, but that replica's queue was too long
    NEW = "new"  # no replica holds any of its media (or it has none): the least loaded


@dataclass(frozen=True)
class Choice:
    """The replicas a router tries first for one request (then the others), and those holding most of
    its media, which tell how routing to a replica counts."""

    preferred: tuple[Hashable, ...]
    holders: tuple[Hashable, ...]

    def placement(self, replica: Hashable) -> Placement:
        if not self.holders:
            return Placement.NEW
        return Placement.AFFINITY if replica in self.holders else Placement.FALLBACK


class AffinityTable:
    """``max_placements`` bounds the router's own memory of placements (LRU), whatever replicas
    report."""

    def __init__(self, max_placements: int = 65536) -> None:
        self.max_placements = max_placements
        self._reported: dict[Hashable, frozenset[str]] = {}
        self._placed: OrderedDict[str, Hashable] = OrderedDict()
        self._num_placed: dict[Hashable, int] = {}  # per replica: the placements that name it

    def report(self, replica: Hashable, keys: Iterable[str]) -> None:
        """A replica's latest report replaces its previous one."""
        self._reported[replica] = frozenset(keys)

    def forget(self, replica: Hashable) -> None:
        """A replica that died or left: its keys go with it."""
        self._reported.pop(replica, None)
        for key in [key for key, placed in self._placed.items() if placed == replica]:
            del self._placed[key]
        self._num_placed.pop(replica, None)

    def place(self, keys: Iterable[str], replica: Hashable) -> None:
        for key in keys:
            previous = self._placed.get(key)
            if previous != replica:
                self._add(previous, -1)
                self._add(replica, 1)
            self._placed[key] = replica
            self._placed.move_to_end(key)
        while len(self._placed) > self.max_placements:
            self._add(self._placed.popitem(last=False)[1], -1)

    def _add(self, replica: Hashable | None, delta: int) -> None:
        if replica is not None:
            self._num_placed[replica] = self._num_placed.get(replica, 0) + delta

    def num_keys(self, replica: Hashable) -> int:
        """About how many keys the replica holds (a key both reported and placed counts twice): the
        tie-breaker that spreads new media."""
        return len(self._reported.get(replica, ())) + self._num_placed.get(replica, 0)

    def held_by(self, keys: Sequence[str], replica: Hashable) -> int:
        """How many of ``keys`` the replica holds: in its last report, or placed there since."""
        reported = self._reported.get(replica, frozenset())
        return sum(key in reported or self._placed.get(key) == replica for key in keys)

    def choose(
        self,
        keys: Sequence[str],
        queue_lens: dict[Hashable, int],
        imbalance_threshold: int,
        *,
        holder_only: bool = False,
    ) -> Choice:
        """``queue_lens``: every candidate replica with its queue length. The replicas holding the most
        of ``keys`` are preferred unless the shortest of their queues exceeds the shortest of all by more
        than ``imbalance_threshold`` (bounded imbalance), or whatever the queues with ``holder_only``.
        Otherwise, and for media held nowhere, the least loaded replica is, the one holding fewest keys
        among equals (new media spreads over replicas)."""
        if not queue_lens:
            return Choice((), ())
        scores = {replica: self.held_by(keys, replica) for replica in queue_lens} if keys else {}
        best = max(scores.values(), default=0)
        holders = tuple(replica for replica, score in scores.items() if score == best) if best else ()
        imbalance = min(queue_lens[r] for r in holders) - min(queue_lens.values()) if holders else 0
        if holders and (holder_only or imbalance <= imbalance_threshold):
            return Choice(holders, holders)
        least = min(queue_lens, key=lambda replica: (queue_lens[replica], self.num_keys(replica)))
        return Choice((least,), holders)

    def num_placements(self) -> int:
        return len(self._placed)
