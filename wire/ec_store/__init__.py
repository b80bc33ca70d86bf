"""Byte stores behind the encoder-cache connector: one value per mm_hash, shared by instances.

    ECStore.exists(keys) -> [bool]      the engine's has_caches (scheduler side)
    ECStore.get(key) -> bytes | None    a worker's load (None: not there)
    ECStore.put(key, value) -> bool     a producer worker's save (False: refused, e.g. the store is full)

Values are opaque here (the worker's ``workers/ec_codec.py`` writes and checks them). Both the engine and
the worker open a store; neither needs torch to do so. A store that cannot be reached raises
``ECStoreError`` from any call: callers count it and carry on (encode locally, or answer 503), never crash.
See docs/architecture.md, "Encoder-cache connector".
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class ECRole(enum.StrEnum):
    """``producer`` saves what it encodes, ``consumer`` loads what the store has, ``both`` does both."""

    PRODUCER = "producer"
    CONSUMER = "consumer"
    BOTH = "both"

    @property
    def loads(self) -> bool:
        return self is not ECRole.PRODUCER

    @property
    def saves(self) -> bool:
        return self is not ECRole.CONSUMER


@dataclass(frozen=True)
class ECConfig:
    """The connector's settings, the same in the engine and the worker of an instance."""

    connector: str  # "shared-storage" | "mooncake"
    role: ECRole
    storage_path: str = ""  # shared-storage: the folder
    storage_max_bytes: int = 0  # shared-storage: bound on the folder's values (0: unbounded)
    mooncake_master: str = "127.0.0.1:50051"  # mooncake: the master's RPC address
    mooncake_metadata_server: str = "P2PHANDSHAKE"
    mooncake_local_hostname: str = "127.0.0.1"


class ECStoreError(RuntimeError):
    """The store could not answer (unreachable, timed out, an I/O error)."""


class ECStore(Protocol):
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key has a complete value now (it may still vanish before a ``get``)."""
        ...

    def get(self, key: str) -> bytes | None:
        """The value, or None when the key is absent."""
        ...

    def put(self, key: str, value: bytes) -> bool:
        """Stores ``value`` whole under ``key`` (a reader never sees part of it); False when the store
        refused it (no room, or the key is being written by another producer). Idempotent."""
        ...

    def close(self) -> None: ...


def open_store(config: ECConfig) -> ECStore:
    """The store ``config`` names (raises ``ECStoreError`` when it cannot be opened)."""
    if config.connector == "shared-storage":
        from wire.ec_store.shared_storage import SharedStorageStore

        return SharedStorageStore(config.storage_path, config.storage_max_bytes)
    if config.connector == "mooncake":
        from wire.ec_store.mooncake import MooncakeStore

        return MooncakeStore(
            master_address=config.mooncake_master,
            metadata_server=config.mooncake_metadata_server,
            local_hostname=config.mooncake_local_hostname,
        )
    raise ValueError(f"unknown encoder-cache connector {config.connector!r}")
