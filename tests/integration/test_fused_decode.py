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


def storage_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the module's parameters."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()}
    return sum(storages.values())


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl", "qwen3_vl"])
def test_merged_projections_are_views_and_compute_the_same(tiny_model: Callable[[str], Path], family: str):
    """The GPU's path merges each layer's q/k/v and gate/up projections: the modules then hold views of
    the merged weights (no memory added), and the fused layers on merged projections give transformers'
    hidden states and K/V within float32 rounding (here a one-row matmul may sum in another order with
    more columns, or with its weights at another alignment: safetensors' mapped weights are 8-byte
    aligned, the merged ones 64-byte)."""
    runner = ModelRunner(str(tiny_model(family)), device="cpu", kv_cache_tokens=1024, decode_graphs=False)
    lm = runner.lm_forward
    assert isinstance(lm, PagedLanguageModel)
    torch.manual_seed(0)
    lm.kv_pool.kv.normal_()
    before_kv = lm.kv_pool.kv.clone()
    inputs = [decode_step(lm, rows, 1 if family == "llava" else 3) for rows in (1, 5)]

    def eager(embeds, positions, tables, num_keys, slots):  # type: ignore[no-untyped-def]
        lm.kv_pool.kv.copy_(before_kv)
        with torch.inference_mode():
            hidden = lm.decoder(embeds, positions, FixedDecodeAttention(lm.kv_pool, tables, num_keys, slots))
        return hidden, lm.kv_pool.kv.clone()

    expected = [eager(*step) for step in inputs]
    memory = storage_bytes(lm.lm)
    decoder = FusedDecoder(lm.lm, lm.layers, use_triton=False, merge=True)
    assert storage_bytes(lm.lm) == memory
    for layer, merged in zip(lm.layers, decoder.merged, strict=True):
        assert merged is not None
        attn, mlp = layer.self_attn, layer.mlp
        for weight, modules in ((merged.qkv_weight, (attn.q_proj, attn.k_proj, attn.v_proj)),
                                (merged.gate_up_weight, (mlp.gate_proj, mlp.up_proj))):  # fmt: skip
            assert torch.equal(torch.cat([m.weight for m in modules]), weight)
            assert all(
                m.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr() for m in modules
            )
        assert (merged.qkv_bias is not None) == (attn.q_proj.bias is not None)
    again = FusedDecoder(lm.lm, lm.layers, use_triton=False, merge=True)
    assert all(a is b for a, b in zip(again.merged, decoder.merged, strict=True))  # merged once
    for step, (hidden, kv) in zip(inputs, expected, strict=True):
        embeds, positions, tables, num_keys, slots = step
        lm.kv_pool.kv.copy_(before_kv)
        with torch.inference_mode():
            got = decoder(embeds, positions, FixedDecodeAttention(lm.kv_pool, tables, num_keys, slots))
        torch.testing.assert_close(got, hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lm.kv_pool.kv, kv, rtol=1e-5, atol=1e-5)
