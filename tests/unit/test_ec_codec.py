"""The encoder-cache value format (workers/ec_codec.py): an encoder output round-trips bit for bit in its
own dtype and shape, and anything that is not this item's complete, intact output (truncated, a bit
flipped, another item's value, the wrong shape or dtype, extra tensors, garbage) is refused with
``CorruptEncoderOutput``, never returned as an embedding."""

from __future__ import annotations

import blake3
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from workers.ec_codec import FORMAT, CorruptEncoderOutput, decode_output, encode_output

MM_HASH = "3f2a" * 16
NUM_TOKENS, LEVELS, HIDDEN = 6, 3, 8


def output(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def crafted(tensors: dict[str, torch.Tensor], mm_hash: str = MM_HASH) -> bytes:
    """A value with well-formed metadata (format, key, digest of ``output`` or the first tensor) around
    whatever tensors a producer could have written."""
    digest_of = tensors.get("output", next(iter(tensors.values())))
    digest = blake3.blake3(digest_of.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    return save(tensors, metadata={"format": FORMAT, "mm_hash": mm_hash, "digest": digest})


VALUE = encode_output(MM_HASH, output((NUM_TOKENS, HIDDEN)))  # what the property tests damage


def assert_refused(
    value: bytes, mm_hash: str = MM_HASH, num_tokens: int = NUM_TOKENS, tail=(HIDDEN,)
) -> None:
    with pytest.raises(CorruptEncoderOutput):
        decode_output(mm_hash, value, num_tokens, tail)


# ---------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(NUM_TOKENS, HIDDEN), (NUM_TOKENS, LEVELS, HIDDEN)], ids=["2d", "levels"])
def test_round_trip_is_exact_in_the_stored_dtype(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    original = output(shape, dtype)
    decoded = decode_output(MM_HASH, encode_output(MM_HASH, original), NUM_TOKENS, shape[1:])
    assert decoded.dtype == dtype and decoded.device.type == "cpu"
    assert tuple(decoded.shape) == shape
    assert torch.equal(decoded.view(torch.uint8), original.view(torch.uint8))  # bit for bit (NaN-safe)


def test_a_non_contiguous_output_is_stored_in_its_logical_order() -> None:
    original = output((HIDDEN, NUM_TOKENS)).t()  # a transposed view
    assert not original.is_contiguous()
    decoded = decode_output(MM_HASH, encode_output(MM_HASH, original), NUM_TOKENS, (HIDDEN,))
    assert torch.equal(decoded, original)


# ---------------------------------------------------------------------------- refused values


@pytest.mark.parametrize("cut", [0, 1, 7, 8, 9, 40, -200, -1])
def test_truncated_values_are_refused(cut: int) -> None:
    assert_refused(VALUE[:cut])  # inside the length field, the header and the data


def test_a_flipped_data_byte_is_refused() -> None:
    damaged = bytearray(VALUE)
    damaged[-5] ^= 0x01  # the last tensor bytes: the header still parses
    assert_refused(bytes(damaged))


def test_a_value_written_for_another_item_is_refused() -> None:
    other = encode_output("b" * 64, output((NUM_TOKENS, HIDDEN)))
    with pytest.raises(CorruptEncoderOutput, match="not this item's"):
        decode_output(MM_HASH, other, NUM_TOKENS, (HIDDEN,))


@pytest.mark.parametrize("num_tokens", [NUM_TOKENS - 1, NUM_TOKENS + 1, 0])
def test_a_value_with_another_number_of_tokens_is_refused(num_tokens: int) -> None:
    with pytest.raises(CorruptEncoderOutput, match="shape"):
        decode_output(MM_HASH, VALUE, num_tokens, (HIDDEN,))


@pytest.mark.parametrize("tail", [(HIDDEN * 2,), (LEVELS, HIDDEN), ()])
def test_a_value_with_another_tail_is_refused(tail: tuple[int, ...]) -> None:
    assert_refused(VALUE, tail=tail)


def test_a_value_with_levels_read_by_a_model_without_them_is_refused() -> None:
    value = encode_output(MM_HASH, output((NUM_TOKENS, LEVELS, HIDDEN)))
    assert_refused(value, tail=(HIDDEN,))
    assert_refused(value, tail=(LEVELS + 1, HIDDEN))


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.bool, torch.int64])
def test_a_non_float_output_is_refused(dtype: torch.dtype) -> None:
    value = crafted({"output": torch.ones(NUM_TOKENS, HIDDEN, dtype=dtype)})
    with pytest.raises(CorruptEncoderOutput, match="dtype"):
        decode_output(MM_HASH, value, NUM_TOKENS, (HIDDEN,))


def test_crafted_values_pass_when_well_formed() -> None:
    """The helper above writes values the reader accepts: the refusals around it are about one defect."""
    original = output((NUM_TOKENS, HIDDEN))
    assert torch.equal(decode_output(MM_HASH, crafted({"output": original}), NUM_TOKENS, (HIDDEN,)), original)


def test_extra_tensors_are_refused() -> None:
    tensors = {"output": output((NUM_TOKENS, HIDDEN)), "extra": output((2, HIDDEN), seed=1)}
    with pytest.raises(CorruptEncoderOutput, match="unexpected tensors"):
        decode_output(MM_HASH, crafted(tensors), NUM_TOKENS, (HIDDEN,))


def test_a_value_without_an_output_tensor_is_refused() -> None:
    assert_refused(crafted({"embeddings": output((NUM_TOKENS, HIDDEN))}))


@pytest.mark.parametrize(
    "metadata",
    [
        {},
        {"format": "mmserve-ec-0", "mm_hash": MM_HASH},
        {"format": FORMAT, "mm_hash": MM_HASH},  # no digest
        {"format": FORMAT, "mm_hash": MM_HASH, "digest": "0" * 64},
    ],
    ids=["none", "old-format", "no-digest", "wrong-digest"],
)
def test_values_with_bad_metadata_are_refused(metadata: dict[str, str]) -> None:
    assert_refused(save({"output": output((NUM_TOKENS, HIDDEN))}, metadata=metadata or None))


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"\x00" * 8,
        b"garbage bytes, not safetensors",
        b"\xff" * 64,
        (16).to_bytes(8, "little") + b"{" * 16,
    ],
    ids=["empty", "zero-header", "text", "huge-header", "bad-json"],
)
def test_garbage_is_refused(value: bytes) -> None:
    assert_refused(value)


@settings(max_examples=80, deadline=None)
@given(cut=st.integers(min_value=0, max_value=len(VALUE) - 1))
def test_every_truncation_is_refused(cut: int) -> None:
    assert_refused(VALUE[:cut])


@settings(max_examples=150, deadline=None)
@given(position=st.integers(min_value=0, max_value=len(VALUE) - 1), bit=st.integers(min_value=0, max_value=7))
def test_every_single_bit_flip_is_refused(position: int, bit: int) -> None:
    damaged = bytearray(VALUE)
    damaged[position] ^= 1 << bit
    assert_refused(bytes(damaged))
