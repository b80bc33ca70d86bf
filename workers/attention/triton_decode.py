"""Paged decode attention as one Triton kernel: each query reads its keys and values straight from the
pool's blocks through its block table, with no gathered copy (docs/architecture.md, "Decode steps as
CUDA graphs").

One program per (row, K/V head) loads the ``group`` query heads that share that K/V head, then walks the
row's keys ``KEYS`` at a time up to its ``num_keys`` (read on the device, so a captured graph replays it
for any context length within its table), with the online softmax of flash attention: scores in
float32, probabilities rounded to the values' dtype for the second product, as flash kernels do::

    for each chunk of keys:  s = q k^T * scale  (masked past num_keys)
                             m' = max(m, max s);  l = l e^(m - m') + sum e^(s - m')
                             acc = acc e^(m - m') + e^(s - m') v
    out = acc / l

Triton comes with CUDA builds of PyTorch; without it (the CPU, or a failed compile) the fixed-shape step
gathers blocks and calls PyTorch's attention instead (``workers.attention.fixed_decode``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

KEYS_PER_ITERATION = 64


def triton_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def _next_power_of_two(n: int, floor: int) -> int:
    return max(floor, 1 << (n - 1).bit_length())


_kernel: Any = None


def _compile() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        num_keys_ptr,
        out_ptr,
        scale,
        stride_qb,
        stride_qh,
        stride_qg,
        stride_block,
        stride_slot,
        stride_kvh,
        stride_tb,
        stride_ob,
        stride_oh,
        stride_og,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        KEYS: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        num_keys = tl.load(num_keys_ptr + row)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        g_ok = offs_g < GROUP
        d_ok = offs_d < HEAD_DIM
        q_ptrs = q_ptr + row * stride_qb + head * stride_qh + offs_g[:, None] * stride_qg + offs_d[None, :]
        q = tl.load(q_ptrs, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
        offs_n = tl.arange(0, KEYS)
        for start in range(0, num_keys, KEYS):
            keys = start + offs_n
            k_ok = keys < num_keys
            block = tl.load(tables_ptr + row * stride_tb + keys // BLOCK_SIZE, mask=k_ok, other=0)
            offsets = (
                block[:, None] * stride_block
                + (keys % BLOCK_SIZE)[:, None] * stride_slot
                + head * stride_kvh
                + offs_d[None, :]
            )
            kv_ok = k_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + offsets, mask=kv_ok, other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(k_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + offsets, mask=kv_ok, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / l_sum[:, None]
        o_ptrs = out_ptr + row * stride_ob + head * stride_oh + offs_g[:, None] * stride_og + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])

    return paged_decode


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    num_keys: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``q`` [B, kv_heads, group, d] (last dim contiguous); ``k_pool``/``v_pool`` one layer's
    [num_blocks, block_size, kv_heads, d]; ``block_tables`` [B, N] and ``num_keys`` [B] int64 ->
    [B, kv_heads, group, d]: each row's queries over its first ``num_keys`` pooled keys."""
    global _kernel
    if _kernel is None:
        _kernel = _compile()
    num_rows, num_kv_heads, group, head_dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _kernel[(num_rows, num_kv_heads)](
        q,
        k_pool,
        v_pool,
        block_tables,
        num_keys,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        GROUP=group,
        GROUP_PAD=_next_power_of_two(group, 16),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=_next_power_of_two(head_dim, 16),
        BLOCK_SIZE=k_pool.shape[1],
        KEYS=KEYS_PER_ITERATION,
    )
    return out
