"""The preprocessing pool's transfer of processed tensors through /dev/shm
(app/inputs/preprocess/pool.py): the
pool process writes an item's tensors into a file the API named, the API copies each out once and
unlinks it. Only ``ShmOutput`` (names, dtypes, shapes, offsets) crosses the pipe."""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import uuid

import msgspec
import numpy as np
import torch

from wire.shm_ring import SHM_DIR, ring_name, round_up
from workers.families.processing import ItemLayout, ProcessedItem
from workers.frames import dtype_name


class TensorSlot(msgspec.Struct, frozen=True, array_like=True):
    key: str
    dtype: str  # torch dtype name: "float32", "bfloat16", "int64", ...
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the file, a multiple of 64 (``round_up``)


class ShmOutput(msgspec.Struct, frozen=True):
    """What a pool process returns for one item; the tensors stay in the shared-memory file ``name``."""

    name: str
    tensors: tuple[TensorSlot, ...]
    layout: ItemLayout


def output_name(api_pid: int) -> str:
    return ring_name(api_pid, f"out-{uuid.uuid4().hex}")


def write_output(item: ProcessedItem, name: str) -> ShmOutput:
    """Puts ``item``'s tensors into the new file /dev/shm/``name`` (unlinked again if anything fails)."""
    slots, size = [], 0
    for key, tensor in item.tensors.items():
        slots.append(TensorSlot(key, dtype_name(tensor.dtype), tuple(tensor.shape), size))
        size = round_up(size + tensor.nbytes)
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, max(size, 1))
        with mmap.mmap(fd, max(size, 1)) as buf:
            for slot, tensor in zip(slots, item.tensors.values(), strict=True):
                raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                buf[slot.offset : slot.offset + raw.nbytes] = raw.data
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return ShmOutput(name, tuple(slots), item.layout)


def read_output(output: ShmOutput) -> ProcessedItem:
    """Copies the tensors out of ``output``'s file into private tensors, then unlinks the file."""
    path = os.path.join(SHM_DIR, output.name)
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as buf:
                tensors = {slot.key: _copy_out(buf, slot) for slot in output.tensors}
        finally:
            os.close(fd)
    finally:
        discard_output(output.name)
    return ProcessedItem(tensors, output.layout)


def _copy_out(buf: mmap.mmap, slot: TensorSlot) -> torch.Tensor:
    dtype = getattr(torch, slot.dtype)
    assert isinstance(dtype, torch.dtype), slot.dtype
    nbytes = math.prod(slot.shape) * dtype.itemsize
    out = torch.empty(nbytes, dtype=torch.uint8)
    out.numpy()[:] = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=slot.offset)
    return out.view(dtype).reshape(slot.shape)


def discard_output(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))
