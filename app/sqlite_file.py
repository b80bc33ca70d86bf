"""SQLite tables an API process keeps in memory, or in a file every API process of a server opens
(media-id bindings, stored responses): one connection per process, every call one short transaction."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def connect(path: str | Path | None, schema: str) -> sqlite3.Connection:
    """A connection to ``path`` (None: this process's memory) whose tables ``schema`` creates where they
    are missing. Autocommit is off by hand: every call opens its own ``Transaction``. A file is WAL
    without fsync: it lives as long as the server, as shared memory rather than a record."""
    db = sqlite3.connect(
        ":memory:" if path is None else str(path), isolation_level=None, timeout=10.0, check_same_thread=False
    )
    if path is not None:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=OFF")
    with Transaction(db):  # the first API process creates the tables, the others find them
        for statement in filter(str.strip, schema.split(";")):
            db.execute(statement)
    return db


class Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on an exception): one writer at a time across
    the API processes, and no reader sees half a write."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        self._db.execute("COMMIT" if kind is None else "ROLLBACK")
