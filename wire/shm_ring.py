"""A single-writer shared-memory ring of processed multimodal items (``--mm-processor-cache-type shm``).

    API: ShmRingWriter ──ShmItemRef──▶ engine: ShmRingReader.check ──ShmItemRef──▶ worker: .payload
         acquire(item_id) when a request carries the item, release(item_id) at its final output/abort

The API process is the only writer: it copies an item's tensors into a chunk and sends a reference
instead of tensor frames; the engine and the worker never write. A request carrying a reference holds
one count on the chunk from the moment the API found or wrote the item until the engine's final output
for that request reaches the API; only chunks with no count are freed, so an item a scheduled request
still needs is never overwritten. Each chunk header carries a monotonic ``item_id`` (never reused) and
the payload size, and a freed chunk's header is zeroed: the worker checks both before reading in
place, so a stale or corrupt reference is detected, never read as garbage. Stdlib only:
``multiprocessing.shared_memory``'s resource tracker unlinks segments other processes attached to.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import math
import mmap
import os
import re
import stat
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass

from wire.protocol import ShmItemRef, ShmTensor

HEADER_BYTES = 64
SHM_DIR = "/dev/shm"  # where rings and the preprocessing pool's transfer files live
_HEADER = struct.Struct("<QQ")  # item_id, payload size; the rest of the 64 bytes is zero
NAME_RE = re.compile(r"mmserve\.([0-9]+)\.[A-Za-z0-9_-]+")
RING_TAG_PREFIX = "ring-"  # tags of files held by an flock while their writer lives (see remove_orphans)
ORPHAN_MIN_AGE_S = 60.0
_ITEMSIZE = {
    **dict.fromkeys(("bool", "uint8", "int8"), 1),
    **dict.fromkeys(("float16", "bfloat16", "int16", "uint16"), 2),
    **dict.fromkeys(("float32", "int32", "uint32"), 4),
    **dict.fromkeys(("float64", "int64", "uint64", "complex64"), 8),
    "complex128": 16,
}


class StaleShmRef(Exception):
    """A reference that does not match the ring; the message says why."""


def ring_name(owner_pid: int, tag: str) -> str:
    name = f"mmserve.{owner_pid}.{tag}"
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"ring tag {tag!r} is not [A-Za-z0-9_-]+")
    return name


def round_up(size: int) -> int:
    """``size`` rounded up to a multiple of 64 bytes (chunks, and tensors inside payloads, align so)."""
    return -(-size // HEADER_BYTES) * HEADER_BYTES


def chunk_bytes(size: int) -> int:
    """Bytes a chunk with a ``size``-byte payload occupies: header plus payload rounded up to 64."""
    return HEADER_BYTES + round_up(size)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # exists, owned by another user
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return True  # unsure: keeping a dead ring costs memory, removing a live one breaks a server


def _unheld_ring(path: str) -> bool:
    """No live writer holds the ring: every ``ShmRingWriter`` keeps an exclusive ``flock`` on its file
    for its lifetime, which other PID namespaces see too (a container's restarted API process may reuse
    the dead one's pid, often 1)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its writer lives
    finally:
        os.close(fd)  # also drops the lock just taken
    return True


def _orphan(name: str, path: str) -> bool:
    """A ring (tag ``ring-…``) is an orphan when no writer holds its lock. Pids are no proof across
    PID namespaces (API containers sharing one IPC namespace), so any other file (the preprocessing
    pool's transfer files, which live for milliseconds) must also be older than a minute."""
    m = NAME_RE.fullmatch(name)
    if m is None:
        return False
    if name.split(".", 2)[2].startswith(RING_TAG_PREFIX):
        return _unheld_ring(path)
    try:
        age_s = time.time() - os.lstat(path).st_mtime
    except FileNotFoundError:
        return False
    return age_s > ORPHAN_MIN_AGE_S and not _pid_alive(int(m.group(1)))


def remove_orphans(directory: str = SHM_DIR) -> list[str]:
    """Unlink every ``mmserve.<pid>.<tag>`` file left by a dead process (see ``_orphan``); called when a
    server starts and when ``serve`` restarts an API process."""
    removed = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not _orphan(name, path):
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            continue
        removed.append(name)
    return removed


def _tensor_error(tensors: dict[str, ShmTensor], size: int) -> str | None:
    for name, t in tensors.items():
        itemsize = _ITEMSIZE.get(t.dtype)
        if itemsize is None:
            return f"tensor {name!r} has unknown dtype {t.dtype!r}"
        if t.offset < 0 or any(d < 0 for d in t.shape):
            return f"tensor {name!r} has a negative offset or dimension"
        end = t.offset + math.prod(t.shape) * itemsize
        if end > size:
            return f"tensor {name!r} ends at byte {end}, past the {size}-byte payload"
    return None


@dataclass(frozen=True)
class Slot:
    offset: int  # of the chunk (its header) in the ring
    item_id: int
    size: int
    payload: memoryview  # writable, ``size`` bytes: the caller copies the tensors in


@dataclass(frozen=True)
class Allocation:
    slot: Slot | None  # None: does not fit now (too large, or referenced chunks block the head)
    evicted: list[str]  # keys of the chunks freed to make room, oldest first


@dataclass
class _Chunk:
    offset: int
    end: int  # offset + chunk_bytes(size)
    size: int
    key: str
    refcount: int


class ShmRingWriter:
    """The API's ring. Chunks are appended at the tail and freed from the head (FIFO); a chunk whose
    tail room runs out before the ring's end goes to offset 0, skipping the gap."""

    # Invariants (asserted by _check):
    #   I1  _chunks is in allocation order (ascending item_id); each chunk starts 64-aligned, lies
    #       within the ring and starts where the previous one ended, except at most one wrap to 0;
    #       after a wrap the last chunk ends at or before the first one starts (chunks are disjoint)
    #   I2  _tail is the end of the newest chunk, 0 when there is none
    #   I3  refcounts >= 0; a chunk with refcount > 0 is never freed (allocate frees from the head
    #       only while the head's count is 0), so an item a request still needs is never overwritten
    #   I4  _used_bytes == sum of chunk_bytes of the chunks (the wrap gap is not counted)
    #   I5  each chunk's header holds (item_id, size); item_ids are < _next_id and never reused
    def __init__(self, name: str, capacity: int, *, directory: str = SHM_DIR) -> None:
        if not NAME_RE.fullmatch(name):
            raise ValueError(f"ring name {name!r} is not mmserve.<pid>.<tag>")
        if capacity < HEADER_BYTES or capacity % HEADER_BYTES:
            raise ValueError(f"ring capacity {capacity} is not a positive multiple of {HEADER_BYTES}")
        self._name = name
        self._capacity = capacity
        self._path = os.path.join(directory, name)
        # Created locked under a name remove_orphans ignores, then linked to its own name: no other
        # process ever sees the ring without its writer's lock.
        scratch = os.path.join(directory, f".{name}.init")
        fd = os.open(scratch, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, capacity)
            self._mm: mmap.mmap | None = mmap.mmap(fd, capacity)
            os.link(scratch, self._path)  # FileExistsError: the name is taken
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(scratch)
        self._lock_fd: int | None = fd  # held until close: the ring has a live writer
        self._chunks: OrderedDict[int, _Chunk] = OrderedDict()  # item_id -> chunk, oldest first
        self._tail = 0
        self._used_bytes = 0
        self._next_id = 1

    @property
    def name(self) -> str:
        return self._name

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    @property
    def used_bytes(self) -> int:
        """Bytes of the allocated chunks, headers included, the gap skipped by a wrap not included."""
        return self._used_bytes

    def allocate(self, size: int, key: str) -> Allocation:
        """Room for a ``size``-byte payload, freeing unreferenced chunks from the head if needed; frees
        nothing unless the allocation then succeeds. The new chunk holds one count (the caller's)."""
        assert self._mm is not None, "ring closed"
        if size < 0:
            raise ValueError(f"negative size {size}")
        nbytes = chunk_bytes(size)
        if nbytes > self._capacity:
            return Allocation(None, [])
        num_freed = 0
        offset = None
        for chunk in itertools.chain(self._chunks.values(), [None]):
            offset = self._place(nbytes, None if chunk is None else chunk.offset)
            if offset is not None or chunk is None or chunk.refcount > 0:
                break
            num_freed += 1
        if offset is None:
            return Allocation(None, [])
        evicted = [self._free() for _ in range(num_freed)]
        item_id = self._next_id
        self._next_id += 1
        self._chunks[item_id] = _Chunk(offset, offset + nbytes, size, key, refcount=1)
        self._tail = offset + nbytes
        self._used_bytes += nbytes
        self._mm[offset : offset + HEADER_BYTES] = _HEADER.pack(item_id, size).ljust(HEADER_BYTES, b"\0")
        start = offset + HEADER_BYTES
        return Allocation(Slot(offset, item_id, size, memoryview(self._mm)[start : start + size]), evicted)

    def _place(self, nbytes: int, head: int | None) -> int | None:
        """Where a chunk of ``nbytes`` goes if the oldest live chunk starts at ``head`` (None: none)."""
        if head is None:
            return 0
        if self._tail > head:  # not wrapped: free room is [tail, capacity), then [0, head)
            if self._capacity - self._tail >= nbytes:
                return self._tail
            return 0 if head >= nbytes else None
        return self._tail if head - self._tail >= nbytes else None  # wrapped: room is [tail, head)

    def _free(self) -> str:
        assert self._mm is not None
        item_id, chunk = self._chunks.popitem(last=False)
        assert chunk.refcount == 0, f"freeing item {item_id} with {chunk.refcount} references"
        self._mm[chunk.offset : chunk.offset + _HEADER.size] = bytes(_HEADER.size)  # stale from now on
        self._used_bytes -= chunk.end - chunk.offset
        if not self._chunks:
            self._tail = 0
        return chunk.key

    def acquire(self, item_id: int) -> None:
        """One more reference: a request that will read the item (its chunk must still be held)."""
        chunk = self._chunks.get(item_id)
        if chunk is None:
            raise ValueError(f"item {item_id} is not in the ring")
        chunk.refcount += 1

    def release(self, item_id: int) -> None:
        """One fewer reference: the request finished or was aborted, or the allocating caller is done."""
        chunk = self._chunks.get(item_id)
        if chunk is None or chunk.refcount == 0:
            raise ValueError(f"item {item_id} released more often than acquired")
        chunk.refcount -= 1

    def refcount(self, item_id: int) -> int:
        chunk = self._chunks.get(item_id)
        return 0 if chunk is None else chunk.refcount

    def holds(self, item_id: int) -> bool:
        return item_id in self._chunks

    def ref(self, slot: Slot, tensors: dict[str, ShmTensor]) -> ShmItemRef:
        if (error := _tensor_error(tensors, slot.size)) is not None:
            raise ValueError(error)
        return ShmItemRef(self._name, slot.offset, slot.item_id, slot.size, tensors)

    def close(self) -> None:
        """Unlink the ring and unmap it; idempotent. Payload views still held by the caller keep the
        mapping alive until they are released."""
        if self._mm is None:
            return
        mm, self._mm = self._mm, None
        self._chunks.clear()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        with contextlib.suppress(BufferError):
            mm.close()

    def _check(self) -> None:
        assert self._mm is not None
        chunks = list(self._chunks.items())
        assert self._used_bytes == sum(chunk_bytes(c.size) for _, c in chunks)  # I4
        assert self._tail == (chunks[-1][1].end if chunks else 0)  # I2
        for item_id, c in chunks:
            assert c.offset % HEADER_BYTES == 0 and c.offset >= 0 and c.end <= self._capacity  # I1
            assert c.end == c.offset + chunk_bytes(c.size) and c.refcount >= 0  # I3
            assert _HEADER.unpack_from(self._mm, c.offset) == (item_id, c.size) and item_id < self._next_id
        pairs = list(zip(chunks, chunks[1:], strict=False))
        assert all(prev_id < item_id for (prev_id, _), (item_id, _) in pairs)
        wraps = [c for (_, prev), (_, c) in pairs if c.offset != prev.end]
        assert all(c.offset == 0 for c in wraps) and len(wraps) <= 1
        if wraps:
            assert chunks[-1][1].end <= chunks[0][1].offset


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class ShmRingReader:
    """Maps rings by name, read-only, and keeps at most ``max_open`` mapped (least recently used
    unmapped first). Used by the engine (``check``) and the worker (``payload``); never writes."""

    def __init__(self, directory: str = SHM_DIR, *, max_open: int = 64) -> None:
        self._directory = directory
        self._max_open = max_open
        # name -> (mapping, (st_dev, st_ino) of the file mapped): a ring re-created under the same
        # name is mapped again, and the mapping of an unlinked ring is dropped
        self._maps: OrderedDict[str, tuple[mmap.mmap, tuple[int, int]]] = OrderedDict()

    def payload(self, ref: ShmItemRef) -> memoryview:
        """A read-only view of the chunk's ``ref.size`` payload bytes, after checking the header's
        monotonic item_id and size and the tensors' extents. Raises StaleShmRef."""
        mm = self._map(ref.ring)
        if ref.offset < 0 or ref.offset % HEADER_BYTES or ref.offset + HEADER_BYTES > len(mm):
            raise StaleShmRef(f"offset {ref.offset} is misaligned or outside ring {ref.ring}")
        item_id, size = _HEADER.unpack_from(mm, ref.offset)
        if item_id != ref.item_id:
            raise StaleShmRef(f"chunk at {ref.offset} holds item {item_id}, not {ref.item_id}")
        if size != ref.size:
            raise StaleShmRef(f"chunk of item {item_id} holds {size} bytes, not {ref.size}")
        start = ref.offset + HEADER_BYTES
        if start + size > len(mm):
            raise StaleShmRef(f"payload of item {item_id} runs past the end of ring {ref.ring}")
        if (error := _tensor_error(ref.tensors, size)) is not None:
            raise StaleShmRef(error)
        return memoryview(mm)[start : start + size]

    def check(self, ref: ShmItemRef) -> str | None:
        """Why ``ref`` is stale, or None when it is valid (the engine's check on arrival)."""
        try:
            self.payload(ref).release()
        except StaleShmRef as e:
            return str(e)
        return None

    def _map(self, name: str) -> mmap.mmap:
        if not NAME_RE.fullmatch(name):
            raise StaleShmRef(f"invalid ring name {name!r}")
        path = os.path.join(self._directory, name)
        mapped = self._maps.get(name)
        if mapped is not None and mapped[1] == _file_id(path):  # one stat per reference
            self._maps.move_to_end(name)
            return mapped[0]
        # a ring not mapped yet (rare): first drop the mappings of rings unlinked since (an API exited)
        gone = [n for n, (_, fid) in self._maps.items() if fid != _file_id(os.path.join(self._directory, n))]
        for old in gone:
            self._unmap(old)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise StaleShmRef(f"ring {name} cannot be opened: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < HEADER_BYTES:
                raise StaleShmRef(f"ring {name} is not a ring file")
            mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self._maps[name] = (mm, (st.st_dev, st.st_ino))
        while len(self._maps) > self._max_open:
            self._unmap(next(iter(self._maps)))
        return mm

    def _unmap(self, name: str) -> None:
        mm, _ = self._maps.pop(name)
        with contextlib.suppress(BufferError):  # views still exported: unmapped when they are released
            mm.close()

    def close(self) -> None:
        for name in list(self._maps):
            self._unmap(name)
