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

The step's spans and slots reach the function as the ``paged_step`` keyword, which transformers passes
through the decoder layers untouched. Slot indices are computed once per step and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from workers.kv_pool import KVPool

PAGED_ATTENTION = "mmserve_paged"


@dataclass(frozen=True)
class SeqSpan:
    """One request's slice of the step's flattened tokens."""

    req_id: str
    num_past_tokens: int  # tokens whose KV is in its blocks = index of its first token this step
    num_new_tokens: int
    block_ids: list[int]  # its block table; covers num_past_tokens + num_new_tokens positions


@dataclass(frozen=True)
class PagedStep:
    """Pool slots of one step, on the device: where the step's tokens are written (in token order)
    and, per span, the slots of all its positions [0, num_past + num_new) that attention reads."""

    pool: KVPool
    spans: list[SeqSpan]
    write: torch.Tensor  # [num_tokens]
    read: list[torch.Tensor]  # one [num_past + num_new] per span

    @classmethod
    def build(cls, pool: KVPool, spans: list[SeqSpan], device: torch.device) -> PagedStep:
        read = [pool.slot_ids(s.block_ids, s.num_past_tokens + s.num_new_tokens) for s in spans]
        write = torch.cat([slots[s.num_past_tokens :] for s, slots in zip(spans, read, strict=True)])
        # One host-to-device copy for the whole step.
        parts = torch.cat([*read, write]).to(device).split([len(t) for t in read] + [len(write)])
        return cls(pool=pool, spans=spans, write=parts[-1], read=list(parts[:-1]))


def paged_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_step: PagedStep | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, heads, T, d], key/value [1, kv_heads, T, d]
    (RoPE applied) -> ([1, T, heads, d], no weights). Writes the step's K/V of layer
    ``module.layer_idx`` into the pool, then runs causal attention per request over its pooled K/V."""
    assert paged_step is not None, "paged attention runs only inside a worker step"
    layer_idx = module.layer_idx
    pool = paged_step.pool
    # All writes before any read: a request may read a block another one fills this step.
    pool.write(layer_idx, paged_step.write, key[0].transpose(0, 1), value[0].transpose(0, 1))
    q = query[0]  # [heads, T, d]
    num_heads = q.shape[0]
    out = torch.empty(q.shape[1], num_heads, q.shape[2], dtype=q.dtype, device=q.device)
    start = 0
    for span, read_slots in zip(paged_step.spans, paged_step.read, strict=True):
        end = start + span.num_new_tokens
        k_all, v_all = pool.read(layer_idx, read_slots)  # [num_kv, kv_heads, d]
        mask = None
        if span.num_new_tokens > 1 and span.num_past_tokens > 0:
            # Query i sits at index past + i and sees keys 0..past + i.
            mask = torch.ones(span.num_new_tokens, k_all.shape[0], dtype=torch.bool, device=q.device).tril(
                diagonal=span.num_past_tokens
            )
        o = F.scaled_dot_product_attention(
            q[:, start:end].unsqueeze(0),
            k_all.transpose(0, 1).unsqueeze(0),
            v_all.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=span.num_new_tokens > 1 and span.num_past_tokens == 0,
            scale=scaling,
            enable_gqa=num_heads != k_all.shape[1],
        )
        out[start:end] = o[0].transpose(0, 1)
        start = end
    return out.unsqueeze(0), None


def register_paged_attention() -> None:
    """Make ``PAGED_ATTENTION`` a name transformers' attention layers can look up (idempotent)."""
    AttentionInterface.register(PAGED_ATTENTION, paged_attention)
