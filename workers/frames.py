"""Tensors <-> ZeroMQ frames without copies.

A ``TensorRef`` names a frame of the same multipart message (frame 0 is the msgpack message itself)
and the dtype and shape of the bytes in it. Receiving views the frame's buffer as a tensor in place;
sending hands out a view of a contiguous CPU tensor's memory. Either way the buffer must outlive the
tensor (zmq frames do while referenced; the caller keeps the source tensor alive until sent).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from wire.protocol import ShmItemRef, TensorRef

Buffer = Any  # bytes, memoryview, zmq.Frame: anything exposing the buffer protocol


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unsupported tensor dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype: numpy's spelling where numpy has one ("float32"), else torch's."""
    return str(dtype).removeprefix("torch.")


def tensor_from_frame(ref: TensorRef, frames: Sequence[Buffer]) -> torch.Tensor:
    """View frame ``ref.frame`` of ``frames`` (indexed like the multipart message) as a CPU tensor.

    The tensor shares the frame's memory and is read-only in spirit: callers copy before writing
    (moving it to the model's device or dtype does).
    """
    if not 0 < ref.frame < len(frames):
        raise ValueError(f"tensor frame {ref.frame} not in message of {len(frames)} frames")
    return tensor_from_buffer(ref.dtype, ref.shape, frames[ref.frame], f"frame {ref.frame}")


def tensors_from_shm(ref: ShmItemRef, payload: memoryview) -> dict[str, torch.Tensor]:
    """Views of an item's tensors in its shared-memory payload (already validated by the ring
    reader); read-only in spirit, like ``tensor_from_frame``."""
    tensors = {}
    for name, tensor in ref.tensors.items():
        nbytes = _numel(tensor.shape) * _torch_dtype(tensor.dtype).itemsize
        view = payload[tensor.offset : tensor.offset + nbytes]
        tensors[name] = tensor_from_buffer(tensor.dtype, tensor.shape, view, f"shm tensor {name!r}")
    return tensors


def _numel(shape: Sequence[int]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel


def tensor_from_buffer(dtype_name: str, shape: Sequence[int], buffer: Buffer, what: str) -> torch.Tensor:
    """``buffer`` viewed as a CPU tensor of ``dtype_name`` and ``shape`` (sizes must match exactly)."""
    dtype = _torch_dtype(dtype_name)
    shape = tuple(shape)
    buf = memoryview(buffer).cast("B")
    numel = _numel(shape)
    expected_bytes = numel * dtype.itemsize
    if buf.nbytes != expected_bytes:
        raise ValueError(f"{what} holds {buf.nbytes} bytes, {shape} {dtype_name} needs {expected_bytes}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # zmq frames and bytes are read-only buffers; torch warns that writing would be undefined.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=dtype)
    return flat.view(shape)


def tensor_to_frame(tensor: torch.Tensor, frame: int) -> tuple[TensorRef, memoryview]:
    """Describe ``tensor`` as frame number ``frame`` and return (ref, buffer) to send.

    The buffer views the tensor's memory when it is already a contiguous CPU tensor; otherwise it views
    a contiguous CPU copy. Keep the tensor alive until the message is sent.
    """
    cpu = tensor.detach().to("cpu").contiguous()
    ref = TensorRef(dtype=dtype_name(cpu.dtype), shape=tuple(cpu.shape), frame=frame)
    # Viewing as bytes lets dtypes numpy lacks (bfloat16) travel too.
    buf = cpu.reshape(-1).view(torch.uint8).numpy().data
    return ref, buf
