"""The scheduler side of the encoder-cache connector (the worker side is ``workers/ec_connector.py``).

An encoder output lives in one worker's encoder store; the connector shares it with other instances
through an external store (``engine/ec_store``), keyed by mm_hash::

    scheduler, for an item the encoder cache lacks     has_caches([mm_hash]) -> [in the store?]
      in the store: allocate encoder-cache room         update_state_after_alloc(mm_hash)
      (no encoder compute budget spent)
    end of schedule()                                   build_connector_meta() -> ECConnectorMeta
      -> SchedulerOutput.ec_meta: the worker loads those items before gathering embeddings
         (start_load_caches) and, as a producer, saves every output it encodes (save_caches)

Roles: a ``producer`` saves what it encodes, a ``consumer`` loads what the store has instead of encoding,
``both`` does both. The store may lose an item between ``has_caches`` and the worker's load (evicted,
lease expired, store down): the worker then encodes the item itself when it has the vision tower (the
scheduler sent the item's tensors too), or fails the step's requests with 503. A store that cannot be
reached answers "not there" here (counted): the instance encodes locally, or answers 503.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from wire.ec_store import ECRole, ECStore, ECStoreError
from wire.protocol import ECConnectorMeta

log = logging.getLogger(__name__)


class ECConnectorScheduler:
    """Owned by the scheduler; one store client in the engine process (existence checks only)."""

    def __init__(self, store: ECStore, role: ECRole) -> None:
        self.store = store
        self.role = role
        self._load_mm_hashes: list[str] = []
        self._save_mm_hashes: list[str] = []
        self.num_lookups = 0  # items looked up in the store
        self.num_lookup_hits = 0
        self.num_lookup_errors = 0  # items whose lookup failed: the store could not be reached

    def has_caches(self, mm_hashes: Sequence[str]) -> list[bool]:
        """Called when the scheduler first needs items its encoder cache lacks: which the store holds
        now. An unreachable store holds nothing (logged and counted)."""
        if not mm_hashes:
            return []
        self.num_lookups += len(mm_hashes)
        try:
            found = self.store.exists(mm_hashes)
        except ECStoreError as exc:
            log.warning("encoder-cache store lookup failed: %s", exc)
            self.num_lookup_errors += len(mm_hashes)
            return [False] * len(mm_hashes)
        self.num_lookup_hits += sum(found)
        return found

    def update_state_after_alloc(self, mm_hash: str) -> None:
        """Called once encoder-cache room was allocated for an item the store holds: the worker loads
        it in this step."""
        self._load_mm_hashes.append(mm_hash)

    def request_save(self, mm_hash: str) -> None:
        """A producer's item that its worker holds but the store lost: saved again in this step."""
        self._save_mm_hashes.append(mm_hash)

    def build_connector_meta(self) -> ECConnectorMeta | None:
        """Called at the end of ``schedule()``: this step's loads and saves (then forgotten here)."""
        if not (self._load_mm_hashes or self._save_mm_hashes):
            return None
        meta = ECConnectorMeta(load_mm_hashes=self._load_mm_hashes, save_mm_hashes=self._save_mm_hashes)
        self._load_mm_hashes, self._save_mm_hashes = [], []
        return meta
