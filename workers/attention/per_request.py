"""The reference backend: one ``scaled_dot_product_attention`` call per request and layer, each over that
request's own K/V gathered from the pool. Simple and exact; its cost grows with the number of requests
in the step (one gather and one kernel call each, per layer). Tests compare the others against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.attention.base import SeqSpan, StepAttention, slot_matrix, write_slots
from workers.kv_pool import KVPool


class PerRequestAttention(StepAttention):
    def __init__(self, pool: KVPool, spans: list[SeqSpan], device: torch.device) -> None:
        slots = slot_matrix(spans, pool.block_size, max(s.num_kv_tokens for s in spans))
        # one host-to-device copy for the step: every span's read slots, then the write slots
        read = [slots[row, : s.num_kv_tokens] for row, s in enumerate(spans)]
        writes = write_slots(spans, pool.block_size)
        parts = torch.cat([*read, writes]).to(device).split([len(t) for t in read] + [len(writes)])
        super().__init__(pool, spans, parts[-1])
        self.read = list(parts[:-1])

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        num_heads, num_tokens, head_dim = query.shape
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
        start = 0
        for span, read_slots in zip(self.spans, self.read, strict=True):
            end = start + span.num_new_tokens
            k_all, v_all = self.pool.read(layer_idx, read_slots)  # [num_kv, kv_heads, d]
            mask = None
            if span.num_new_tokens > 1 and span.num_past_tokens > 0:
                # Query i sits at index past + i and sees keys 0..past + i.
                mask = torch.ones(
                    span.num_new_tokens, k_all.shape[0], dtype=torch.bool, device=query.device
                ).tril(diagonal=span.num_past_tokens)
            o = F.scaled_dot_product_attention(
                query[:, start:end].unsqueeze(0),
                k_all.transpose(0, 1).unsqueeze(0),
                v_all.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=span.num_new_tokens > 1 and span.num_past_tokens == 0,
                scale=scaling,
                enable_gqa=num_heads != k_all.shape[1],
            )
            out[start:end] = o[0].transpose(0, 1)
            start = end
        return out
