"""Attention of a decode-only step in fixed shapes, from tensors already on the device: what a CUDA graph
captures (``workers.decode_graphs``) and replays with new contents.

A step of ``B`` decodes whose contexts span at most ``N`` blocks reads, per layer, each row's ``N`` table
entries (padding entries and padding rows point at the pool's spare block), and attends its one query
over those ``N * block_size`` keys, keys at or past the row's ``num_keys`` masked::

    q  [B, kv_heads, group, d]     the query heads that share a K/V head stacked as queries (GQA)
    K  [B, kv_heads, N * bs, d]    gathered whole blocks, as the batched backend does
    mask [B, 1, 1, N * bs]         0 for keys < num_keys[b], -inf after

Nothing is built on the host: the mask comes from ``num_keys`` on the device, once per step. The
attention call is PyTorch's memory-efficient kernel where it exists (CUDA; cuDNN's is left out: it has
had faults under graph capture with long masked keys), else the math one. On CUDA with Triton, the
paged kernel (``workers.attention.triton_decode``) replaces the gather, the mask and the call: it reads
each row's blocks in place and stops at its ``num_keys``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from workers.attention.base import StepAttention
from workers.attention.triton_decode import paged_decode_attention
from workers.kv_pool import KVPool

_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class FixedDecodeAttention(StepAttention):
    def __init__(
        self,
        pool: KVPool,
        block_tables: torch.Tensor,
        num_keys: torch.Tensor,
        write_slots: torch.Tensor,
        use_triton: bool = False,
    ) -> None:
        """``block_tables`` [B, N], ``num_keys`` [B] (each row's keys, its new token included) and
        ``write_slots`` [B]: int64 on the pool's device. ``use_triton``: attend with the paged Triton
        kernel (``workers.attention.triton_decode``) instead of gathering blocks for PyTorch's."""
        super().__init__(pool, [], write_slots)
        self.block_tables, self.num_keys, self.use_triton = block_tables, num_keys, use_triton
        self.num_rows, num_blocks = block_tables.shape
        if use_triton:
            return
        self.num_keys_padded = num_blocks * pool.block_size
        self.key_blocks = block_tables.flatten()
        keys = torch.arange(self.num_keys_padded, device=num_keys.device)
        visible = keys.unsqueeze(0) < num_keys.unsqueeze(1)
        mask = torch.zeros(visible.shape, dtype=pool.kv.dtype, device=num_keys.device)
        self.mask = mask.masked_fill_(~visible, float("-inf")).view(self.num_rows, 1, 1, -1)

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        num_heads, num_rows, head_dim = query.shape
        num_kv_heads = self.pool.kv.shape[3]
        group = num_heads // num_kv_heads
        # head h reads K/V head h // group (transformers' repeat_kv): [heads, B, d] -> [B, kv_heads, group, d]
        q = query.view(num_kv_heads, group, num_rows, head_dim).permute(2, 0, 1, 3)
        if self.use_triton:
            blocks = (-1, self.pool.block_size, num_kv_heads, head_dim)
            k_pool, v_pool = (self.pool.kv[layer_idx, i].view(blocks) for i in (0, 1))
            scale = head_dim**-0.5 if scaling is None else scaling
            out = paged_decode_attention(q, k_pool, v_pool, self.block_tables, self.num_keys, scale)
            return out.reshape(num_rows, num_heads, head_dim)
        shape = (num_rows, self.num_keys_padded, num_kv_heads, head_dim)
        k = self.pool.blocks(layer_idx, 0).index_select(0, self.key_blocks).view(shape).transpose(1, 2)
        v = self.pool.blocks(layer_idx, 1).index_select(0, self.key_blocks).view(shape).transpose(1, 2)
        with sdpa_kernel(_BACKENDS):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scaling)
        return out.reshape(num_rows, num_heads, head_dim)
