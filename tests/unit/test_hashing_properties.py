"""Properties of the mm_hash framing: the framed stream is injective.

The proof is a parser: ``parse`` reads a stream back into a typed description of the values that made
it, and the properties check ``parse(framed_stream(v)) == key(v)`` for generated ``v``. A stream with
a left inverse cannot be shared by two inputs with different keys. ``key`` is what the framing promises
to tell apart: types (``"1"``, ``1``, ``1.0``, ``True``, ``b"1"``), float bits (``0.0`` vs ``-0.0``;
all NaNs are one), structure; and what it promises to merge: list vs tuple, dict insertion order.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.hashing import MAGIC, framed_digest, framed_stream, mm_hash

Key = tuple[Any, ...]


def key(value: Any) -> Key:
    """The identity the framing must preserve, with Python's ``True == 1 == 1.0`` taken apart."""
    if value is None:
        return ("none",)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return ("float", struct.pack(">d", math.nan if math.isnan(value) else value))
    if isinstance(value, str):
        return ("str", value)
    if isinstance(value, bytes | bytearray):
        return ("bytes", bytes(value))
    if isinstance(value, list | tuple):
        return ("list", tuple(key(item) for item in value))
    assert isinstance(value, dict)
    return ("dict", tuple(sorted((k, key(v)) for k, v in value.items())))


def parse(stream: bytes) -> list[Key]:
    """The keys of the values framed in ``stream`` (domain first); fails unless it is read exactly."""
    pos = 0

    def header() -> tuple[bytes, int]:
        nonlocal pos
        tag, length = stream[pos : pos + 1], struct.unpack_from(">Q", stream, pos + 1)[0]
        pos += 9
        return tag, length

    def payload(length: int) -> bytes:
        nonlocal pos
        assert pos + length <= len(stream)
        pos += length
        return stream[pos - length : pos]

    def value() -> Key:
        tag, length = header()
        if tag == b"l":
            return ("list", tuple(value() for _ in range(length)))
        if tag == b"d":
            items = []
            for _ in range(length):
                name = value()
                assert name[0] == "str"
                items.append((name[1], value()))
            assert [k for k, _ in items] == sorted(k for k, _ in items)
            return ("dict", tuple(items))
        body = payload(length)
        if tag == b"N":
            assert body == b""
            return ("none",)
        if tag == b"?":
            assert body in (b"\0", b"\1")
            return ("bool", body == b"\1")
        if tag == b"i":
            return ("int", int(body.decode("ascii")))
        if tag == b"f":
            assert length == 8
            return ("float", body)
        if tag == b"s":
            return ("str", body.decode("utf-8", "surrogatepass"))
        assert tag == b"b", tag
        return ("bytes", body)

    keys = []
    while pos < len(stream):
        keys.append(value())
    assert pos == len(stream)
    return keys


def stream_of(model_id: str, modality: str, data: bytes, options: dict[str, Any]) -> bytes:
    return framed_stream(MAGIC, model_id, modality, data, options)


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6)
    | st.binary(max_size=6)
)
options_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=10,
)
options = st.dictionaries(st.text(max_size=6), options_values, max_size=4)
# Small alphabets, so that two draws are often close: equal keys, one byte apart, prefixes.
items = st.tuples(
    st.text(alphabet="ab:1", max_size=4),
    st.sampled_from(["image", "video", "", "imag"]),
    st.binary(max_size=4),
    options,
)


@settings(max_examples=400, deadline=None)
@given(items)
def test_the_stream_parses_back_into_its_values(item: tuple[str, str, bytes, dict[str, Any]]) -> None:
    model_id, modality, data, opts = item
    stream = stream_of(model_id, modality, data, opts)
    assert parse(stream) == [("bytes", MAGIC), key(model_id), key(modality), key(data), key(opts)]
    assert mm_hash(model_id=model_id, modality=modality, data=data, options=opts) == (
        blake3.blake3(stream).hexdigest()
    )


@settings(max_examples=400, deadline=None)
@given(items, items)
def test_streams_differ_exactly_when_the_values_differ(
    left: tuple[str, str, bytes, dict[str, Any]], right: tuple[str, str, bytes, dict[str, Any]]
) -> None:
    same_values = [key(v) for v in left] == [key(v) for v in right]
    assert (stream_of(*left) == stream_of(*right)) == same_values


@settings(max_examples=300, deadline=None)
# Alphabets that hold the tag bytes ("s", "b"), so that a framing without lengths would collide.
@given(
    st.text(alphabet="ms", max_size=8), st.binary(max_size=8) | st.sampled_from([b"bs", b"sbx"]), st.data()
)
def test_moving_bytes_between_fields_changes_the_stream(text: str, blob: bytes, data: st.DataObject) -> None:
    # Naive concatenation would make each pair below one stream.
    i, j = (data.draw(st.integers(0, len(text)), label="text split") for _ in range(2))
    k, m = (data.draw(st.integers(0, len(blob)), label="bytes split") for _ in range(2))
    if i != j:
        assert stream_of(text[:i], text[i:], b"", {}) != stream_of(text[:j], text[j:], b"", {})
    if k != m:
        first = stream_of("m", "image", blob[:k], {"x": blob[k:]})
        second = stream_of("m", "image", blob[:m], {"x": blob[m:]})
        assert first != second


@settings(max_examples=200, deadline=None)
@given(options)
def test_insertion_order_and_tuple_spelling_do_not_matter(opts: dict[str, Any]) -> None:
    def respell(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: respell(value[k]) for k in reversed(list(value))}
        if isinstance(value, list | tuple):
            return (
                [respell(item) for item in value] if isinstance(value, tuple) else tuple(map(respell, value))
            )
        return value

    assert stream_of("m", "image", b"x", opts) == stream_of("m", "image", b"x", respell(opts))


FRAMES_AFTER_MODALITY = stream_of("m", "image", b"", {"k": 1})[len(framed_stream(MAGIC, "m", "image")) :]


def test_adversarial_pairs() -> None:
    pairs = [
        # data=b"ab" vs data=b"a" with the "b" moved into the options
        (("m", "image", b"ab", {}), ("m", "image", b"a", {"b": None})),
        (("m", "image", b"ab", {}), ("m", "image", b"a", {"": b"b"})),
        # bytes moved between model_id and modality
        (("mi", "mage", b"", {}), ("m", "image", b"", {})),
        (("m", "image", b"", {}), ("", "mimage", b"", {})),
        (("m", "sm", b"", {}), ("ms", "m", b"", {})),  # "s" is the str tag: without lengths, one stream
        # data that spells the frames following it in another stream
        (("m", "image", b"", {"k": 1}), ("m", "image", FRAMES_AFTER_MODALITY, {})),
        (("m", "image", b"", {"a": "b"}), ("m", "image", b"", {"a": ["b"]})),
        (("m", "image", b"", {"a": {"b": 1}}), ("m", "image", b"", {"a.b": 1})),
        (("m", "image", b"", {"a": [[1], 2]}), ("m", "image", b"", {"a": [1, [2]]})),
        (("m", "image", b"", {"a": 1}), ("m", "image", b"", {"a": True})),
        (("m", "image", b"", {"a": 1}), ("m", "image", b"", {"a": 1.0})),
        (("m", "image", b"", {"a": "1"}), ("m", "image", b"", {"a": b"1"})),
        (("m", "image", b"", {"a": 0.0}), ("m", "image", b"", {"a": -0.0})),
        (("m", "image", b"", {"a": None}), ("m", "image", b"", {})),
    ]
    for left, right in pairs:
        assert stream_of(*left) != stream_of(*right), (left, right)
        assert mm_hash(model_id=left[0], modality=left[1], data=left[2], options=left[3]) != mm_hash(
            model_id=right[0], modality=right[1], data=right[2], options=right[3]
        )


def test_domains_keep_digests_apart() -> None:
    assert framed_digest(b"a", "b") != framed_digest(b"ab") != framed_digest(b"", "ab")
    assert framed_stream(b"a", "b") != framed_stream(b"ab")
