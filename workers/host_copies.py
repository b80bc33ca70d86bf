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
