"""EngineClient.send_request: the mirror's record -> send -> unpin step in one call (docs/architecture.md,
"IPC mirror"): what each item's decision puts on the wire, the evicted keys, pins released whether the
request was sent or not, and nothing sent when a pinned hit has left the mirror. No engine: the socket's
send is replaced by a list."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from app.inputs.engine_client import EngineClient, EngineGone, OutgoingItem
from app.metrics import ApiMetrics
from wire.protocol import (
    AddRequest,
    Constraint,
    ConstraintKind,
    EngineReady,
    MMFeature,
    ResetCaches,
    SamplingParams,
    ShmItemRef,
)
from workers.families.processing import ItemLayout, ProcessedItem

ITEM = ProcessedItem(
    {"pixel_values": torch.arange(48, dtype=torch.float32).reshape(1, 3, 4, 4)}, ItemLayout(16)
)
READY = EngineReady(epoch="e1")
SAMPLING = SamplingParams(max_tokens=4)


class Client:
    """An EngineClient whose socket is a list of (message, frames)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.engine = EngineClient("ipc:///nonexistent/engine.sock", capacity_bytes, ApiMetrics())
        self.engine.ready = READY
        self.sent: list[tuple[Any, list[memoryview]]] = []
        self.engine._send = self._send  # type: ignore[method-assign]

    def _send(self, msg: Any, frames: Sequence[memoryview] = (), encoded: bytes | None = None) -> None:
        self.sent.append((msg, list(frames)))  # the tensor frames: frames[0] is the message's frame 1

    def send(self, req_id: str, *items: OutgoingItem) -> asyncio.Queue[Any] | None:
        return self.engine.send_request(req_id, [1, 2, 3], SAMPLING, list(items))

    def last_request(self) -> tuple[AddRequest, list[memoryview]]:
        msg, frames = self.sent[-1]
        assert isinstance(msg, AddRequest)
        return msg, frames

    @property
    def pins(self) -> dict[str, int]:
        return self.engine._mirror._pins

    def close(self) -> None:
        self.engine._sock.close(linger=0)
        self.engine._ctx.term()


@pytest.fixture
def client() -> Iterator[Client]:
    made = Client(capacity_bytes=ITEM.num_bytes)
    yield made
    made.close()


def placement(mm_hash: str, offset: int = 3, **fields: Any) -> MMFeature:
    return MMFeature(mm_hash, offset, ITEM.num_tokens, **fields)


def test_a_new_item_is_stored_then_sent_as_its_key_only(client: Client) -> None:
    assert client.send("r1", OutgoingItem(placement("h1"), ITEM.layout, ITEM, pinned=False)) is not None
    msg, frames = client.last_request()
    [feature] = msg.mm_features
    assert feature.store and feature.tensors is not None and feature.tensors["pixel_values"].frame == 1
    assert bytes(frames[0]) == ITEM.tensors["pixel_values"].numpy().tobytes()
    assert msg.prompt_token_ids == [1, 2, 3] and msg.evicted_mm_hashes == []

    entry = client.engine.lookup_and_pin("h1")
    assert entry is not None and entry.layout == ITEM.layout and client.pins == {"h1": 1}
    assert client.send("r2", OutgoingItem(placement("h1"), ITEM.layout, None, pinned=True)) is not None
    msg, frames = client.last_request()
    assert msg.mm_features == [placement("h1")] and frames == []  # the key only
    assert client.pins == {}  # released in the same call
    payload = client.engine.metrics.ipc_payload_bytes._value.get()
    assert payload == 2 * len("h1") + ITEM.num_bytes  # keys count too


def test_a_pinned_hit_that_left_the_mirror_sends_nothing_and_is_unpinned(client: Client) -> None:
    client.send("r1", OutgoingItem(placement("h1"), ITEM.layout, ITEM, pinned=False))
    assert client.engine.lookup_and_pin("h1") is not None
    client.engine.reset_caches()  # ordered on the socket: the engine forgets it too
    assert isinstance(client.sent[-1][0], ResetCaches)
    num_sent = len(client.sent)
    assert client.send("r2", OutgoingItem(placement("h1"), ITEM.layout, None, pinned=True)) is None
    assert len(client.sent) == num_sent and client.pins == {}
    # with its tensors at hand the same item is sent (and stored again)
    assert client.send("r2", OutgoingItem(placement("h1"), ITEM.layout, ITEM, pinned=False)) is not None
    assert client.last_request()[0].mm_features[0].store


def test_evictions_travel_with_the_request_that_caused_them(client: Client) -> None:
    client.send("r1", OutgoingItem(placement("h1"), ITEM.layout, ITEM, pinned=False))
    client.send("r2", OutgoingItem(placement("h2"), ITEM.layout, ITEM, pinned=False))
    msg, _ = client.last_request()
    assert msg.evicted_mm_hashes == ["h1"] and msg.mm_features[0].store


def test_a_pinned_entry_is_never_the_victim(client: Client) -> None:
    client.send("r1", OutgoingItem(placement("h1"), ITEM.layout, ITEM, pinned=False))
    assert client.engine.lookup_and_pin("h1") is not None  # another request is preparing with it
    client.send("r2", OutgoingItem(placement("h2"), ITEM.layout, ITEM, pinned=False))
    msg, frames = client.last_request()
    assert msg.evicted_mm_hashes == [] and not msg.mm_features[0].store and len(frames) == 1  # UNCACHED
    client.engine.unpin("h1")
    assert client.pins == {}


def test_two_items_number_their_frames_in_order(client: Client) -> None:
    big = Client(capacity_bytes=0)  # nothing cached: both items UNCACHED
    try:
        big.send(
            "r1",
            OutgoingItem(placement("a", 1), ITEM.layout, ITEM, False),
            OutgoingItem(placement("b", 20), ITEM.layout, ITEM, False),
        )
        msg, frames = big.last_request()
        assert [f.tensors["pixel_values"].frame for f in msg.mm_features if f.tensors] == [1, 2]
        assert [f.store for f in msg.mm_features] == [False, False] and len(frames) == 2
    finally:
        big.close()


def test_shm_items_bypass_the_mirror(client: Client) -> None:
    ref = ShmItemRef(ring="mmserve.1.ring-ab", offset=0, item_id=1, size=64, tensors={})
    assert (
        client.send("r1", OutgoingItem(placement("h1", shm=ref), ITEM.layout, None, pinned=False)) is not None
    )
    msg, frames = client.last_request()
    assert msg.mm_features == [placement("h1", shm=ref)] and frames == []
    assert "h1" not in client.engine._mirror


def test_forget_drops_keys_the_engine_lacks(client: Client) -> None:
    client.send("r1", OutgoingItem(placement("h1"), ITEM.layout, ITEM, pinned=False))
    client.engine.forget(["h1", "unknown"])
    assert client.engine.lookup_and_pin("h1") is None


def test_not_ready_answers_engine_gone_and_still_unpins(client: Client) -> None:
    client.send("r1", OutgoingItem(placement("h1"), ITEM.layout, ITEM, pinned=False))
    assert client.engine.lookup_and_pin("h1") is not None
    client.engine.ready = None
    num_sent = len(client.sent)
    queue = client.send("r2", OutgoingItem(placement("h1"), ITEM.layout, None, pinned=True))
    assert queue is not None and isinstance(queue.get_nowait(), EngineGone)
    assert len(client.sent) == num_sent and client.pins == {}


def test_a_request_that_cannot_be_encoded_leaves_nothing_behind(client: Client) -> None:
    """A string that is no Unicode text (a lone surrogate) fails the encoder: the call raises before the
    request's queue is registered, and its pins are released all the same."""
    entry = client.send("r1", OutgoingItem(placement("h1"), ITEM.layout, ITEM, pinned=False))
    assert entry is not None and client.engine.lookup_and_pin("h1") is not None
    unencodable = Constraint(ConstraintKind.REGEX, "a\ud800")
    with pytest.raises(UnicodeEncodeError):
        client.engine.send_request(
            "r2",
            [1, 2, 3],
            SAMPLING,
            [OutgoingItem(placement("h1"), ITEM.layout, None, pinned=True)],
            constraint=unencodable,
        )
    assert "r2" not in client.engine._queues and client.pins == {}
