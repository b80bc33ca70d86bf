"""Small host-to-device copies that do not wait for the device. A plain copy to a GPU from pageable
memory synchronises the stream first, so the host would wait for every kernel queued before it, the
step before's forward included (docs/architecture.md, "Engine step"); from pinned memory, without
blocking, it is queued like a kernel. PyTorch's pinned-memory cache keeps the source until the copy ran."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(
    values: Sequence[int] | Sequence[float] | np.ndarray | torch.Tensor,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``values`` (a list, a numpy array or a CPU tensor) as a tensor on ``device``, queued on its stream
    (on a CPU, simply made)."""
    tensor = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class HostCopies:
    """Device tensors copied to the host as the last work queued so far on their stream, without waiting
    for it: ``wait`` gives the copies once that work is done, not once work queued after it is (the next
    step's forward, on a GPU: docs/architecture.md, "Engine step"). On a CPU, the tensors themselves."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if tensors and tensors[0].device.type == "cuda":
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, tensor in zip(self._host, tensors, strict=True):
                host.copy_(tensor, non_blocking=True)
            self._copied: torch.cuda.Event | None = torch.cuda.Event()
            self._copied.record()
        else:
            self._host, self._copied = list(tensors), None

    def wait(self) -> list[torch.Tensor]:
        if self._copied is not None:
            self._copied.synchronize()
        return self._host
