"""The worker side of the encoder-cache connector (the scheduler side is ``engine/ec_connector.py``).

In each step, after the scheduler's drops and additions and before embeddings are gathered::

    start_load_caches(meta, placements)   load the step's ``load_mm_hashes`` from the store into the
                                          encoder store; returns the ones that failed (missing, store
                                          down, corrupt): the runner encodes those, or fails the step
    ... the vision encoder runs on the remaining encoder inputs ...
    save_caches(mm_hashes)                a producer saves every output it encoded, and the ones the
                                          scheduler asks to save again; a refused or failed save is
                                          counted, never fatal

Loads and saves are synchronous: a producer's step (and so its request) completes only once its outputs
are in the store, which is what lets a proxy send the request to an LM instance right after.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping

import torch

from wire.ec_store import ECRole, ECStore, ECStoreError
from wire.protocol import ECConnectorMeta, ECStepStats
from workers.ec_codec import CorruptEncoderOutput, decode_output, encode_output
from workers.encoder_store import EncoderStore

log = logging.getLogger(__name__)


class ECConnectorWorker:
    def __init__(
        self,
        store: ECStore,
        role: ECRole,
        encoder_store: EncoderStore,
        *,
        tail: tuple[int, ...],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """``tail``: the shape of one embedding row of this model's outputs (checked on every load);
        loaded outputs move to ``device`` and ``dtype`` (a producer may run in another precision)."""
        self.store = store
        self.role = role
        self.encoder_store = encoder_store
        self.tail = tail
        self.device = device
        self.dtype = dtype
        self._counts: Counter[str] = Counter()  # this step's ECStepStats fields, by name
        self._load_seconds: list[float] = []

    def start_load_caches(self, meta: ECConnectorMeta | None, num_tokens: Mapping[str, int]) -> list[str]:
        """Loads the step's items into the encoder store; ``num_tokens``: each item's placeholder count.
        Returns the mm_hashes that could not be loaded."""
        failed = []
        for mm_hash in meta.load_mm_hashes if meta is not None else ():
            start = time.perf_counter()
            try:
                value = self.store.get(mm_hash)
                if value is None:
                    raise LookupError("not in the store")
                output = decode_output(mm_hash, value, num_tokens[mm_hash], self.tail)
            except (ECStoreError, LookupError, CorruptEncoderOutput) as exc:
                log.warning("encoder output %s not loaded: %s", mm_hash, exc)
                self._counts["num_load_failures"] += 1
                failed.append(mm_hash)
                continue
            self.encoder_store.put(mm_hash, output.to(device=self.device, dtype=self.dtype))
            self._counts["num_loads"] += 1
            self._counts["load_bytes"] += len(value)
            self._load_seconds.append(time.perf_counter() - start)
        return failed

    def save_caches(self, mm_hashes: Iterable[str]) -> None:
        """Called after the encoder ran (producers only): each output, from the encoder store, into the
        store."""
        if not self.role.saves:
            return
        for mm_hash in dict.fromkeys(mm_hashes):
            value = encode_output(mm_hash, self.encoder_store.get(mm_hash))
            try:
                stored = self.store.put(mm_hash, value)
            except ECStoreError as exc:
                log.warning("encoder output %s not saved: %s", mm_hash, exc)
                stored = False
            if stored:
                self._counts["num_saves"] += 1
                self._counts["save_bytes"] += len(value)
            else:
                self._counts["num_save_failures"] += 1

    def count_fallback_encodes(self, num_items: int) -> None:
        self._counts["num_fallback_encodes"] += num_items

    def take_stats(self) -> ECStepStats | None:
        """This step's figures (then reset); None when the connector did nothing."""
        counts, self._counts = self._counts, Counter()
        load_seconds, self._load_seconds = self._load_seconds, []
        if not any(counts.values()):
            return None
        return ECStepStats(**counts, load_seconds=load_seconds)
