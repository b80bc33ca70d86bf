"""Seeded differential test: the API's IpcMirror and the engine's ReceiverCache never disagree.

It drives both through the real protocol with interleaved requests: phase 1 (lookup_and_pin) for one
request, other requests' phases in between, then phase 2 (record_request) and the "message"
(evicted keys + features) applied by ``ReceiverCache.apply``, then unpin; some requests are abandoned
after phase 1, and resets hit both sides at once (an ordered ResetCaches message).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from app.inputs.ipc_mirror import IpcMirror, MirrorDecision
from engine.receiver_cache import ReceiverCache

CAPACITY = 10
NUM_OPS = 10_000
MAX_IN_FLIGHT = 6


@dataclass
class InFlight:
    mm_hashes: list[str]
    pinned: list[str]  # phase-1 hits, each pinned once per occurrence
    pins_intact: bool = True  # no reset since phase 1: every pinned key must still be a HIT


def payload(mm_hash: str) -> str:
    return f"item:{mm_hash}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mirror_and_receiver_never_disagree(seed: int) -> None:
    rng = random.Random(seed)
    sizes = {f"k{i:02d}": rng.randint(1, 4) for i in range(20)}
    sizes["huge"] = CAPACITY + 1  # never cached on either side
    keys = list(sizes)
    weights = [1.0] * 20 + [0.2]
    mirror = IpcMirror(CAPACITY)
    receiver: ReceiverCache[str] = ReceiverCache()
    in_flight: list[InFlight] = []
    seen: Counter[str] = Counter()

    def send(req: InFlight) -> None:
        items = [(h, sizes[h], 7 * sizes[h]) for h in req.mm_hashes]
        decisions, evicted = mirror.record_request(items)
        # the message, handed to the ordered socket in the same step; the engine applies it
        features = [
            (h, None if d is MirrorDecision.HIT else payload(h), sizes[h], d is MirrorDecision.STORE)
            for h, d in zip(req.mm_hashes, decisions, strict=True)
        ]
        resolved, missing = receiver.apply(evicted, features)
        assert missing == []
        assert resolved == [payload(h) for h in req.mm_hashes]
        assert not set(evicted) & {h for other in in_flight if other.pins_intact for h in other.pinned}
        if req.pins_intact:
            hit_keys = {h for h, d in zip(req.mm_hashes, decisions, strict=True) if d is MirrorDecision.HIT}
            assert set(req.pinned) <= hit_keys
        for h in req.pinned:
            mirror.unpin(h)
        seen.update(d.name for d in decisions)
        seen["evictions"] += len(evicted)
        seen["uncached_fitting"] += sum(
            d is MirrorDecision.UNCACHED and sizes[h] <= CAPACITY
            for h, d in zip(req.mm_hashes, decisions, strict=True)
        )

    for _ in range(NUM_OPS):
        op = rng.random()
        if op < 0.45 and len(in_flight) < MAX_IN_FLIGHT:
            mm_hashes = rng.choices(keys, weights, k=rng.randint(1, 3))
            pinned = [h for h in mm_hashes if mirror.lookup_and_pin(h) is not None]
            in_flight.append(InFlight(mm_hashes, pinned))
            seen["started"] += 1
        elif op < 0.93 and in_flight:
            send(in_flight.pop(rng.randrange(len(in_flight))))
        elif op < 0.99 and in_flight:
            for h in in_flight.pop(rng.randrange(len(in_flight))).pinned:
                mirror.unpin(h)
            seen["abandoned"] += 1
        elif op >= 0.99:
            mirror.reset()
            receiver.clear()
            for req in in_flight:
                req.pins_intact = False
            seen["resets"] += 1
        assert mirror.keys() == receiver.keys()
        assert mirror.num_bytes == receiver.num_bytes <= CAPACITY

    while in_flight:
        send(in_flight.pop())
    assert mirror.keys() == receiver.keys()
    assert mirror._pins == {}  # every pin was balanced

    # the run really exercised every path (observed counts are 2-5x these floors)
    assert mirror.num_hits > 500
    for what, least in [
        ("HIT", 1000),
        ("STORE", 2000),
        ("UNCACHED", 200),
        ("uncached_fitting", 100),  # all candidates pinned or protected
        ("evictions", 2000),
        ("abandoned", 200),
        ("resets", 50),
    ]:
        assert seen[what] >= least, (what, seen)
