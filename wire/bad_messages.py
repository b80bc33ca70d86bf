"""Messages a process cannot take, and what it does with them: count, log once per kind, drop, serve on.

Every socket's receive decodes at its edge (docs/architecture.md, "Bad messages"): a multipart message
whose frame 0 is not a message of the expected union, whose tensor frames do not match its references
(an extra, missing or mis-sized frame), or that the receiver cannot take in its state (a second
``WorkerReady``, a reply for a step not awaited, a request id already in use) raises ``BadMessage``
there. The receiver records it in its ``BadMessageLog`` (``mmserve_bad_messages_total{process,
source}``), answers the request it names with an error where it can, and goes on serving.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from wire.protocol import TensorRef

# bytes per element of every dtype a tensor frame may carry (numpy's spelling, and torch's bfloat16)
WIRE_DTYPE_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
MAX_TENSOR_DIMS = 8


class BadMessage(Exception):
    """A message the receiver cannot take. ``kind`` groups it for the log (one line per kind);
    ``req_id``: the request it names, when it decoded far enough to name one."""

    def __init__(self, kind: str, detail: str, req_id: str | None = None) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
        self.req_id = req_id
        self.bug: Exception | None = None  # the receiver's own error this message ran into

    @classmethod
    def from_bug(cls, exc: Exception, what: str, req_id: str | None = None) -> BadMessage:
        """A message the receiver failed on with an unexpected ``exc`` (a bug it met, logged with its
        traceback): still dropped, so the process serves on."""
        bad = cls(f"could not be taken ({type(exc).__name__})", f"{what}: {exc}", req_id)
        bad.bug = exc
        return bad


def decode_frame0(decode: Any, frames: Sequence[Any]) -> Any:
    """``decode(frames[0])``, or ``BadMessage`` for an empty message, bytes that are not msgpack and
    msgpack that is not a message of the expected union."""
    if not frames:
        raise BadMessage("empty message", "no frames")
    try:
        return decode(frames[0])
    except msgspec.ValidationError as exc:  # msgpack, but an unknown tag, a missing or mistyped field
        raise BadMessage("not a known message", str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise BadMessage("undecodable", str(exc)) from exc


def check_tensor_frames(refs: Iterable[TensorRef], frames: Sequence[Any], req_id: str | None = None) -> None:
    """The message's tensor frames are exactly frames 1..n, each referenced once, each holding the bytes
    its dtype and shape need; else ``BadMessage`` naming ``req_id``."""
    seen: set[int] = set()
    for ref in refs:
        if not 0 < ref.frame < len(frames):
            raise BadMessage("missing frame", f"frame {ref.frame} of {len(frames)}", req_id)
        if ref.frame in seen:
            raise BadMessage("frame referenced twice", f"frame {ref.frame}", req_id)
        seen.add(ref.frame)
        itemsize = WIRE_DTYPE_SIZES.get(ref.dtype)
        if itemsize is None:
            raise BadMessage("unknown dtype", repr(ref.dtype), req_id)
        if len(ref.shape) > MAX_TENSOR_DIMS or any(dim < 0 for dim in ref.shape):
            raise BadMessage("bad shape", repr(ref.shape), req_id)
        numel = 1
        for dim in ref.shape:
            numel *= dim
        nbytes = memoryview(frames[ref.frame]).nbytes
        if nbytes != numel * itemsize:
            raise BadMessage(
                "frame size", f"frame {ref.frame} holds {nbytes} bytes, {ref.shape} {ref.dtype}", req_id
            )
    if len(seen) != len(frames) - 1:
        raise BadMessage("extra frame", f"{len(frames) - 1 - len(seen)} unreferenced", req_id)


class BadMessageLog:
    """One process's bad messages: counted by the sender's role; the first of each kind logged (with
    its detail), later ones only counted, so a flood of garbage cannot flood the log."""

    def __init__(self, logger: logging.Logger) -> None:
        self.counts: Counter[str] = Counter()  # source role -> messages dropped
        self._logged: set[tuple[str, str]] = set()
        self._log = logger

    def record(self, source: str, bad: BadMessage) -> None:
        """Counts ``bad``, from a peer of role ``source``; logs it if it is the first of its kind (with
        the traceback of the bug it met, if any)."""
        self.counts[source] += 1
        if (source, bad.kind) not in self._logged:
            self._logged.add((source, bad.kind))
            self._log.warning(
                "dropped a bad message from the %s (%s; further ones of this kind are only counted in "
                "mmserve_bad_messages_total): %s",
                source,
                bad.kind,
                bad.detail[:300],
                exc_info=bad.bug,
            )
