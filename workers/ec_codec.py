"""How an encoder output is written to the encoder-cache store, and checked when read back.

A value is a safetensors blob with one tensor, ``output`` ([num_tokens, hidden], or [num_tokens, levels,
hidden] for families with deepstack levels: all levels travel together), and metadata naming the mm_hash
it belongs to and a blake3 digest of the tensor's bytes. A value is used only if it parses, names the
key it was read under, its digest matches, its dtype is a float type and its shape is the one the
reader's model expects; otherwise it is ``CorruptEncoderOutput`` and the item is encoded (or 503), never
spliced in as a wrong embedding.
"""

from __future__ import annotations

import json

import blake3
import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

FORMAT = "mmserve-ec-1"
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class CorruptEncoderOutput(ValueError):
    """A stored value that is not a complete, matching encoder output."""


def _digest(tensor: torch.Tensor) -> str:
    return blake3.blake3(tensor.contiguous().view(torch.uint8).numpy().data).hexdigest()  # no copy


def encode_output(mm_hash: str, output: torch.Tensor) -> bytes:
    """Called by a producer after encoding: the store's value for ``mm_hash``."""
    tensor = output.detach().to("cpu").contiguous()
    metadata = {"format": FORMAT, "mm_hash": mm_hash, "digest": _digest(tensor)}
    return save({"output": tensor}, metadata=metadata)


def decode_output(mm_hash: str, value: bytes, num_tokens: int, tail: tuple[int, ...]) -> torch.Tensor:
    """The output stored under ``mm_hash`` (on the CPU, in its stored dtype), checked against the
    placement's ``num_tokens`` and the model's ``tail`` (the shape after the token dimension)."""
    try:
        tensors = load(value)
        metadata = _metadata(value)
    except (SafetensorError, ValueError) as exc:
        raise CorruptEncoderOutput(f"{mm_hash}: not a safetensors value ({exc})") from exc
    if metadata.get("format") != FORMAT or metadata.get("mm_hash") != mm_hash:
        raise CorruptEncoderOutput(f"{mm_hash}: the value is not this item's ({metadata})")
    output = tensors.get("output")
    if output is None or set(tensors) != {"output"}:
        raise CorruptEncoderOutput(f"{mm_hash}: unexpected tensors {sorted(tensors)}")
    if output.dtype not in FLOAT_DTYPES:
        raise CorruptEncoderOutput(f"{mm_hash}: dtype {output.dtype}")
    if tuple(output.shape) != (num_tokens, *tail):
        raise CorruptEncoderOutput(f"{mm_hash}: shape {tuple(output.shape)}, expected {(num_tokens, *tail)}")
    if _digest(output) != metadata.get("digest"):
        raise CorruptEncoderOutput(f"{mm_hash}: digest mismatch (corrupt data)")
    return output


def _metadata(value: bytes) -> dict[str, str]:
    """The safetensors header's ``__metadata__`` (``load`` does not return it)."""
    if len(value) < 8:
        raise ValueError("truncated header")
    header_len = int.from_bytes(value[:8], "little")
    if header_len > len(value) - 8:
        raise ValueError("truncated header")
    header = json.loads(value[8 : 8 + header_len])
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError("bad metadata")
    return {str(k): str(v) for k, v in metadata.items()}
