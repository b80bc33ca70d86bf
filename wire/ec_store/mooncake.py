"""``MooncakeStore``: the ``ECStore`` on a Mooncake distributed store (``mooncake.store``), TCP only.

A store needs a ``mooncake_master`` and at least one process that mounts memory for the values (a
holder, see ``mooncake_processes``); this client mounts ``global_segment_size_bytes`` (0 by default, so
values outlive it) and stages every value in its ``local_buffer_size_bytes`` buffer, which bounds the
size of one value.

Semantics (mooncake 0.3.13):

* put is first-writer-wins: a put of a key that exists, or that another producer is writing now,
  returns True and keeps the first value (Mooncake answers OBJECT_ALREADY_EXISTS, which its client
  reports as success). A reader only ever sees a complete value: a key exists once its put ended.
* a full store refuses puts (False) until the master's eviction frees room; values read or checked in
  the last lease period (master flag ``--default_kv_lease_ttl``) are not evicted.
* a dead or hung master: each call raises ``ECStoreError`` after at most ~4.5 s (dead: the RPC pool's
  reconnect attempts) or ``rpc_timeout_ms`` (hung); then, for ``retry_after_s``, calls raise at once
  without trying. The master restarted, calls work again (its values are gone). Opening a store: at
  once against a dead master (a TCP probe first), ~2 x ``rpc_timeout_ms`` against a hung one.
* a hung holder: a transfer with no progress for ``transfer_timeout_s`` fails (get -> None or
  ECStoreError). A dead holder: its values are gone (get -> None) and puts are refused until a holder
  mounts memory again.

Environment: ``MC_RPC_TIMEOUT_MS``/``MC_RPC_CONNECT_TIMEOUT_MS`` (from ``rpc_timeout_ms``),
``MC_TCP_PROGRESS_TIMEOUT_SEC``/``MC_TCP_STATUS_TIMEOUT_SEC`` (from ``transfer_timeout_s``) are set, and
``MC_STORE_CLIENT_SETUP_RETRIES`` to 2 unless set: Mooncake reads them from the process environment
when a store is set up (defaults 30 s, 30 s and 20 retries: a setup against a dead master took 90 s).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from wire.ec_store import ECStoreError

T = TypeVar("T")

# Mooncake ErrorCode values (mooncake-store/include/types.h) that this module acts on. put:
#   0                             stored (or OBJECT_ALREADY_EXISTS, which the client folds into 0)  -> True
#   -705 OBJECT_ALREADY_EXISTS    the key exists or is being written (defensive: not seen surfaced) -> True
#   -200 NO_AVAILABLE_HANDLE      no room in any mounted segment (full and leased, or no holder)   -> False
#   -10  BUFFER_OVERFLOW          no room                                                            -> False
#   -600 INVALID_PARAMS           the value does not fit in the local staging buffer now             -> False
#   -900 RPC_FAIL, -901 RPC_TIMEOUT  master unreachable                      -> ECStoreError (+ backoff)
#   anything else negative                                                                  -> ECStoreError
# exists (batch_is_exist): 1 present, 0 absent, negative -> ECStoreError. get_size: >= 0 the size,
# -704 OBJECT_NOT_FOUND -> get returns None, other negative -> ECStoreError.
_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -600: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
}
_PUT_STORED = {0, -705}
_PUT_REFUSED = {-200, -10, -600}
_NOT_FOUND = -704
_UNREACHABLE = {-900, -901}


def _code_name(code: int) -> str:
    return f"{code} ({_NAMES.get(code, 'see mooncake ErrorCode')})"


class MooncakeStore:
    """One Mooncake client; thread-safe (calls run without the GIL). Opened once per process that
    needs it (engine: exists; workers: get/put); ``close()`` at shutdown."""

    def __init__(
        self,
        master_address: str,
        *,
        metadata_server: str = "P2PHANDSHAKE",
        local_hostname: str = "127.0.0.1",
        global_segment_size_bytes: int = 0,
        local_buffer_size_bytes: int = 64 << 20,
        rpc_timeout_ms: int = 2000,
        transfer_timeout_s: int = 5,
        retry_after_s: float = 5.0,
    ) -> None:
        """Connects to the master at ``master_address`` ("host:port"); raises ECStoreError when it
        cannot. ``local_buffer_size_bytes`` bounds one value (put refuses a larger one, get fails)."""
        self._master = master_address
        self._retry_after_s = retry_after_s
        self._down_until = 0.0
        self._closed = False
        self._lock = threading.Lock()
        host, _, port = master_address.rpartition(":")
        try:  # fail fast: mooncake's setup retries a dead master for over a minute
            socket.create_connection((host, int(port)), timeout=rpc_timeout_ms / 1000).close()
        except (OSError, ValueError) as e:
            raise ECStoreError(f"mooncake master {master_address} unreachable: {e}") from e
        os.environ["MC_RPC_TIMEOUT_MS"] = str(rpc_timeout_ms)
        os.environ["MC_RPC_CONNECT_TIMEOUT_MS"] = str(rpc_timeout_ms)
        os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = str(transfer_timeout_s)
        os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] = str(transfer_timeout_s)
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "2")
        try:
            from mooncake.store import MooncakeDistributedStore

            self._store: Any = MooncakeDistributedStore()
            rc = self._store.setup(
                local_hostname,
                metadata_server,
                global_segment_size_bytes,
                local_buffer_size_bytes,
                "tcp",
                "",
                master_address,
            )
        except Exception as e:  # ImportError (not installed), a binding error
            raise ECStoreError(f"mooncake store setup failed: {e!r}") from e
        if rc != 0:
            self._closed = True
            self._store.close()
            raise ECStoreError(f"mooncake store setup against {master_address} failed: {_code_name(rc)}")

    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """Runs one client call: refused while closed or within the backoff after a failure."""
        if self._closed:
            raise ECStoreError("mooncake store is closed")
        now = time.monotonic()
        if now < self._down_until:
            raise ECStoreError(
                f"mooncake master {self._master} unreachable; next try in {self._down_until - now:.1f} s"
            )
        try:
            return fn(*args)
        except Exception as e:
            self._mark_down()
            raise ECStoreError(f"mooncake {what} raised {e!r}") from e

    def _mark_down(self) -> None:
        self._down_until = time.monotonic() + self._retry_after_s

    def _fail(self, what: str, code: int) -> ECStoreError:
        if code in _UNREACHABLE:
            self._mark_down()
        return ECStoreError(f"mooncake {what} failed: {_code_name(code)}")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Called by the engine's scheduler. One RPC for all keys; each hit also renews its lease."""
        if not keys:
            return []
        codes: list[int] = self._call("batch_is_exist", self._store.batch_is_exist, list(keys))
        bad = [c for c in codes if c not in (0, 1)]
        if bad or len(codes) != len(keys):
            raise self._fail("batch_is_exist", bad[0] if bad else -1)
        return [c == 1 for c in codes]

    def get(self, key: str) -> bytes | None:
        """Called by a worker to load a value: the complete value, or None when absent."""
        # mooncake's get() answers b"" both for "absent" and for "failed" (and never stores an empty
        # value): ask the size first, which tells them apart, and check again if the read comes back empty
        size: int = self._call("get_size", self._store.get_size, key)
        if size == _NOT_FOUND:
            return None
        if size < 0:
            raise self._fail("get_size", size)
        data: bytes = self._call("get", self._store.get, key)
        if len(data) == size and size > 0:
            return data
        if not data and self.exists([key]) == [False]:
            return None  # evicted between the two calls
        raise ECStoreError(f"mooncake get of {key!r} returned {len(data)} bytes, expected {size}")

    def put(self, key: str, value: bytes) -> bool:
        """Called by a producer worker. True: stored, or already there (first writer wins); False: refused
        for lack of room (store full, no holder, or ``value`` larger than the local buffer) or empty."""
        if not value:
            return False  # mooncake refuses an empty value (INVALID_PARAMS); ec_codec never writes one
        rc: int = self._call("put", self._store.put, key, value)
        if rc in _PUT_STORED:
            return True
        if rc in _PUT_REFUSED:
            return False
        raise self._fail("put", rc)

    def close(self) -> None:
        """Unregisters from the master (its local segment, if any, is unmounted); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._store.close()
        except Exception as e:
            raise ECStoreError(f"mooncake close raised {e!r}") from e
