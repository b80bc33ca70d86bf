"""Attention over the paged KV pool, plugged into the checkpoint's own transformers modules.

transformers' attention layers look their attention function up by ``config._attn_implementation`` in
``AttentionInterface``. The worker registers ``paged_attention`` under ``PAGED_ATTENTION`` and sets that
name on the language model's config (the vision tower keeps its own), so every family's decoder layers run
unchanged — projections, their own RoPE flavour (1-D, M-RoPE, interleaved M-RoPE), norms, MLPs — and only
the attention step reads and writes the pool. One step's tokens from all requests are one sequence::

    tokens:   [ req A chunk (past 0, 100 new) | req B decode (past 612, 1 new) | ... ]
    write      K/V of all 101 tokens -> their slots (A's table, B's table)
    attention  A: q[0:100]  x  K[slots_A(0:100)]   causal
               B: q[100:101] x K[slots_B(0:613)]   sees everything

The step's ``StepAttention`` (built once per step by the attention backend, ``workers.attention``)
reaches the function as the ``paged_step`` keyword, which transformers passes through the decoder
layers untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface

from workers.attention import StepAttention

PAGED_ATTENTION = "mmserve_paged"


def paged_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_step: StepAttention | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, heads, T, d], key/value [1, kv_heads, T, d]
    (RoPE applied) -> ([1, T, heads, d], no weights). Writes the step's K/V of layer
    ``module.layer_idx`` into the pool, then runs causal attention per request over its pooled K/V."""
    assert paged_step is not None, "paged attention runs only inside a worker step"
    return paged_step(module.layer_idx, query[0], key[0], value[0], scaling).unsqueeze(0), None


def register_paged_attention() -> None:
    """Make ``PAGED_ATTENTION`` a name transformers' attention layers can look up (idempotent)."""
    AttentionInterface.register(PAGED_ATTENTION, paged_attention)
