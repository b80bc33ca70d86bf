"""The ``shared-storage`` encoder-cache store: one file per mm_hash in a folder every instance sees
(a local disk for replicas on one host, a shared volume across hosts).

    <folder>/<mm_hash>.safetensors       complete values only: written as <folder>/.<mm_hash>.<unique>.tmp,
                                         then renamed over the final name (atomic on one file system)

A reader therefore never sees a partial file under the final name; what a file holds is checked again by
the worker when it loads it (``workers/ec_codec.py``). The folder is bounded in bytes: after each write
the producer removes the oldest files (by modification time, i.e. write time) until the total fits, and
temporary files a crashed producer left behind once they are an hour old.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from wire.ec_store import ECStoreError

SUFFIX = ".safetensors"
STALE_TMP_S = 3600.0
_KEY = re.compile(r"[0-9A-Za-z_-]{1,128}")  # mm_hashes are hex: nothing that could leave the folder


class SharedStorageStore:
    def __init__(self, folder: str | Path, max_bytes: int) -> None:
        """Creates ``folder`` if needed; ``max_bytes`` bounds the values it holds (0: unbounded)."""
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ECStoreError(f"cannot create the encoder-cache folder {self.folder}: {exc}") from exc

    def path(self, key: str) -> Path:
        if not _KEY.fullmatch(key):
            raise ValueError(f"not a store key: {key!r}")
        return self.folder / f"{key}{SUFFIX}"

    def exists(self, keys: Sequence[str]) -> list[bool]:
        found = []
        for key in keys:
            try:
                os.stat(self.path(key))
                found.append(True)
            except FileNotFoundError:
                if not self.folder.is_dir():  # the folder itself is gone: the store is down
                    raise ECStoreError(f"the encoder-cache folder {self.folder} is gone") from None
                found.append(False)
            except OSError as exc:
                raise ECStoreError(f"cannot look up {self.path(key)}: {exc}") from exc
        return found

    def get(self, key: str) -> bytes | None:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ECStoreError(f"cannot read {self.path(key)}: {exc}") from exc

    def put(self, key: str, value: bytes) -> bool:
        """Writes then renames; a second writer of the same key renames its own complete copy over the
        first (both hold the same output: the key is a content hash). False: larger than the bound."""
        final = self.path(key)
        if self.max_bytes and len(value) > self.max_bytes:
            return False
        tmp = self.folder / f".{key}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(value)
            os.replace(tmp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise ECStoreError(f"cannot write {final}: {exc}") from exc
        try:
            self._clean_up(keep=final)
        except OSError as exc:
            raise ECStoreError(f"cannot clean up {self.folder}: {exc}") from exc
        return True

    def _clean_up(self, keep: Path) -> None:
        """Oldest values first until the folder fits ``max_bytes`` (never the value just written)."""
        values: list[tuple[float, int, Path]] = []
        now = time.time()
        with os.scandir(self.folder) as entries:
            for entry in entries:
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # removed by another producer meanwhile
                    continue
                if entry.name.endswith(SUFFIX):
                    values.append((stat.st_mtime, stat.st_size, Path(entry.path)))
                elif entry.name.endswith(".tmp") and now - stat.st_mtime > STALE_TMP_S:
                    Path(entry.path).unlink(missing_ok=True)
        if not self.max_bytes:
            return
        total = sum(size for _, size, _ in values)
        for _, size, path in sorted(values):
            if total <= self.max_bytes:
                break
            if path != keep:
                path.unlink(missing_ok=True)
                total -= size

    def close(self) -> None:
        pass
