"""Data URLs this API process has already decoded and hashed (docs/architecture.md, "mm_hash")."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from wire.hashing import framed_digest

DATA_URL_DOMAIN = b"mmserve.data_url.v1"  # KnownDataUrls' keys, never an mm_hash


class KnownDataUrls:
    """The mm_hash of each data URL this API process has already decoded and hashed, so the same data
    URL sent again costs one blake3 pass over its text instead of a base64 decode plus a hash of the
    decoded bytes. The mm_hash itself is unchanged, taken over the decoded bytes (the same image by URL
    or by data URL hashes alike); this only remembers it, with the decoded size (the request's byte
    budget counts it). Entries are keyed by a digest of the URL's exact text and everything else the
    mm_hash covers, and are only added for URLs that decoded, so a hit is a URL that decodes.

    LRU, bounded in entries (about 300 bytes each). Called from the event loop only."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[str, int]] = OrderedDict()

    @staticmethod
    def key(
        *, model_id: str, modality: str, url: str, options: Mapping[str, Any], salt: str | None = None
    ) -> str:
        return framed_digest(DATA_URL_DOMAIN, model_id, modality, url, dict(options), salt)

    def get(self, key: str) -> tuple[str, int] | None:
        """(mm_hash, decoded size in bytes) of a known URL, now the most recently used; else None."""
        known = self._entries.get(key)
        if known is not None:
            self._entries.move_to_end(key)
        return known

    def put(self, key: str, mm_hash: str, num_bytes: int) -> None:
        self._entries[key] = (mm_hash, num_bytes)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
