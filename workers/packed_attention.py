"""The Qwen vision towers' packed attention as one call per layer instead of one per window.

A Qwen vision tower packs every image of a batch into one sequence and attends within spans of it
(``cu_seqlens``: each image or video frame group, and in Qwen2.5-VL's window layers each 112-pixel
window, about a hundred per 1024-pixel image). transformers hands those spans to its attention function
in one call only when the implementation's name says flash attention; any other implementation gets one
call per span, each a few small kernels, and on a GPU the windows alone took ~190 ms per image, bound by
launches. ``PACKED_ATTENTION`` (a name containing "flash" for that reason, registered through
transformers' ``AttentionInterface`` and set on the vision config only) takes the packed call and runs
it as one padded batch::

    spans [a | b b | c c c]  ->  q/k/v [spans, heads, longest, d] (padding rows repeat the span's first)
                                 one attention call, keys past each span's length masked
                                 -> the real rows back in packed order

Each span attends exactly its own tokens, as in transformers' per-span loop; only rounding differs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

PACKED_ATTENTION = "mmserve_packed_flash_api"


def packed_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query/key/value [1, heads, N, d] packed by ``cu_seq_lens_q`` -> ([1, N, heads, d], no weights)."""
    assert cu_seq_lens_q is not None, "the packed attention is called with the spans' bounds"
    bounds = cu_seq_lens_q.tolist()
    if len(bounds) == 2:  # one span: plain attention
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling)
        return out.transpose(1, 2), None
    rows, real_rows, mask = _plan(bounds, query.device, query.dtype)
    num_spans, longest = mask.shape[0], mask.shape[-1]
    _, num_heads, _, head_dim = query.shape

    def batched(t: torch.Tensor) -> torch.Tensor:  # [1, heads, N, d] -> [spans, heads, longest, d]
        return t[0].index_select(1, rows).view(num_heads, num_spans, longest, head_dim).transpose(0, 1)

    out = F.scaled_dot_product_attention(
        batched(query), batched(key), batched(value), attn_mask=mask, scale=scaling
    )
    out = out.transpose(1, 2).reshape(num_spans * longest, num_heads, head_dim).index_select(0, real_rows)
    return out.unsqueeze(0), None


def _plan(bounds: list[int], device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(packed row of each padded row [spans * longest], the padded rows that are real, in packed order,
    additive key mask [spans, 1, 1, longest]) for the spans between ``bounds``."""
    starts = torch.tensor(bounds[:-1], dtype=torch.long)
    lengths = torch.tensor(bounds[1:], dtype=torch.long) - starts
    offsets = torch.arange(int(lengths.max()), dtype=torch.long)
    real = offsets.unsqueeze(0) < lengths.unsqueeze(1)  # [spans, longest]
    rows = starts.unsqueeze(1) + torch.where(real, offsets.unsqueeze(0), 0)
    mask = torch.zeros(real.shape, dtype=dtype).masked_fill_(~real, float("-inf"))
    real_rows = real.flatten().nonzero().squeeze(1)
    return (
        rows.flatten().to(device),
        real_rows.to(device),
        mask.view(real.shape[0], 1, 1, -1).to(device),
    )


def use_packed_attention(vision_config: Any) -> None:
    """Route a vision tower's attention (the config its attention modules read) through
    ``packed_attention``."""
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    vision_config._attn_implementation = PACKED_ATTENTION
