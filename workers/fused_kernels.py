"""The decode step's elementwise work as Triton kernels, one launch where transformers' modules launch
several (docs/architecture.md, "Decode steps as CUDA graphs"): a residual add with the RMSNorm after
it, RoPE of one token's query and key heads with the write of its K/V into the pool, and SiLU times
the up projection. They read their inputs in place from row slices of a merged projection's output.

Each kernel rounds where transformers' modules round, so its results are theirs: in a bf16 model,
``residual + x`` is rounded to bf16 before the norm reads it, the norm computes in float32 and rounds
before the weight's multiply (``weight * x.to(bf16)``), RoPE rounds ``q * cos`` and
``rotate_half(q) * sin`` before adding them, and SiLU rounds before the multiply. What can still differ
is the last bit of a float32 reduction or ``exp``. They are compiled without contracting a multiply and
an add into one FMA (``LAUNCH_OPTIONS``): an FMA rounds once where PyTorch rounds the product first (on
an H100 RoPE's ``q * cos + rotate_half(q) * sin`` became one bf16 FMA per element, and its results
differed from transformers' in the last bit). ``workers.fused_decode`` holds the same operations as
PyTorch calls, the CPU's path and the reference of tests/gpu/test_fused_kernels.py.

Triton comes with CUDA builds of PyTorch; these are compiled on first use.
"""

from __future__ import annotations

from typing import Any

import torch

_kernels: dict[str, Any] = {}
# every launch's compile options: no FMA contraction (the module's docstring)
LAUNCH_OPTIONS: dict[str, Any] = {"enable_fp_fusion": False}


def _compile() -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm(
        x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps, width,
        HAS_RESIDUAL: tl.constexpr, WIDTH_PAD: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.arange(0, WIDTH_PAD)
        ok = cols < width
        x = tl.load(x_ptr + row * width + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * width + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # residual + x, rounded
            tl.store(residual_out_ptr + row * width + cols, x, mask=ok)
        x32 = x.to(tl.float32)
        variance = tl.sum(x32 * x32, 0) / width
        normed = (x32 * tl.rsqrt(variance + eps)).to(x.dtype)  # as torch.rsqrt, then rounded
        w = tl.load(weight_ptr + cols, mask=ok, other=0.0)
        tl.store(
            out_ptr + row * width + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=ok
        )

    @triton.jit
    def rope_write(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_pool_ptr, v_pool_ptr, slots_ptr,
        stride_q, stride_k, stride_v, stride_cs, stride_slot,
        NUM_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    ):  # fmt: skip
        """Program (row, h): h < NUM_HEADS rotates query head h into q_out [B, heads, d]; otherwise it
        rotates key head h - NUM_HEADS and writes it, with its value, at the row's pool slot."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        cols = tl.arange(0, HALF_PAD)
        ok = cols < HALF
        cs = row * stride_cs + cols
        cos1, cos2 = (
            tl.load(cos_ptr + cs, mask=ok, other=0.0),
            tl.load(cos_ptr + cs + HALF, mask=ok, other=0.0),
        )
        sin1, sin2 = (
            tl.load(sin_ptr + cs, mask=ok, other=0.0),
            tl.load(sin_ptr + cs + HALF, mask=ok, other=0.0),
        )
        if head < NUM_HEADS:
            src = q_ptr + row * stride_q + head * 2 * HALF + cols
        else:
            src = k_ptr + row * stride_k + (head - NUM_HEADS) * 2 * HALF + cols
        x1 = tl.load(src, mask=ok, other=0.0)
        x2 = tl.load(src + HALF, mask=ok, other=0.0)
        dtype = x1.dtype
        # (x * cos) + (rotate_half(x) * sin), rotate_half(x) = cat(-x2, x1); each product rounded
        out1 = ((x1.to(tl.float32) * cos1.to(tl.float32)).to(dtype).to(tl.float32)
                + (-x2.to(tl.float32) * sin1.to(tl.float32)).to(dtype).to(tl.float32)).to(dtype)  # fmt: skip
        out2 = ((x2.to(tl.float32) * cos2.to(tl.float32)).to(dtype).to(tl.float32)
                + (x1.to(tl.float32) * sin2.to(tl.float32)).to(dtype).to(tl.float32)).to(dtype)  # fmt: skip
        if head < NUM_HEADS:
            # each branch's names are its own: Triton merges a name both branches assign into one
            # value, which must then have one type in both
            q_dst = q_out_ptr + (row * NUM_HEADS + head) * 2 * HALF + cols
            tl.store(q_dst, out1, mask=ok)
            tl.store(q_dst + HALF, out2, mask=ok)
        else:
            kv_head = head - NUM_HEADS
            slot = tl.load(slots_ptr + row)
            pool_at = slot * stride_slot + kv_head * 2 * HALF + cols
            tl.store(k_pool_ptr + pool_at, out1, mask=ok)
            tl.store(k_pool_ptr + pool_at + HALF, out2, mask=ok)
            v_src = v_ptr + row * stride_v + kv_head * 2 * HALF + cols
            tl.store(v_pool_ptr + pool_at, tl.load(v_src, mask=ok, other=0.0), mask=ok)
            tl.store(v_pool_ptr + pool_at + HALF, tl.load(v_src + HALF, mask=ok, other=0.0), mask=ok)

    @triton.jit
    def silu_mul(gate_ptr, up_ptr, out_ptr, width, stride_gate, stride_up, BLOCK: tl.constexpr):
        """Program (row, block): BLOCK columns of one row."""
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < width
        g = tl.load(gate_ptr + row * stride_gate + offs, mask=ok, other=0.0)
        u = tl.load(up_ptr + row * stride_up + offs, mask=ok, other=0.0)
        g32 = g.to(tl.float32)
        act = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype)
        tl.store(out_ptr + row * width + offs, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)

    return {"add_rms_norm": add_rms_norm, "rope_write": rope_write, "silu_mul": silu_mul}


def _kernel(name: str) -> Any:
    if not _kernels:
        _kernels.update(_compile())
    return _kernels[name]


def _pad(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [B, width] contiguous -> (RMSNorm of ``residual + x``, ``residual + x``); without a
    residual, (RMSNorm of ``x``, ``x``)."""
    rows, width = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else x
    _kernel("add_rms_norm")[(rows,)](
        x, x if residual is None else residual, weight, out, residual_out, eps, width,
        HAS_RESIDUAL=residual is not None, WIDTH_PAD=_pad(width), **LAUNCH_OPTIONS,
    )  # fmt: skip
    return out, residual_out


def rope_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """``q`` [B, heads, d], ``k``/``v`` [B, kv_heads, d] (last dims contiguous), ``cos``/``sin`` [B, d];
    ``k_pool``/``v_pool`` one layer's [slots, kv_heads, d], ``slots`` [B] -> the rotated query
    [B, heads, d]; the rotated key and the value are written at each row's slot."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    half = head_dim // 2
    _kernel("rope_write")[(rows, num_heads + num_kv_heads)](
        q, k, v, cos, sin, q_out, k_pool, v_pool, slots,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0), k_pool.stride(0),
        NUM_HEADS=num_heads, HALF=half, HALF_PAD=_pad(half), **LAUNCH_OPTIONS,
    )  # fmt: skip
    return q_out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for [B, width] tensors of one shape whose rows are dense (the two halves of
    a merged gate/up projection's output are) -> a contiguous [B, width]."""
    rows, width = gate.shape
    assert up.shape == gate.shape and gate.stride(1) == 1 and up.stride(1) == 1
    out = torch.empty((rows, width), dtype=gate.dtype, device=gate.device)
    block = 1024
    _kernel("silu_mul")[(rows, -(-width // block))](
        gate, up, out, width, gate.stride(0), up.stride(0), BLOCK=block, **LAUNCH_OPTIONS
    )
    return out
