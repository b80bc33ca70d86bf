"""The worker's half of the paged KV cache: one pool of fixed-size blocks, allocated once at start.

The engine's block bookkeeping decides which blocks a request owns and sends them as block tables;
the pool only stores K/V where a table points. Position ``p`` of a request lives in slot::

    slot(p) = table[p // block_size] * block_size + p % block_size

    table [7, 2, 9], block_size 4:  positions 0..3 -> slots 28..31, 4..7 -> 8..11, 8..11 -> 36..39

Invariants:
- the pool's size is fixed after start (its memory is never grown or returned while serving);
- the worker writes only the slots of positions it computes in the current step; slots of positions
  below a request's ``num_computed_tokens`` are read as they are (prefix-cache hits may have been
  written by another request);
- block ids come from the engine and are checked against ``num_blocks``, never chosen here.
"""

from __future__ import annotations

import logging

import torch

from workers.config import CPU_DEFAULT_KV_CACHE_TOKENS

logger = logging.getLogger(__name__)


class KVPool:
    """K/V of every layer: ``kv[layer, 0 | 1, slot]`` is one position's [num_kv_heads, head_dim] K or V."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        spare_blocks: int = 0,
    ):
        """``spare_blocks`` more blocks follow the ``num_blocks`` the engine hands out: rows of a padded
        fixed-shape step write there (``workers.decode_graphs``), never over a request's K/V."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a KV pool needs at least one block of one token, got {num_blocks}x{block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.spare_block = num_blocks  # the first spare block (when there are any)
        # zeros, not empty: every page is committed now, at start, so the worker's memory is what it
        # will be under full load and does not creep up as requests first touch their blocks
        self.kv = torch.zeros(
            (num_layers, 2, (num_blocks + spare_blocks) * block_size, num_kv_heads, head_dim),
            dtype=dtype,
            device=device,
        )

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ([len(slots), num_kv_heads, head_dim]) of ``layer`` at ``slots``."""
        self.rows(layer, 0).index_copy_(0, slots, k.reshape(len(slots), -1))
        self.rows(layer, 1).index_copy_(0, slots, v.reshape(len(slots), -1))

    def copy_slots(self, source: int, destination: int, num_slots: int) -> None:
        """K/V of block ``source``'s first ``num_slots`` slots, every layer, into block ``destination``'s
        (a prefix-cache hit of a block's first tokens, before the step that fills the rest)."""
        src, dst = source * self.block_size, destination * self.block_size
        self.kv[:, :, dst : dst + num_slots] = self.kv[:, :, src : src + num_slots]

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` at ``slots``, in order: two [len(slots), num_kv_heads, head_dim] tensors."""
        shape = (len(slots), *self.kv.shape[3:])
        return tuple(self.rows(layer, i).index_select(0, slots).view(shape) for i in (0, 1))  # type: ignore[return-value]

    def blocks(self, layer: int, k_or_v: int) -> torch.Tensor:
        """K (0) or V (1) of ``layer`` as one [num_blocks, block_size * num_kv_heads * head_dim] row per
        block: a block table gathers whole blocks."""
        return self.kv[layer, k_or_v].view(self.kv.shape[2] // self.block_size, -1)

    def rows(self, layer: int, k_or_v: int) -> torch.Tensor:
        """K (0) or V (1) of ``layer`` as one [num_slots, num_kv_heads * head_dim] row per slot: gathers
        and scatters of whole rows of a 2-D tensor take PyTorch's fast path (several times faster on CPU
        than the same on the 3-D view)."""
        return self.kv[layer, k_or_v].view(self.kv.shape[2], -1)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return num_layers * 2 * num_kv_heads * head_dim * dtype.itemsize


def plan_num_kv_blocks(
    *,
    block_size: int,
    bytes_per_token: int,
    device: torch.device,
    kv_cache_tokens: int | None,
    gpu_memory_utilization: float,
) -> int:
    """How many blocks the pool gets. Called once, after the model is loaded (its weights count as used).

    ``kv_cache_tokens`` wins when set. Otherwise on CUDA the pool takes what is left of
    ``gpu_memory_utilization`` x the device's memory after everything already in use on it (weights,
    the CUDA context, other processes: ``mem_get_info`` sees them all, ``memory_allocated`` would not);
    the rest stays free for activations. On CPU the default is ``CPU_DEFAULT_KV_CACHE_TOKENS``.
    """
    if kv_cache_tokens is None and device.type == "cuda":
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        budget_bytes = int(total_bytes * gpu_memory_utilization) - (total_bytes - free_bytes)
        num_blocks = budget_bytes // (bytes_per_token * block_size)
        if num_blocks < 1:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: {total_bytes - free_bytes} of {total_bytes} bytes are "
                f"in use, gpu_memory_utilization={gpu_memory_utilization}"
            )
        return num_blocks
    num_tokens = CPU_DEFAULT_KV_CACHE_TOKENS if kv_cache_tokens is None else kv_cache_tokens
    return max(1, num_tokens // block_size)
