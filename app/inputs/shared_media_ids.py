"""Media-id bindings shared by the API processes of one server (``--mm-uuid-store FILE``; ``serve
--api-server-count N`` sets one): a SQLite file every API process opens, so a uuid bound through one
process resolves through any other (docs/architecture.md, "Cache salts and media ids").

One table, least recently used out past ``max_entries``. ``used`` orders the rows: every bind and every
hit sets it to one more than the largest (an index keeps that a lookup); a one-row table counts the rows,
so an eviction never scans. Each call is one short transaction (app/sqlite_file.py); SQLite's file locks
serialise the writers of all processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from app.inputs.media_ids import BindingKey, LocalMediaIds, MediaBinding, MediaIds
from app.settings import Settings
from app.sqlite_file import Transaction, connect
from workers.families.processing import ItemLayout

_SCHEMA = """
CREATE TABLE IF NOT EXISTS bindings (
    tenant TEXT NOT NULL, salt TEXT NOT NULL, uuid TEXT NOT NULL,
    mm_hash TEXT NOT NULL, kind TEXT NOT NULL, options TEXT NOT NULL, layout BLOB,
    used INTEGER NOT NULL,
    PRIMARY KEY (tenant, salt, uuid)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS bindings_by_use ON bindings (used);
CREATE TABLE IF NOT EXISTS counts (one INTEGER PRIMARY KEY CHECK (one = 1), num_bindings INTEGER NOT NULL);
INSERT OR IGNORE INTO counts VALUES (1, 0);
"""
_NEXT_USE = "(SELECT COALESCE(MAX(used), 0) + 1 FROM bindings)"
_KEY = "tenant = ? AND salt = ? AND uuid = ?"


def media_ids_for(settings: Settings) -> MediaIds:
    """This API process's bindings: the shared file when one is named, else its own memory."""
    if settings.mm_uuid_store is not None:
        return SharedMediaIds(settings.mm_uuid_store, settings.mm_uuid_cache_entries)
    return LocalMediaIds(settings.mm_uuid_cache_entries)


class SharedMediaIds:
    def __init__(self, path: str | Path, max_entries: int) -> None:
        self.max_entries = max_entries
        self._db = connect(path, _SCHEMA)
        self._encode = msgspec.msgpack.Encoder()
        self._decode = msgspec.msgpack.Decoder(ItemLayout)

    def _transaction(self) -> Transaction:
        return Transaction(self._db)

    def bind(self, key: BindingKey, binding: MediaBinding) -> None:
        if self.max_entries == 0:
            return
        options = json.dumps(dict(binding.options), sort_keys=True)
        layout = self._encode.encode(binding.layout) if binding.layout is not None else None
        with self._transaction():
            known = self._db.execute(f"SELECT 1 FROM bindings WHERE {_KEY}", key).fetchone()
            self._db.execute(
                f"INSERT OR REPLACE INTO bindings VALUES (?, ?, ?, ?, ?, ?, ?, {_NEXT_USE})",
                (*key, binding.mm_hash, binding.kind, options, layout),
            )
            if known is None:
                self._db.execute("UPDATE counts SET num_bindings = num_bindings + 1")
            (count,) = self._db.execute("SELECT num_bindings FROM counts").fetchone()
            if count > self.max_entries:
                self._db.execute("DELETE FROM bindings WHERE used = (SELECT MIN(used) FROM bindings)")
                self._db.execute("UPDATE counts SET num_bindings = num_bindings - 1")

    def get(self, key: BindingKey) -> MediaBinding | None:
        with self._transaction():
            row = self._db.execute(
                f"SELECT mm_hash, kind, options, layout FROM bindings WHERE {_KEY}", key
            ).fetchone()
            if row is None:
                return None
            self._db.execute(f"UPDATE bindings SET used = {_NEXT_USE} WHERE {_KEY}", key)
        mm_hash, kind, options, layout = row
        return MediaBinding(
            mm_hash, kind, json.loads(options), self._decode.decode(layout) if layout is not None else None
        )

    def __len__(self) -> int:
        (count,) = self._db.execute("SELECT num_bindings FROM counts").fetchone()
        return int(count)

    def close(self) -> None:
        self._db.close()
