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

A background response's row is written as it starts (``queued``, with the pid of the process making
it) and replaced as it ends (``finish``, ``set_status``: only while it runs, so an end is written once);
a streamed one keeps its events in a third table, its last one written with its end (docs/architecture.md,
"Background responses").

Bounded in responses and in bytes (conversations, response objects, event logs and blobs together), least
recently used out first (a background response still running never): every write and every read of a response
makes it the most recent. Each row belongs to the API key (tenant) that made it: another key's id is not
found. One SQLite database: in memory for one API process, or a file every API process of a server opens
(``--responses-store FILE``; ``serve --api-server-count N`` sets one in its temporary folder), whose file
locks serialise the writers. Calls block (a conversation may be megabytes): the service runs them on a thread
(``asyncio.to_thread``), one at a time per process (``_lock``).
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable
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
CREATE TABLE IF NOT EXISTS response_events (
    tenant TEXT NOT NULL, id TEXT NOT NULL, seq INTEGER NOT NULL, event TEXT NOT NULL,
    PRIMARY KEY (tenant, id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS response_makers (
    tenant TEXT NOT NULL, id TEXT NOT NULL, maker TEXT NOT NULL, PRIMARY KEY (tenant, id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS totals (
    one INTEGER PRIMARY KEY CHECK (one = 1), num_responses INTEGER NOT NULL, num_bytes INTEGER NOT NULL
);
INSERT OR IGNORE INTO totals VALUES (1, 0, 0);
"""
_NEXT_USE = "(SELECT COALESCE(MAX(used), 0) + 1 FROM responses)"
_STATUS = "COALESCE(json_extract(response, '$.status'), '')"
RUNNING = ("queued", "in_progress")  # a background response's statuses before it ends
_NOT_RUNNING = f"{_STATUS} NOT IN {RUNNING}"

Event = tuple[int, str]  # a streamed background response's event: its sequence number and SSE text
# the text of a log's last event, made from its sequence number and the response's final object
Closing = Callable[[int, dict[str, Any]], str]


@dataclass(frozen=True)
class StoredResponse:
    items: list[dict[str, Any]]  # the conversation as input items, its data URLs back in place
    response: dict[str, Any]  # the response object GET returns


@dataclass(frozen=True)
class _Row:
    """A response as its row stores it: texts, the blobs its data URLs moved out to, its items' ids."""

    items_text: str
    response_text: str
    blobs: dict[str, str]  # digest -> data URL
    item_ids: frozenset[str]

    @property
    def num_bytes(self) -> int:
        return len(self.items_text) + len(self.response_text)

    @property
    def num_bytes_alone(self) -> int:
        """Its bytes with every blob it references, as if no other row shared them."""
        return self.num_bytes + sum(len(url) for url in self.blobs.values())

    @classmethod
    def of(cls, items: list[dict[str, Any]], response: dict[str, Any]) -> _Row:
        blobs: dict[str, str] = {}
        items_text = json.dumps(_moved_out(items, blobs), separators=(",", ":"))
        response_text = json.dumps(response, separators=(",", ":"))
        return cls(items_text, response_text, blobs, frozenset(i["id"] for i in items if "id" in i))


class ResponseStore:
    """``max_responses`` 0 stores nothing (every response is answered with ``store`` false)."""

    def __init__(self, path: str | Path | None, max_responses: int, max_bytes: int) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._lock = threading.Lock()
        self._db = connect(path, _SCHEMA)

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0 and self.max_bytes > 0

    def holds(self, items: list[dict[str, Any]]) -> bool:
        """Whether a response whose conversation begins with ``items`` may be stored: the store is on,
        and they alone are within the byte bound (what the answer adds may still take it over)."""
        return self.enabled and _Row.of(items, {}).num_bytes_alone <= self.max_bytes

    def put(
        self,
        tenant: str,
        response_id: str,
        items: list[dict[str, Any]],
        response: dict[str, Any],
        events: list[Event] | None = None,
        maker: str | None = None,
    ) -> int | None:
        """Store a response (a finished one, or a background one as it starts, with the first ``events``
        of its log and the identity of the process that makes it, ``maker``); then evict least recently used
        ones past the bounds. How many were evicted; None (nothing stored) where the store is off or
        this one alone is over the byte bound."""
        if not self.enabled:
            return None
        row = _Row.of(items, response)
        if row.num_bytes_alone > self.max_bytes:
            return None
        with self._lock, self._transaction():
            self._delete(tenant, response_id)  # an id is unique; a replay replaces
            self._insert(tenant, response_id, row, 0)
            if events:
                self._append(tenant, response_id, events)
            if maker is not None:
                self._db.execute("INSERT INTO response_makers VALUES (?, ?, ?)", (tenant, response_id, maker))
            return self._evict(tenant, response_id)

    def finish(
        self,
        tenant: str,
        response_id: str,
        items: list[dict[str, Any]],
        response: dict[str, Any],
        closing: Closing | None = None,
    ) -> int | None:
        """A background response's end: its conversation and final object replace the running ones,
        and ``closing`` (made from that object) is its event log's last event (where it has one), in
        one transaction, so a reader that sees the status ended has every event. Over the byte bound it
        ends ``failed`` instead. How many were evicted; None (nothing written) where it is no longer
        running: cancelled, deleted or evicted."""
        row = _Row.of(items, response)
        with self._lock, self._transaction():
            found = self._db.execute(
                f"SELECT {_STATUS} FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id)
            ).fetchone()
            if found is None or found[0] not in RUNNING:
                return None
            if row.num_bytes_alone > self.max_bytes:
                error = {"code": "server_error", "message": "The response is larger than the store holds."}
                self._set_status(tenant, response_id, "failed", error, closing)
                return 0
            (event_bytes,) = self._db.execute(
                "SELECT COALESCE(SUM(length(event)), 0) FROM response_events WHERE tenant = ? AND id = ?",
                (tenant, response_id),
            ).fetchone()
            self._delete(tenant, response_id, keep_events=True)
            self._insert(tenant, response_id, row, int(event_bytes))
            self._close_log(tenant, response_id, response, closing)
            return self._evict(tenant, response_id)

    def set_status(
        self,
        tenant: str,
        response_id: str,
        status: str,
        error: dict[str, Any] | None = None,
        closing: Closing | None = None,
    ) -> dict[str, Any] | None:
        """A running background response's status becomes ``status`` (``in_progress``; or it ends,
        ``cancelled``, or ``failed`` with its ``error``, with no output and ``closing`` its event log's
        last event); one no longer running is left as it is. Its object after that; None if absent."""
        with self._lock, self._transaction():
            return self._set_status(tenant, response_id, status, error, closing)

    def append_events(self, tenant: str, response_id: str, events: list[Event]) -> bool:
        """Adds to a running background response's event log (counted in its bytes); False where it is
        no longer running."""
        with self._lock, self._transaction():
            if self._status(tenant, response_id) not in RUNNING:
                return False
            self._append(tenant, response_id, events)
            return True

    def read_events(self, tenant: str, response_id: str, after: int) -> tuple[list[Event], str | None]:
        """The events of a background response's log numbered past ``after``, and its status as it was
        when they were read (None: absent)."""
        with self._lock, self._transaction():
            status = self._status(tenant, response_id)
            events = self._db.execute(
                "SELECT seq, event FROM response_events WHERE tenant = ? AND id = ? AND seq > ? ORDER BY seq",
                (tenant, response_id, after),
            ).fetchall()
        return [(int(seq), str(text)) for seq, text in events], status

    def fail_orphans(self, alive: Callable[[str], bool], closing: Closing) -> int:
        """Background responses whose maker process is no longer ``alive`` (it was killed: nothing else
        would end them) end ``failed``; how many did."""
        with self._lock, self._transaction():
            makers = self._db.execute("SELECT tenant, id, maker FROM response_makers").fetchall()
            orphans = [(tenant, response_id) for tenant, response_id, maker in makers if not alive(maker)]
            error = {"code": "server_error", "message": "The API process making the response stopped."}
            for tenant, response_id in orphans:
                self._set_status(tenant, response_id, "failed", error, closing)
        return len(orphans)

    def has_event_log(self, tenant: str, response_id: str) -> bool:
        """Whether the response was made as a streamed background one (its log starts at 0)."""
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM response_events WHERE tenant = ? AND id = ? AND seq = 0", (tenant, response_id)
            ).fetchone()
        return row is not None

    def status(self, tenant: str, response_id: str) -> str | None:
        with self._lock:
            return self._status(tenant, response_id)

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

    def _insert(self, tenant: str, response_id: str, row: _Row, extra_bytes: int) -> None:
        """Within a transaction: the row, its blobs (shared), its ids, and the totals."""
        num_new_bytes = row.num_bytes + extra_bytes
        for digest, url in row.blobs.items():
            known = self._db.execute("UPDATE blobs SET refs = refs + 1 WHERE digest = ?", (digest,))
            if known.rowcount == 0:
                self._db.execute("INSERT INTO blobs VALUES (?, ?, 1)", (digest, url))
                num_new_bytes += len(url)
        self._db.execute(
            f"INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, {_NEXT_USE})",
            (
                tenant,
                response_id,
                row.items_text,
                row.response_text,
                json.dumps(sorted(row.blobs)),
                row.num_bytes + extra_bytes,
            ),
        )
        self._db.executemany(  # every conversation that holds an item, by its id
            "INSERT OR IGNORE INTO item_holders VALUES (?, ?, ?)",
            {(tenant, item_id, response_id) for item_id in row.item_ids},
        )
        self._db.execute(
            "UPDATE totals SET num_responses = num_responses + 1, num_bytes = num_bytes + ?",
            (num_new_bytes,),
        )

    def _evict(self, tenant: str, response_id: str) -> int:
        """Within a transaction: least recently used responses out until the totals are within the
        bounds; neither the one just written (``response_id``) nor a background response still running
        (the bounds wait for them). How many were."""
        num_evicted = 0
        while True:
            num_responses, total_bytes = self._totals()
            if num_responses <= self.max_responses and total_bytes <= self.max_bytes:
                return num_evicted
            oldest = self._db.execute(
                f"SELECT tenant, id FROM responses WHERE {_NOT_RUNNING} AND NOT (tenant = ? AND id = ?)"
                " ORDER BY used LIMIT 1",
                (tenant, response_id),
            ).fetchone()
            if oldest is None:
                return num_evicted
            self._delete(*oldest)
            num_evicted += 1

    def _set_status(
        self,
        tenant: str,
        response_id: str,
        status: str,
        error: dict[str, Any] | None,
        closing: Closing | None,
    ) -> dict[str, Any] | None:
        """Within a transaction: ``set_status``."""
        row = self._db.execute(
            "SELECT response FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id)
        ).fetchone()
        if row is None:
            return None
        response: dict[str, Any] = json.loads(row[0])
        if response["status"] not in RUNNING:
            return response
        response.update(status=status, error=error)
        if status not in RUNNING:
            self._db.execute("DELETE FROM response_makers WHERE tenant = ? AND id = ?", (tenant, response_id))
        text = json.dumps(response, separators=(",", ":"))
        grown = len(text) - len(row[0])
        self._db.execute(
            "UPDATE responses SET response = ?, num_bytes = num_bytes + ? WHERE tenant = ? AND id = ?",
            (text, grown, tenant, response_id),
        )
        self._db.execute("UPDATE totals SET num_bytes = num_bytes + ?", (grown,))
        self._close_log(tenant, response_id, response, closing)
        return response

    def _close_log(
        self, tenant: str, response_id: str, response: dict[str, Any], closing: Closing | None
    ) -> None:
        """Within a transaction: where the response has an event log, its last event, numbered next."""
        (last,) = self._db.execute(
            "SELECT MAX(seq) FROM response_events WHERE tenant = ? AND id = ?", (tenant, response_id)
        ).fetchone()
        if closing is not None and last is not None:
            self._append(tenant, response_id, [(last + 1, closing(last + 1, response))])

    def _append(self, tenant: str, response_id: str, events: list[Event]) -> None:
        """Within a transaction: events into the log, their bytes the response's."""
        self._db.executemany(
            "INSERT OR REPLACE INTO response_events VALUES (?, ?, ?, ?)",
            [(tenant, response_id, seq, text) for seq, text in events],
        )
        num_bytes = sum(len(text) for _, text in events)
        self._db.execute(
            "UPDATE responses SET num_bytes = num_bytes + ? WHERE tenant = ? AND id = ?",
            (num_bytes, tenant, response_id),
        )
        self._db.execute("UPDATE totals SET num_bytes = num_bytes + ?", (num_bytes,))

    def _status(self, tenant: str, response_id: str) -> str | None:
        row = self._db.execute(
            f"SELECT {_STATUS} FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id)
        ).fetchone()
        return None if row is None else str(row[0])

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

    def _delete(self, tenant: str, response_id: str, keep_events: bool = False) -> bool:
        """Within a transaction: the row, its share of its blobs, blobs no row references any more, and
        its event log (unless ``keep_events``: the row is being replaced, its bytes with the log's)."""
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
        self._db.execute("DELETE FROM response_makers WHERE tenant = ? AND id = ?", (tenant, response_id))
        if not keep_events:
            self._db.execute("DELETE FROM response_events WHERE tenant = ? AND id = ?", (tenant, response_id))
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
