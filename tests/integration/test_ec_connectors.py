"""Each connector's store with real encoder-output values (workers/ec_codec.py): single-level and
multi-level (deepstack) outputs round-trip exactly, a missing key is None, a truncated or corrupt value
stored under a key is rejected when read back, and two producers writing one key leave one whole value.
The same checks for ``shared-storage`` (a folder) and ``mooncake`` (a real master and holder on
127.0.0.1)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.mooncake_fixtures import MooncakeCluster, mooncake_cluster
from wire.ec_store import ECStore
from wire.ec_store.shared_storage import SharedStorageStore
from workers.ec_codec import CorruptEncoderOutput, decode_output, encode_output

pytestmark = pytest.mark.slow
__all__ = ["mooncake_cluster"]  # the fixture, imported for pytest

HIDDEN = 64


@pytest.fixture(params=["shared-storage", "mooncake"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ECStore]:
    if request.param == "shared-storage":
        yield SharedStorageStore(tmp_path / "ec", max_bytes=1 << 30)
        return
    from wire.ec_store.mooncake import MooncakeStore

    cluster: MooncakeCluster = request.getfixturevalue("mooncake_cluster")
    mooncake = MooncakeStore(cluster.address)
    try:
        yield mooncake
    finally:
        mooncake.close()


def key(request: pytest.FixtureRequest, suffix: str) -> str:
    """A key unique to the test (the Mooncake store is shared by the module's tests)."""
    return f"{request.node.name}-{suffix}".replace("[", "_").replace("]", "_").replace("-", "_")


@pytest.mark.parametrize(
    "shape, dtype",
    [((576, HIDDEN), torch.float32), ((96, 4, HIDDEN), torch.bfloat16)],
    ids=["single-level", "deepstack-levels"],
)
def test_outputs_round_trip_whole(
    store: ECStore, request: pytest.FixtureRequest, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    output = torch.randn(shape).to(dtype)
    mm_hash = key(request, "rt")
    assert store.put(mm_hash, encode_output(mm_hash, output))
    assert store.exists([mm_hash, key(request, "absent")]) == [True, False]
    value = store.get(mm_hash)
    assert value is not None
    loaded = decode_output(mm_hash, value, shape[0], shape[1:])
    assert loaded.dtype == dtype and torch.equal(loaded, output)


def test_a_missing_key_is_none(store: ECStore, request: pytest.FixtureRequest) -> None:
    assert store.get(key(request, "never-put")) is None


@pytest.mark.parametrize("damage", ["truncated", "flipped-byte"])
def test_a_damaged_value_is_rejected_on_read(
    store: ECStore, request: pytest.FixtureRequest, damage: str
) -> None:
    mm_hash = key(request, "bad")
    good = encode_output(mm_hash, torch.randn(16, HIDDEN))
    bad = (
        good[: len(good) // 2] if damage == "truncated" else good[:-7] + bytes([good[-7] ^ 0x55]) + good[-6:]
    )
    assert store.put(mm_hash, bad)  # a store holds bytes; the reader checks them
    value = store.get(mm_hash)
    assert value == bad
    with pytest.raises(CorruptEncoderOutput):
        decode_output(mm_hash, value, 16, (HIDDEN,))


def test_two_producers_of_one_key_leave_one_whole_value(
    store: ECStore, request: pytest.FixtureRequest
) -> None:
    mm_hash = key(request, "twice")
    output = torch.randn(300, HIDDEN)
    value = encode_output(mm_hash, output)  # the same item: both producers encode the same output
    results: list[bool] = []
    writers = [threading.Thread(target=lambda: results.append(store.put(mm_hash, value))) for _ in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(30)
    assert results == [True, True]
    stored = store.get(mm_hash)
    assert stored is not None
    assert torch.equal(decode_output(mm_hash, stored, 300, (HIDDEN,)), output)
