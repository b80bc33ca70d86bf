"""The edges where messages are decoded (wire/bad_messages.py, engine/api_messages.py): every kind of
bad message becomes a ``BadMessage`` of its own kind before anything is applied, naming the request
when it decoded far enough; the engine core refuses a request id already held and token ids past the
worker's vocabulary; the log counts every one and writes one line per kind."""

from __future__ import annotations

import logging

import msgspec
import pytest

from engine.api_messages import decode_api_message
from tests.unit.engine_core_support import PIXELS, engine_core, frames
from wire.bad_messages import BadMessage, BadMessageLog, check_tensor_frames
from wire.protocol import (
    INT64_MAX,
    AddRequest,
    Hello,
    MMFeature,
    SamplingParams,
    TensorRef,
    encode,
)


def add_request(
    req_id: str = "r1", features: list[MMFeature] | None = None, **sampling: object
) -> AddRequest:
    params = SamplingParams(**{"max_tokens": 4, **sampling})  # type: ignore[arg-type]
    return AddRequest(req_id, list(range(1, 21)), params, features or [])


def kind_of(parts: list[bytes]) -> tuple[str, str | None]:
    with pytest.raises(BadMessage) as bad:
        decode_api_message([memoryview(p) for p in parts])
    return bad.value.kind, bad.value.req_id


def test_garbage_of_each_kind_has_its_kind() -> None:
    hello = encode(Hello())
    assert kind_of([]) == ("empty message", None)
    assert kind_of([b""]) == ("undecodable", None)
    assert kind_of([b"\xc1\xc1\xc1"]) == ("undecodable", None)
    assert kind_of([encode(add_request())[:30]]) == ("undecodable", None)
    assert kind_of([msgspec.msgpack.encode({"type": "nonsense"})]) == ("not a known message", None)
    assert kind_of([msgspec.msgpack.encode([1, 2, 3])]) == ("not a known message", None)
    assert kind_of([hello, b"extra"]) == ("extra frame", None)


@pytest.mark.parametrize(
    "sampling",
    [
        {"max_tokens": 0},
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_k": 0},
        {"seed": INT64_MAX + 1},
        {"num_top_logprobs": 21},
        {"eos_token_ids": (-1,)},
    ],
)
def test_out_of_bounds_values_do_not_decode(sampling: dict[str, object]) -> None:
    raw = msgspec.to_builtins(add_request())
    raw["sampling"].update(sampling)
    assert kind_of([msgspec.msgpack.encode({"type": "add", **raw})])[0] == "not a known message"


def test_negative_token_ids_and_empty_prompts_do_not_decode() -> None:
    for prompt in ([], [-1, 2]):
        raw = {**msgspec.to_builtins(add_request()), "prompt_token_ids": prompt}
        assert kind_of([msgspec.msgpack.encode({"type": "add", **raw})])[0] == "not a known message"


def test_tensor_frames_must_match_their_references() -> None:
    feature = MMFeature("h1", 2, 4, tensors=PIXELS)
    msg = encode(add_request(features=[feature]))
    pixels = bytes(192)
    assert decode_api_message([memoryview(msg), memoryview(pixels)]) == add_request(features=[feature])
    assert kind_of([msg]) == ("missing frame", "r1")
    assert kind_of([msg, pixels, b"x"]) == ("extra frame", "r1")
    assert kind_of([msg, pixels[:-4]]) == ("frame size", "r1")
    twice = MMFeature("h2", 8, 4, tensors=PIXELS)
    assert kind_of([encode(add_request(features=[feature, twice])), pixels]) == (
        "frame referenced twice",
        "r1",
    )
    odd = MMFeature("h1", 2, 4, tensors={"pixel_values": TensorRef("complex64", (4,), 1)})
    assert kind_of([encode(add_request(features=[odd])), bytes(32)]) == ("unknown dtype", "r1")


def test_placeholders_lie_inside_the_prompt_in_order() -> None:
    late = MMFeature("h1", 18, 4)  # past the 20 prompt tokens
    assert kind_of([encode(add_request(features=[late]))]) == ("placeholders past the prompt", "r1")
    first, overlapping = MMFeature("h1", 2, 4), MMFeature("h2", 4, 4)
    assert kind_of([encode(add_request(features=[first, overlapping]))])[0] == "placeholders out of order"


def test_check_tensor_frames_takes_exactly_the_referenced_frames() -> None:
    refs = [TensorRef("uint8", (3,), 2), TensorRef("int64", (1,), 1)]
    check_tensor_frames(refs, [b"msg", bytes(8), bytes(3)])
    with pytest.raises(BadMessage, match="bad shape"):
        check_tensor_frames([TensorRef("uint8", (-3,), 1)], [b"msg", b""])


def test_the_core_refuses_a_request_id_it_holds_and_tokens_past_the_vocabulary() -> None:
    core, _ = engine_core()
    core.add_request(b"api-1", add_request("r1"), frames()[:1])
    with pytest.raises(BadMessage) as held:
        core.add_request(b"api-2", add_request("r1"), frames()[:1])
    assert held.value.kind == "request id in use" and held.value.req_id is None  # that id is another's
    core.vocab_size = 10
    with pytest.raises(BadMessage) as vocab:
        core.add_request(b"api-1", add_request("r2"), frames()[:1])
    assert vocab.value.kind == "token id out of range" and vocab.value.req_id == "r2"
    assert list(core.scheduler.requests) == ["r1"]


def test_the_log_counts_each_message_and_writes_one_line_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    log = BadMessageLog(logging.getLogger("test.bad"))
    with caplog.at_level(logging.WARNING, logger="test.bad"):
        for _ in range(3):
            log.record("api", BadMessage("undecodable", "junk"))
        log.record("api", BadMessage("extra frame", "2 frames"))
        log.record("worker", BadMessage("undecodable", "junk"))
        try:
            raise KeyError("bug")
        except KeyError as exc:
            log.record("api", BadMessage.from_bug(exc, "Abort(...)"))
    assert log.counts == {"api": 5, "worker": 1}
    lines = [r for r in caplog.records if "dropped a bad message" in r.getMessage()]
    assert len(lines) == 4
    assert [r.exc_info is not None and r.exc_info[0] is not None for r in lines] == [
        False,
        False,
        False,
        True,
    ]
