"""The decode step's attention on the GPU: the paged Triton kernel (workers/attention/triton_decode.py)
against the gathered blocks and PyTorch's attention that it replaces, on a bf16 pool, for contexts of
one key to a full table, GQA groups of 1, 2 and 7 heads and head sizes 32 and 128. (The tier's parity
tests run the kernel inside the decode CUDA graphs of every served step.)"""

from __future__ import annotations

import pytest
import torch

from workers.attention.fixed_decode import FixedDecodeAttention
from workers.attention.triton_decode import paged_decode_attention, triton_available
from workers.kv_pool import KVPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_available(torch.device("cuda")), reason="needs CUDA and Triton"),
]


@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(2, 2, 32), (4, 7, 128), (1, 1, 128)])
def test_paged_kernel_equals_gathered_attention(kv_heads: int, group: int, head_dim: int) -> None:
    torch.manual_seed(0)
    device, block_size, num_rows, width = torch.device("cuda"), 16, 9, 12
    pool = KVPool(1, 64, block_size, kv_heads, head_dim, torch.bfloat16, device, spare_blocks=1)
    pool.kv.normal_()
    tables = torch.randint(0, 64, (num_rows, width), device=device)
    num_keys = torch.randint(1, width * block_size + 1, (num_rows,), device=device)
    num_keys[0], num_keys[-1] = 1, width * block_size
    slots = torch.zeros(num_rows, dtype=torch.long, device=device)
    query = torch.randn(kv_heads * group, num_rows, head_dim, dtype=torch.bfloat16, device=device)
    expected = FixedDecodeAttention(pool, tables, num_keys, slots).attend(0, query, None)
    got = FixedDecodeAttention(pool, tables, num_keys, slots, True).attend(0, query, None)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_kernel_reads_only_its_keys() -> None:
    """Keys past num_keys (here NaN) never reach the output."""
    device = torch.device("cuda")
    pool = KVPool(1, 8, 16, 2, 32, torch.bfloat16, device)
    pool.kv.normal_()
    pool.kv[0, :, 40:] = float("nan")
    tables = torch.arange(4, device=device).view(1, 4)
    q = torch.randn(1, 2, 2, 32, dtype=torch.bfloat16, device=device)
    k_pool, v_pool = (pool.kv[0, i].view(-1, 16, 2, 32) for i in (0, 1))
    out = paged_decode_attention(q, k_pool, v_pool, tables, torch.tensor([40], device=device), 32**-0.5)
    assert torch.isfinite(out).all()
