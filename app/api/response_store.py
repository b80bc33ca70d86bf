"""Stored responses (``store``, ``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``;
docs/architecture.md, "The response store"): each row is one response object and the conversation that
led to it, as Responses input items (its own output last), so a follow-up turn is that conversation
plus its new input, rendered as if the client had sent it all.

A conversation keeps its media by identity: every ``data:`` image URL is moved out into a blob row keyed
by a digest of its text and referenced from every conversation that holds it, so a five-turn chain with
one screenshot per turn stores five images, not fifteen. A follow-up turn's images come back as the same
URL text, which the API's known-data-URL table and every cache keyed by mm_hash recognise; where the
caches have evicted them, the text is all it takes to process them again. ``http(s)`` URLs stay URLs
(fetched again only where no cache holds their item, as a resent history would be).

Every item of a stored conversation that has an id (all do: app/api/response_items.py) is found by it
too (``get_items``, an ``item_reference``'s): a second table lists the conversations that hold each id,
written with every row and emptied of a row's ids with the row, so an item stays found while any
conversation holding it is stored.

Bounded in responses and in bytes (conversations, response objects and blobs together), least recently
used out first: every write and every read of a response makes it the most recent. Each row belongs to
the API key (tenant) that made it: another key's id is not found. One SQLite database: in memory for one
API process, or a file every API process of a server opens (``--responses-store FILE``; ``serve
--api-server-count N`` sets one in its temporary folder), whose file locks serialise the writers. Calls
block (a conversation may be megabytes): the service runs them on a thread (``asyncio.to_thread``), one
at a time per process (``_lock``).
"""

from __future__ import annotations

import copy
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.sqlite_file import Transaction, connect
from wire.hashing import framed_digest

BLOB_DOMAIN = b"mmserve.response_blob.v1"
BLOB_PREFIX = "mmserve-blob:"  # an image_url moved out into a blob row; never a URL a client may send

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL, id TEXT NOT NULL,
    items TEXT NOT NULL, response TEXT NOT NULL, blobs TEXT NOT NULL,
    num_bytes INTEGER NOT NULL, used INTEGER NOT NULL,
    PRIMARY KEY (tenant, id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS responses_by_use ON responses (used);
CREATE TABLE IF NOT EXISTS blobs (
    digest TEXT PRIMARY KEY, url TEXT NOT NULL, refs INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS item_holders (
    tenant TEXT NOT NULL, id TEXT NOT NULL, response_id TEXT NOT NULL,
    PRIMARY KEY (tenant, id, response_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS item_holders_by_response ON item_holders (tenant, response_id);
CREATE TABLE IF NOT EXISTS totals (
    one INTEGER PRIMARY KEY CHECK (one = 1), num_responses INTEGER NOT NULL, num_bytes INTEGER NOT NULL
);
INSERT OR IGNORE INTO totals VALUES (1, 0, 0);
"""
_NEXT_USE = "(SELECT COALESCE(MAX(used), 0) + 1 FROM responses)"


@dataclass(frozen=True)
class StoredResponse:
    items: list[dict[str, Any]]  # the conversation as input items, its data URLs back in place
    response: dict[str, Any]  # the response object GET returns


class ResponseStore:
    """``max_responses`` 0 stores nothing (every response is answered with ``store`` false)."""

    def __init__(self, path: str | Path | None, max_responses: int, max_bytes: int) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._lock = threading.Lock()
        self._db = connect(path, _SCHEMA)

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0 and self.max_bytes > 0

    def put(
        self, tenant: str, response_id: str, items: list[dict[str, Any]], response: dict[str, Any]
    ) -> int | None:
        """Store a finished response; then evict least recently used ones past the bounds. How many were
        evicted; None (nothing stored) where the store is off or this one alone is over the byte bound."""
        if not self.enabled:
            return None
        blobs: dict[str, str] = {}
        items_text = json.dumps(_moved_out(items, blobs), separators=(",", ":"))
        response_text = json.dumps(response, separators=(",", ":"))
        num_bytes = len(items_text) + len(response_text)
        if num_bytes + sum(len(url) for url in blobs.values()) > self.max_bytes:
            return None
        num_evicted = 0
        with self._lock, self._transaction():
            self._delete(tenant, response_id)  # an id is unique; a replay replaces
            num_new_bytes = num_bytes
            for digest, url in blobs.items():
                known = self._db.execute("UPDATE blobs SET refs = refs + 1 WHERE digest = ?", (digest,))
                if known.rowcount == 0:
                    self._db.execute("INSERT INTO blobs VALUES (?, ?, 1)", (digest, url))
                    num_new_bytes += len(url)
            self._db.execute(
                f"INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, {_NEXT_USE})",
                (tenant, response_id, items_text, response_text, json.dumps(sorted(blobs)), num_bytes),
            )
            self._db.executemany(  # every conversation that holds an item, by its id
                "INSERT OR IGNORE INTO item_holders VALUES (?, ?, ?)",
                {(tenant, item["id"], response_id) for item in items if "id" in item},
            )
            self._db.execute(
                "UPDATE totals SET num_responses = num_responses + 1, num_bytes = num_bytes + ?",
                (num_new_bytes,),
            )
            while True:
                num_responses, total_bytes = self._totals()
                if num_responses <= self.max_responses and total_bytes <= self.max_bytes:
                    break
                oldest = self._db.execute(
                    "SELECT tenant, id FROM responses WHERE used = (SELECT MIN(used) FROM responses)"
                ).fetchone()
                self._delete(*oldest)
                num_evicted += 1
        return num_evicted

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The response and its conversation, now the most recently used; None if absent (never stored,
        evicted, deleted, or another tenant's)."""
        with self._lock, self._transaction():
            return self._get(tenant, response_id)

    def get_items(self, tenant: str, item_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The stored items by these ids (an ``item_reference``'s), each from the most recently used
        conversation that holds it, which is now used again (each read once, however many ids it
        answers); an id none holds (or another tenant's) is left out."""
        holders: dict[str, list[str]] = {}  # response id -> the ids it answers
        found: dict[str, dict[str, Any]] = {}
        with self._lock, self._transaction():
            for item_id in dict.fromkeys(item_ids):
                row = self._db.execute(
                    "SELECT h.response_id FROM item_holders h JOIN responses r"
                    " ON r.tenant = h.tenant AND r.id = h.response_id"
                    " WHERE h.tenant = ? AND h.id = ? ORDER BY r.used DESC LIMIT 1",
                    (tenant, item_id),
                ).fetchone()
                if row is not None:
                    holders.setdefault(row[0], []).append(item_id)
            for response_id, wanted in holders.items():
                stored = self._get(tenant, response_id)
                by_id = {item.get("id"): item for item in stored.items} if stored is not None else {}
                found.update({item_id: by_id[item_id] for item_id in wanted if item_id in by_id})
        return found

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock, self._transaction():
            return self._delete(tenant, response_id)

    def totals(self) -> tuple[int, int]:
        """(responses, bytes) stored, blobs included."""
        with self._lock:
            return self._totals()

    def close(self) -> None:
        self._db.close()

    def _get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """Within a transaction: ``get``."""
        row = self._db.execute(
            "SELECT items, response FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id)
        ).fetchone()
        if row is None:
            return None
        self._db.execute(
            f"UPDATE responses SET used = {_NEXT_USE} WHERE tenant = ? AND id = ?", (tenant, response_id)
        )
        items = json.loads(row[0])
        urls: dict[str, str] = {}
        for digest in _blob_refs(items):
            (urls[digest],) = self._db.execute("SELECT url FROM blobs WHERE digest = ?", (digest,)).fetchone()
        return StoredResponse(_moved_in(items, urls), json.loads(row[1]))

    def _totals(self) -> tuple[int, int]:
        num_responses, num_bytes = self._db.execute("SELECT num_responses, num_bytes FROM totals").fetchone()
        return int(num_responses), int(num_bytes)

    def _delete(self, tenant: str, response_id: str) -> bool:
        """Within a transaction: the row, its share of its blobs, and blobs no row references any more."""
        row = self._db.execute(
            "SELECT blobs, num_bytes FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id)
        ).fetchone()
        if row is None:
            return False
        num_freed = int(row[1])
        for digest in json.loads(row[0]):
            self._db.execute("UPDATE blobs SET refs = refs - 1 WHERE digest = ?", (digest,))
            gone = self._db.execute(
                "DELETE FROM blobs WHERE digest = ? AND refs = 0 RETURNING length(url)", (digest,)
            ).fetchone()
            if gone is not None:
                num_freed += int(gone[0])
        self._db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id))
        self._db.execute(
            "DELETE FROM item_holders WHERE tenant = ? AND response_id = ?", (tenant, response_id)
        )
        self._db.execute(
            "UPDATE totals SET num_responses = num_responses - 1, num_bytes = num_bytes - ?", (num_freed,)
        )
        return True

    def _transaction(self) -> Transaction:
        return Transaction(self._db)


def _images(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``input_image`` parts of a conversation's message items, in order."""
    return [
        part
        for item in items
        if item.get("type", "message") == "message" and isinstance(item.get("content"), list)
        for part in item["content"]
        if part.get("type") == "input_image"
    ]


def _moved_out(items: list[dict[str, Any]], blobs: dict[str, str]) -> list[dict[str, Any]]:
    """A copy of ``items`` whose data URLs are blob references; ``blobs`` gets digest -> URL text."""
    items = copy.deepcopy(items)  # the strings (data URLs) are shared, not copied
    for part in _images(items):
        url = part.get("image_url")  # absent: a part that names its media by uuid alone
        if url is not None and url.startswith("data:"):
            digest = framed_digest(BLOB_DOMAIN, url)
            blobs[digest] = url
            part["image_url"] = BLOB_PREFIX + digest
    return items


def _blob_refs(items: list[dict[str, Any]]) -> set[str]:
    return {
        part["image_url"].removeprefix(BLOB_PREFIX)
        for part in _images(items)
        if part.get("image_url", "").startswith(BLOB_PREFIX)
    }


def _moved_in(items: list[dict[str, Any]], urls: dict[str, str]) -> list[dict[str, Any]]:
    for part in _images(items):
        if part.get("image_url", "").startswith(BLOB_PREFIX):
            part["image_url"] = urls[part["image_url"].removeprefix(BLOB_PREFIX)]
    return items
