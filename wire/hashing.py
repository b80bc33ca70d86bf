"""mm_hash: the content identity of one multimodal item (docs/architecture.md, "mm_hash").

The hash is blake3 over a framed byte stream::

    bytes(MAGIC)  str(model_id)  str(modality)  bytes(data)  dict(options)           (no cache salt)
    bytes(SALTED) str(model_id)  str(modality)  bytes(data)  dict(options)  str(salt)

A cache salt (docs/architecture.md, "Cache salts and media ids") makes every cache keyed by mm_hash --
processor cache, IPC mirror, shm ring, receiver cache, encoder cache, connector -- see another key for the
same media, so requests with different salts share no hit.

Every value is written as ``tag (1 byte) | length (8 bytes, big-endian) | payload``; containers carry
their element count as length and their elements follow, each framed the same way. The encoding is
prefix-free, so two different inputs never produce the same stream: moving bytes between model_id and
data changes a length prefix, ``"1"`` and ``1`` and ``1.0`` and ``True`` carry different tags, and dict
keys are written in sorted order so the stream does not depend on insertion order.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any, Protocol

import blake3

MAGIC = b"mmserve.mm_hash.v1"
SALTED = b"mmserve.mm_hash.salted.v1"

_TAG_NONE = b"N"
_TAG_BOOL = b"?"
_TAG_INT = b"i"
_TAG_FLOAT = b"f"
_TAG_STR = b"s"
_TAG_BYTES = b"b"
_TAG_LIST = b"l"
_TAG_DICT = b"d"


class _Sink(Protocol):
    """Where frames go: a blake3 hasher (streamed, no copy of the media bytes) or a ``_Buffer``."""

    def update(self, data: bytes, /) -> object: ...


class _Buffer(bytearray):
    update = bytearray.extend


def framed_digest(domain: bytes, *values: Any) -> str:
    """blake3 hex digest of ``values`` framed as above, after a ``domain`` tag that keeps digests made
    for different purposes (mm_hash, model identity) apart."""
    hasher = blake3.blake3()
    _write_all(hasher, domain, values)
    return hasher.hexdigest()


def framed_stream(domain: bytes, *values: Any) -> bytes:
    """The byte stream ``framed_digest`` hashes, whole: for tests of the framing (tests/unit/
    test_hashing_properties.py parses it back into the values, so no two inputs share one)."""
    buffer = _Buffer()
    _write_all(buffer, domain, values)
    return bytes(buffer)


def mm_hash(
    *,
    model_id: str,
    modality: str,
    data: bytes | bytearray | memoryview,
    options: Mapping[str, Any],
    salt: str | None = None,
) -> str:
    """Hex digest identifying the processed result of ``data`` under ``options`` for ``model_id``.

    ``data`` must be the media's original encoded bytes (not the URL, not decoded pixels), so the same
    file sent by URL or as a data URL hashes alike. ``options`` holds every option that can change the
    processed result; values may be None, bool, int, float, str, bytes, lists/tuples and str-keyed
    mappings, nested. Raises TypeError for anything else (an internal bug, not a user error). ``salt``
    (a request's cache scope, ``CacheScope.salt``) gives the same media another key; None is no salt.
    """
    if salt is None:
        return framed_digest(MAGIC, model_id, modality, bytes(data), dict(options))
    return framed_digest(SALTED, model_id, modality, bytes(data), dict(options), salt)


def _write_all(sink: _Sink, domain: bytes, values: tuple[Any, ...]) -> None:
    _frame(sink, _TAG_BYTES, domain)
    for value in values:
        _write(sink, value)


def _frame(sink: _Sink, tag: bytes, payload: bytes) -> None:
    sink.update(tag + struct.pack(">Q", len(payload)))
    sink.update(payload)


def _write(sink: _Sink, value: Any) -> None:
    # bool before int: True is an int in Python but must not hash like 1.
    if value is None:
        _frame(sink, _TAG_NONE, b"")
    elif isinstance(value, bool):
        _frame(sink, _TAG_BOOL, b"\x01" if value else b"\x00")
    elif isinstance(value, int):
        # IntEnum members (e.g. PIL resampling filters) hash as their integer value.
        _frame(sink, _TAG_INT, str(int(value)).encode("ascii"))
    elif isinstance(value, float):
        # One canonical NaN; otherwise the exact IEEE-754 bits (0.0 and -0.0 stay distinct).
        payload = struct.pack(">d", math.nan if math.isnan(value) else value)
        _frame(sink, _TAG_FLOAT, payload)
    elif isinstance(value, str):
        _frame(sink, _TAG_STR, value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, bytes | bytearray | memoryview):
        _frame(sink, _TAG_BYTES, bytes(value))
    elif isinstance(value, list | tuple):
        sink.update(_TAG_LIST + struct.pack(">Q", len(value)))
        for item in value:
            _write(sink, item)
    elif isinstance(value, Mapping):
        keys = list(value)
        if not all(isinstance(key, str) for key in keys):
            raise TypeError(f"mm_hash options need str keys, got {keys!r}")
        sink.update(_TAG_DICT + struct.pack(">Q", len(keys)))
        for key in sorted(keys):
            _write(sink, key)
            _write(sink, value[key])
    else:
        raise TypeError(f"mm_hash cannot encode a value of type {type(value).__name__}: {value!r}")


def canonical_option(value: Any) -> Any:
    """A JSON-shaped copy of a processor option, in the types ``mm_hash`` frames: mappings and
    dataclasses (such as transformers' ``SizeDict``) as str-keyed dicts without None entries, tuples as
    lists, IntEnums as ints. Raises TypeError for anything else."""
    if value is None or isinstance(value, bool | str | float):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, list | tuple):
        return [canonical_option(item) for item in value]
    if isinstance(value, Mapping) or hasattr(value, "__dataclass_fields__"):
        items = value.items() if isinstance(value, Mapping) else vars(value).items()
        return {str(key): canonical_option(item) for key, item in items if item is not None}
    raise TypeError(f"unsupported option value {value!r}")
