"""The decode graphs' fused layers (workers/fused_decode.py) against transformers' own layers, for every
family's tiny checkpoint: on the CPU (PyTorch's operations in transformers' order) the same hidden
states and the same K/V written into the pool, bit for bit, for rows of different context lengths and
M-RoPE positions whose three rows differ. (tests/gpu/test_fused_kernels.py checks the Triton kernels
against these operations on a GPU.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from workers.attention.fixed_decode import FixedDecodeAttention
from workers.fused_decode import FusedDecoder, fusable
from workers.model_runner import ModelRunner
from workers.paged_lm import PagedLanguageModel

BLOCK_SIZE, NUM_BLOCKS = 16, 8


def decode_step(lm: PagedLanguageModel, rows: int, position_rows: int) -> tuple[torch.Tensor, ...]:
    """Random inputs of one decode step: embeds, positions, block tables, key counts, write slots."""
    gen = torch.Generator().manual_seed(rows)
    hidden = lm.lm.config.hidden_size
    embeds = torch.randn(rows, hidden, generator=gen)
    num_keys = torch.randint(1, NUM_BLOCKS * BLOCK_SIZE + 1, (rows,), generator=gen)
    tables = torch.stack(
        [torch.randperm(lm.kv_pool.num_blocks, generator=gen)[:NUM_BLOCKS] for _ in range(rows)]
    )
    slots = tables.gather(1, ((num_keys - 1) // BLOCK_SIZE).unsqueeze(1)).squeeze(1) * BLOCK_SIZE
    slots += (num_keys - 1) % BLOCK_SIZE
    positions = (num_keys - 1).unsqueeze(0) + torch.arange(position_rows).unsqueeze(1) * 3  # rows differ
    return embeds, positions, tables, num_keys, slots


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_fused_layers_give_transformers_hidden_states_and_kv(tiny_model: Callable[[str], Path], family: str):
    runner = ModelRunner(str(tiny_model(family)), device="cpu", kv_cache_tokens=1024, decode_graphs=False)
    lm = runner.lm_forward
    assert isinstance(lm, PagedLanguageModel)
    assert fusable(lm.layers)
    position_rows = 1 if family == "llava" else 3
    torch.manual_seed(0)
    lm.kv_pool.kv.normal_()
    before = lm.kv_pool.kv.clone()
    for rows in (1, 5):
        embeds, positions, tables, num_keys, slots = decode_step(lm, rows, position_rows)
        lm.kv_pool.kv.copy_(before)
        with torch.inference_mode():
            expected = lm.decoder(
                embeds, positions, FixedDecodeAttention(lm.kv_pool, tables, num_keys, slots)
            )
        expected_kv = lm.kv_pool.kv.clone()
        lm.kv_pool.kv.copy_(before)
        with torch.inference_mode():
            step = FixedDecodeAttention(lm.kv_pool, tables, num_keys, slots)
            got = FusedDecoder(lm.lm, lm.layers, use_triton=False)(embeds, positions, step)
        assert torch.equal(got, expected), (got - expected).abs().max()
        assert torch.equal(lm.kv_pool.kv, expected_kv)
        assert not torch.equal(expected_kv, before)


def test_a_layer_of_another_shape_is_not_fused(tiny_model: Callable[[str], Path]):
    runner = ModelRunner(str(tiny_model("llava")), device="cpu", kv_cache_tokens=1024, decode_graphs=False)
    lm = runner.lm_forward
    assert isinstance(lm, PagedLanguageModel)
    layer = lm.layers[0]
    layer.mlp.extra = torch.nn.Linear(2, 2)  # weights the fused path would not apply
    assert not fusable(lm.layers)
    del layer.mlp.extra
    layer.mlp.act_fn = torch.nn.GELU()
    assert not fusable(lm.layers)
