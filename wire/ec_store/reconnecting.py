"""An ``ECStore`` that opens its backend on first use and again after it failed, so an instance starts
and serves while its store is down (every call then raises ``ECStoreError``: encode locally, counted)
and uses the store again once it is back.

After a failure the backend is closed and not reopened for ``retry_after_s``: a dead store costs one
failed call per interval, not one connection attempt per item.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from wire.ec_store import ECConfig, ECStore, ECStoreError, open_store

log = logging.getLogger(__name__)

T = TypeVar("T")


class ReconnectingStore:
    def __init__(
        self, config: ECConfig, retry_after_s: float = 2.0, opener: Callable[[ECConfig], ECStore] = open_store
    ) -> None:
        self.config = config
        self.retry_after_s = retry_after_s
        self._opener = opener
        self._store: ECStore | None = None
        self._down_until = 0.0

    def _call(self, what: Callable[[ECStore], T]) -> T:
        if self._store is None:
            if time.monotonic() < self._down_until:
                raise ECStoreError(f"the {self.config.connector} store is down (retrying shortly)")
            try:
                self._store = self._opener(self.config)
            except ECStoreError:
                self._down_until = time.monotonic() + self.retry_after_s
                raise
            log.info("encoder-cache store (%s) connected", self.config.connector)
        try:
            return what(self._store)
        except ECStoreError:
            self._reset()
            raise

    def _reset(self) -> None:
        store, self._store = self._store, None
        self._down_until = time.monotonic() + self.retry_after_s
        if store is not None:
            try:
                store.close()
            except Exception:  # closing a broken client: nothing left to save
                log.debug("closing a failed store client", exc_info=True)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._call(lambda store: store.exists(keys))

    def get(self, key: str) -> bytes | None:
        return self._call(lambda store: store.get(key))

    def put(self, key: str, value: bytes) -> bool:
        return self._call(lambda store: store.put(key, value))

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
