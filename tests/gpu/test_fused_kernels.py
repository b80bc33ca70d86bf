"""The decode graphs' fused Triton kernels (workers/fused_kernels.py) on a GPU in bf16, against the
PyTorch operations they replace (transformers' modules and their order, workers/fused_decode.py): the
residual add exactly; the norm, RoPE and SiLU-and-multiply within one bf16 rounding step of them, on
almost every element (a float32 reduction or ``exp`` may differ in its last bit). Then a whole tiny
model's fused decode layers against transformers' layers. (The tier's parity tests run the kernels
inside every served decode step, against transformers' ``generate``.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from tests.integration.test_fused_decode import decode_step
from workers import fused_kernels
from workers.attention.fixed_decode import FixedDecodeAttention
from workers.attention.triton_decode import triton_available
from workers.decode_graphs import DecodeGraphs
from workers.fused_decode import FusedDecoder, rotate_half
from workers.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_available(torch.device("cuda")), reason="needs CUDA and Triton"),
]

DEVICE = torch.device("cuda")


def assert_within_one_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal on at least 99 % of elements; elsewhere one bf16 step apart (2**-7 relative)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    unequal = got != expected
    assert unequal.float().mean().item() <= 0.01, unequal.float().mean().item()
    step = expected.float().abs().clamp_min(2**-14) * 2**-7
    assert ((got.float() - expected.float()).abs() <= step * 1.01).all()


def test_add_rms_norm() -> None:
    torch.manual_seed(0)
    x, residual = (torch.randn(64, 3584, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    norm = Qwen2RMSNorm(3584, eps=1e-6).to(DEVICE, torch.bfloat16)
    norm.weight.data.normal_()
    out, summed = fused_kernels.add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
    assert torch.equal(summed, residual + x)
    assert_within_one_rounding(out, norm(residual + x))
    alone, same = fused_kernels.add_rms_norm(x, None, norm.weight, norm.variance_epsilon)
    assert same is x
    assert_within_one_rounding(alone, norm(x))


def test_rope_write() -> None:
    torch.manual_seed(0)
    rows, heads, kv_heads, head_dim = 64, 28, 4, 128
    q = torch.randn(rows, heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    k, v = (torch.randn(rows, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    angles = torch.rand(rows, head_dim // 2, device=DEVICE) * 100
    cos, sin = (f(torch.cat((angles, angles), -1)).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    k_pool, v_pool = (
        torch.zeros(4096, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)
    )
    slots = torch.randperm(4096, device=DEVICE)[:rows]
    rotated = fused_kernels.rope_write(q, k, v, cos, sin, k_pool, v_pool, slots)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    assert torch.equal(rotated, q * c + rotate_half(q) * s)
    assert torch.equal(k_pool[slots], k * c + rotate_half(k) * s)
    assert torch.equal(v_pool[slots], v)
    untouched = torch.ones(4096, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert not k_pool[untouched].any() and not v_pool[untouched].any()


def test_silu_mul() -> None:
    torch.manual_seed(0)
    gate = torch.randn(64, 18944, dtype=torch.bfloat16, device=DEVICE) * 4
    up = torch.randn(64, 18944, dtype=torch.bfloat16, device=DEVICE)
    assert_within_one_rounding(fused_kernels.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)
    # the halves of a merged gate/up projection's output, read in place
    gate_up = torch.cat((gate, up), -1)
    halves = gate_up.split([18944, 18944], -1)
    assert torch.equal(fused_kernels.silu_mul(*halves), fused_kernels.silu_mul(gate, up))


def test_rope_write_reads_row_slices_of_a_merged_projection() -> None:
    torch.manual_seed(0)
    rows, heads, kv_heads, head_dim = 64, 28, 4, 128
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16, device=DEVICE)
    q, k, v = (
        t.view(rows, -1, head_dim) for t in qkv.split([heads * head_dim, *(2 * [kv_heads * head_dim])], -1)
    )
    angles = torch.rand(rows, head_dim // 2, device=DEVICE) * 100
    cos, sin = (f(torch.cat((angles, angles), -1)).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    pools = [torch.zeros(4096, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(4)]
    slots = torch.randperm(4096, device=DEVICE)[:rows]
    in_place = fused_kernels.rope_write(q, k, v, cos, sin, pools[0], pools[1], slots)
    copied = fused_kernels.rope_write(
        q.contiguous(), k.contiguous(), v.contiguous(), cos, sin, *pools[2:], slots
    )
    assert torch.equal(in_place, copied)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl", "qwen3_vl"])
def test_fused_layers_on_the_gpu(tiny_model: Callable[[str], Path], family: str) -> None:
    runner = ModelRunner(str(tiny_model(family)), device="cuda", kv_cache_tokens=1024, decode_graphs=False)
    lm = runner.lm_forward
    torch.manual_seed(0)
    lm.kv_pool.kv.normal_()
    before = lm.kv_pool.kv.clone()
    embeds, positions, tables, num_keys, slots = (
        t.to(DEVICE) for t in decode_step(lm, 9, 1 if family == "llava" else 3)
    )
    embeds = embeds.to(lm.kv_pool.kv.dtype)
    with torch.inference_mode():
        expected = lm.decoder(embeds, positions, FixedDecodeAttention(lm.kv_pool, tables, num_keys, slots))
        lm.kv_pool.kv.copy_(before)
        step = FixedDecodeAttention(lm.kv_pool, tables, num_keys, slots, True)
        got = FusedDecoder(lm.lm, lm.layers, use_triton=True)(embeds, positions, step)
    torch.testing.assert_close(got, expected, atol=0.05 * expected.abs().max().item(), rtol=0)
    assert all(merged is not None for merged in FusedDecoder(lm.lm, lm.layers, use_triton=True).merged)


def test_the_worker_merges_the_projections_before_sizing_its_pool(tiny_model: Callable[[str], Path]) -> None:
    runner = ModelRunner(
        str(tiny_model("qwen2_5_vl")), device="cuda", kv_cache_tokens=1024, decode_graphs=True
    )
    graphs = runner.lm_forward
    assert isinstance(graphs, DecodeGraphs) and graphs.decoder is not None
    for layer, merged in zip(graphs.model.layers, graphs.decoder.merged, strict=True):
        assert merged is getattr(layer, "_mmserve_merged", None) is not None  # made once, before the pool
        weight = layer.self_attn.k_proj.weight
        assert weight.untyped_storage().data_ptr() == merged.qkv_weight.untyped_storage().data_ptr()
