"""mm_hash: deterministic, and no two different inputs share a framed stream."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import pytest

from app.inputs.known_data_urls import KnownDataUrls
from wire.hashing import canonical_option, framed_digest, mm_hash

DATA = b"\x89PNG fake image bytes"


def h(model_id: str = "llava:abc", modality: str = "image", data: bytes = DATA, **options: Any) -> str:
    return mm_hash(model_id=model_id, modality=modality, data=data, options=options)


def test_hex_digest_and_deterministic() -> None:
    digest = h(do_normalize=False)
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert h(do_normalize=False) == digest
    assert mm_hash(model_id="llava:abc", modality="image", data=bytearray(DATA), options={}) == h()


def test_same_bytes_same_hash_different_bytes_different_hash() -> None:
    assert h(data=bytes(DATA)) == h(data=DATA)
    assert h(data=DATA + b"\x00") != h(data=DATA)


def test_option_key_order_does_not_matter() -> None:
    first = mm_hash(model_id="m", modality="image", data=DATA, options={"a": 1, "b": {"x": 1, "y": 2}})
    second = mm_hash(model_id="m", modality="image", data=DATA, options={"b": {"y": 2, "x": 1}, "a": 1})
    assert first == second


def test_different_kwargs_different_hash() -> None:
    assert h() != h(do_normalize=False)
    assert h(do_normalize=False) != h(do_normalize=True)
    assert h(resample=2) != h(resample=3)
    assert h(size={"shortest_edge": 336}) != h(size={"shortest_edge": 337})


@pytest.mark.parametrize(
    ("left", "right"),
    [
        ({"a": "1"}, {"a": 1}),
        ({"a": 1}, {"a": 1.0}),
        ({"a": 1}, {"a": True}),
        ({"a": 0}, {"a": False}),
        ({"a": 0.0}, {"a": -0.0}),
        ({"a": None}, {}),
        ({"a": None}, {"a": ""}),
        ({"a": ""}, {"a": b""}),
        ({"a": []}, {"a": {}}),
        ({"a": [1, [2]]}, {"a": [[1], 2]}),
        ({"a": [1, 2]}, {"a": [12]}),
        ({"a": ["1", "2"]}, {"a": ["12"]}),
        ({"a": {"b": 1}}, {"a.b": 1}),
        ({"ab": "c"}, {"a": "bc"}),
        ({"a": "b", "c": "d"}, {"a": "bcd"}),
    ],
)
def test_options_framing_is_unambiguous(left: dict[str, Any], right: dict[str, Any]) -> None:
    assert h(**left) != h(**right)


def test_field_boundaries_cannot_shift() -> None:
    # Bytes moved between neighbouring fields change the length prefixes, hence the hash.
    assert h(model_id="ab", data=b"c") != h(model_id="a", data=b"bc")
    assert h(model_id="llava:x", modality="image") != h(model_id="llava:", modality="ximage")
    assert h(modality="image", data=b"x") != h(modality="imagex", data=b"")
    assert h(model_id="m1") != h(model_id="m2")


def test_modality_is_part_of_the_hash() -> None:
    assert h(modality="image") != h(modality="video")


def test_unsupported_values_raise() -> None:
    with pytest.raises(TypeError):
        mm_hash(model_id="m", modality="image", data=DATA, options={"a": object()})
    with pytest.raises(TypeError):
        mm_hash(model_id="m", modality="image", data=DATA, options={"a": {1: "x"}})


def test_framed_digest_domains_are_separate() -> None:
    assert framed_digest(b"one", "x") != framed_digest(b"two", "x")
    assert framed_digest(b"d", "x", "y") != framed_digest(b"d", "xy")


class _Resample(enum.IntEnum):
    BICUBIC = 3


@dataclass
class _SizeDict:
    height: int | None = None
    width: int | None = None
    shortest_edge: int | None = None


def test_canonical_option() -> None:
    assert canonical_option((0.5, 0.5)) == [0.5, 0.5]
    assert type(canonical_option(_Resample.BICUBIC)) is int
    assert canonical_option(_SizeDict(shortest_edge=336)) == {"shortest_edge": 336}
    assert canonical_option({"height": 2, "width": None}) == {"height": 2}
    assert canonical_option(True) is True
    with pytest.raises(TypeError):
        canonical_option(object())


def test_known_data_urls_key_on_the_url_text_and_everything_the_mm_hash_covers() -> None:
    def key(url: str = "data:image/png;base64,AAAA", model_id: str = "m", **options: Any) -> str:
        return KnownDataUrls.key(model_id=model_id, modality="image", url=url, options=options)

    assert key() == key()
    assert (
        len({key(), key(url="data:image/png;base64, AAAA"), key(model_id="n"), key(do_normalize=False)}) == 4
    )
    assert key() != h()  # its own domain: never mistaken for an mm_hash


def test_known_data_urls_are_an_lru_bounded_in_entries() -> None:
    known = KnownDataUrls(max_entries=2)
    known.put("a", "hash-a", 1)
    known.put("b", "hash-b", 2)
    assert known.get("a") == ("hash-a", 1)  # now the most recently used
    known.put("c", "hash-c", 3)
    assert len(known) == 2 and known.get("b") is None
    assert known.get("a") == ("hash-a", 1) and known.get("c") == ("hash-c", 3)
